"""Token probabilities: llama-server's ``n_probs`` and OpenAI's ``logprobs``.

A real server on gemma-3-270m (262k vocabulary) with the tiny FIM model
for /infill; the openai client reads the OpenAI shapes.  Greedy requests
(temperature 0) pin what must hold exactly: the chosen token is the most
likely one, after the sampler chain it had probability 1, and the tokens'
text joins to the content.
"""

import math

import openai
import pytest

from offgrid.engine.textstream import TextAssembler, TokenLedger

try:
    from .serverproc import ServerProcess
except ImportError:
    from serverproc import ServerProcess

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def srv(gemma_path, fim_model_path):
    with ServerProcess(gemma_path, "--fim-model", fim_model_path, "-a", "gemma",
                       threads=1, ctx=1024) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0)


def _chat(client, **kw):
    return client.chat.completions.create(
        model="gemma", messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=12, temperature=0, **kw)


def _assert_top_is_a_distribution(entries, n):
    for e in entries:
        assert len(e.top_logprobs) == n
        lps = [t.logprob for t in e.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert sum(math.exp(lp) for lp in lps) <= 1.0 + 1e-6


# -- OpenAI chat -----------------------------------------------------------------------

def test_chat_logprobs_cover_the_content_and_pick_the_most_likely(client):
    r = _chat(client, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert content and "".join(e.token for e in content) == r.choices[0].message.content
    _assert_top_is_a_distribution(content, 3)
    for e in content:
        assert e.logprob == e.top_logprobs[0].logprob and e.token == e.top_logprobs[0].token
        assert e.logprob <= 0 and bytes(e.bytes).decode("utf-8") == e.token


def test_chat_stream_carries_each_chunks_tokens(client):
    chunks = list(_chat(client, logprobs=True, top_logprobs=3, stream=True))
    text, tokens = "", []
    for c in chunks:
        if not c.choices:
            continue
        delta, lp = c.choices[0].delta, c.choices[0].logprobs
        piece = delta.content or ""
        if lp is not None:
            assert "".join(e.token for e in lp.content) == piece
            _assert_top_is_a_distribution(lp.content, 3)
            tokens += lp.content
        else:
            assert not piece
        text += piece
    assert tokens and text == _chat(client).choices[0].message.content


def test_chat_top_logprobs_zero_gives_the_chosen_tokens_only(client):
    r = _chat(client, logprobs=True)
    content = r.choices[0].logprobs.content
    assert content and all(e.top_logprobs == [] and e.logprob <= 0 for e in content)


def test_chat_without_logprobs_has_none(client):
    assert _chat(client).choices[0].logprobs is None


@pytest.mark.parametrize("body", [
    {"logprobs": "yes"}, {"logprobs": True, "top_logprobs": 21},
    {"logprobs": True, "top_logprobs": -1}, {"logprobs": True, "top_logprobs": "3"},
    {"top_logprobs": 2},
])
def test_chat_bad_logprobs_are_400(srv, body):
    body = dict(body, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert srv.post("/v1/chat/completions", body)[0] == 400


# -- OpenAI completions ------------------------------------------------------------------

def test_completions_logprobs_in_openais_shape(client):
    r = client.completions.create(model="gemma", prompt=PROMPT, max_tokens=8, temperature=0,
                                  logprobs=2)
    choice = r.choices[0]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(
        lp.text_offset) == r.usage.completion_tokens
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and max(top.values()) == logprob and top[token] == logprob


def test_completions_stream_logprobs_per_chunk(client):
    chunks = list(client.completions.create(model="gemma", prompt=PROMPT, max_tokens=8,
                                            temperature=0, logprobs=1, stream=True))
    offsets, text = [], ""
    for c in chunks:
        lp = c.choices[0].logprobs
        if lp is None:
            assert not c.choices[0].text
            continue
        assert "".join(lp.tokens) == c.choices[0].text
        offsets += lp.text_offset
        text += c.choices[0].text
    assert text and offsets[0] == 0 and offsets == sorted(offsets)


def test_completions_bad_logprobs_are_400(srv):
    for v in ("2", -1, 5000, 2.5):
        assert srv.post("/v1/completions", {"prompt": "x", "max_tokens": 2,
                                            "logprobs": v})[0] == 400


# -- llama.cpp /completion and /infill -----------------------------------------------

def _native(srv, **kw):
    body = dict({"prompt": PROMPT, "n_predict": 8, "temperature": 0}, **kw)
    status, _, out = srv.post("/completion", body)
    assert status == 200, out
    return out


def test_n_probs_gives_logprobs_of_the_raw_distribution(srv):
    out = _native(srv, n_probs=4)
    probs = out["completion_probabilities"]
    assert len(probs) == out["tokens_predicted"]
    assert "".join(p["token"] for p in probs) == out["content"]
    for p in probs:
        assert set(p) == {"id", "token", "bytes", "logprob", "top_logprobs"}
        top = p["top_logprobs"]
        assert len(top) == 4 and set(top[0]) == {"id", "token", "bytes", "logprob"}
        assert top[0]["id"] == p["id"] and top[0]["logprob"] == p["logprob"]
        assert sum(math.exp(t["logprob"]) for t in top) <= 1.0 + 1e-6
        assert bytes(p["bytes"]).decode("utf-8") == p["token"]
    assert out["generation_settings"]["n_probs"] == 4


def test_post_sampling_probs_at_temperature_0_are_certain(srv):
    probs = _native(srv, n_probs=4, post_sampling_probs=True)["completion_probabilities"]
    assert probs
    for p in probs:
        assert set(p) == {"id", "token", "bytes", "prob", "top_probs"}
        assert p["prob"] == 1.0 and [t["id"] for t in p["top_probs"]] == [p["id"]]


def test_post_sampling_probs_follow_the_sampler_chain(srv):
    # top_k 3 leaves three candidates: their probabilities, renormalised, sum to 1
    probs = _native(srv, n_probs=5, post_sampling_probs=True, temperature=1.0, top_k=3,
                    top_p=1.0, min_p=0.0, seed=7)["completion_probabilities"]
    for p in probs:
        top = p["top_probs"]
        assert 1 <= len(top) <= 3 and abs(sum(t["prob"] for t in top) - 1.0) < 1e-4
        assert p["prob"] in [t["prob"] for t in top]


def test_streamed_events_carry_exactly_their_tokens(srv):
    status, events = srv.stream("/completion", {"prompt": PROMPT, "n_predict": 10,
                                                "temperature": 0, "n_probs": 2,
                                                "stream": True})
    assert status == 200
    final = events[-1]
    assert final["stop"] and "completion_probabilities" not in final
    n = 0
    for e in events[:-1]:
        probs = e["completion_probabilities"]
        assert "".join(p["token"] for p in probs) == e["content"]
        n += len(probs)
    assert n == final["tokens_predicted"]


def test_stop_string_tokens_are_left_out(srv):
    plain = _native(srv, n_predict=12)["content"]
    stop = " " + plain.split()[2]      # a whole token of the greedy text
    out = _native(srv, n_predict=12, n_probs=1, stop=[stop])
    assert out["stop_type"] == "word" and out["content"] == plain[:plain.index(stop)]
    tokens = "".join(p["token"] for p in out["completion_probabilities"])
    assert tokens == out["content"]


def test_n_probs_0_carries_no_probabilities(srv):
    assert "completion_probabilities" not in _native(srv, n_probs=0)
    status, events = srv.stream("/completion", {"prompt": PROMPT, "n_predict": 4,
                                                "stream": True})
    assert status == 200 and all("completion_probabilities" not in e for e in events)


def test_infill_n_probs(srv):
    status, _, out = srv.post("/infill", {"input_prefix": "def add(a, b):\n    return ",
                                          "input_suffix": "\n", "n_predict": 4, "n_probs": 2,
                                          "temperature": 0})
    assert status == 200
    probs = out["completion_probabilities"]
    assert len(probs) == 4 and all(len(p["top_logprobs"]) == 2 for p in probs)


def test_streamed_infill_bytes_join_to_the_content(srv):
    # the tiny model's output is random bytes: characters split across tokens
    status, events = srv.stream("/infill", {"input_prefix": "x = ", "input_suffix": "\n",
                                            "n_predict": 40, "n_probs": 1, "stream": True,
                                            "temperature": 0})
    assert status == 200
    pieces = events[:-1]
    data = b"".join(bytes(p["bytes"]) for e in pieces for p in e["completion_probabilities"])
    assert data.decode("utf-8", "replace") == "".join(e["content"] for e in pieces)
    assert all(e["completion_probabilities"] for e in pieces if e["content"])
    assert sum(len(e["completion_probabilities"]) for e in pieces) == 40


@pytest.mark.parametrize("body", [{"n_probs": "3"}, {"n_probs": True}, {"n_probs": 5000},
                                  {"n_probs": 2, "post_sampling_probs": "yes"}])
def test_native_bad_n_probs_are_400(srv, body):
    assert srv.post("/completion", dict(body, prompt="x", n_predict=2))[0] == 400


def test_plain_generation_is_unchanged_by_the_feature(srv):
    with_probs = _native(srv, n_probs=3)
    assert _native(srv)["content"] == with_probs["content"]


# -- attributing tokens to released text (no model) ------------------------------------

def _run(pieces, stops=()):
    text, ledger, events = TextAssembler(stops), TokenLedger(), []
    for i, data in enumerate(pieces):
        released, stopped = text.add(data)
        ledger.add(data, i)
        got = ledger.release(text.sent, len(text.text) if stopped else None)
        if released or got:
            events.append((released, got))
        if stopped:
            break
    tail = text.finish()
    got = ledger.finish() if text.stop_word is None else []
    if tail or got:
        events.append((tail, got))
    return events, ledger.released


def test_a_split_character_goes_with_the_piece_that_shows_it():
    e_acute = "é".encode()
    events, _ = _run([b"caf", e_acute[:1], e_acute[1:], b"!"])
    assert events == [("caf", [0]), ("é", [1, 2]), ("!", [3])]


def test_held_stop_prefix_tokens_go_with_their_text():
    events, _ = _run([b"a", b"<", b"b", b"c"], stops=["<x"])
    assert events == [("a", [0]), ("<b", [1, 2]), ("c", [3])]


def test_tokens_inside_a_stop_string_are_dropped():
    events, released = _run([b"ab", b"c<", b"x", b"yz"], stops=["<x"])
    # "c<" shows "c" before the stop string: it stays, with that piece
    assert events == [("ab", [0]), ("c", [1])] and released == [0, 1]
