"""What llama-server's own tests showed offgrid lacking, over real HTTP on SmolLM2.

Each test pins one behaviour llama-server has and offgrid now shares (see
tests/conformance/, ``make conformance``): several prompts in one request,
``n`` choices, ``logit_bias`` keyed by text, ``return_progress``, the chat
token count, llama-server's /metrics counters, the checks of assistant
prefill, and the server-wide ``--reasoning`` default.
"""

import http.client
import math
import socket

import pytest

try:
    from .serverproc import ServerProcess
except ImportError:
    from serverproc import ServerProcess

PROMPT = "The three primary colors are"
# greedy and the cache off: the same prompt gives the same tokens, whatever ran before
GREEDY = {"temperature": 0.0, "cache_prompt": False}


@pytest.fixture(scope="module")
def srv(smollm_path):
    with ServerProcess(smollm_path, "-np", "2", "-b", "32", "--seed", "42", threads=1,
                       ctx=1024) as s:
        yield s


def chat_body(**extra):
    # ignore_eos: every choice runs to max_tokens, so counts are exact
    return dict({"messages": [{"role": "user", "content": "Tell me a long story."}],
                 "max_tokens": 6, "ignore_eos": True}, **extra)


# -- several prompts, several completions ---------------------------------------------

def test_completion_with_several_prompts_answers_a_list_in_their_order(srv):
    tokens = srv.post("/tokenize", {"content": PROMPT, "add_special": True})[2]["tokens"]
    single = srv.post("/completion", dict(GREEDY, prompt=PROMPT, n_predict=6))[2]
    status, _, body = srv.post("/completion", dict(
        GREEDY, n_predict=6, prompt=[tokens, PROMPT, {"prompt_string": PROMPT}]))
    assert status == 200 and isinstance(body, list), body
    assert [r["index"] for r in body] == [0, 1, 2]
    assert [r["content"] for r in body] == [single["content"]] * 3


def test_a_mixed_list_of_ids_and_text_is_still_one_prompt(srv):
    tokens = srv.post("/tokenize", {"content": PROMPT})[2]["tokens"]
    status, _, body = srv.post("/completion", dict(GREEDY, n_predict=2,
                                                   prompt=tokens[:2] + [" and"] + tokens[2:]))
    assert status == 200 and isinstance(body, dict) and isinstance(body["content"], str)


def test_several_prompts_stream_each_result_under_its_index(srv):
    status, events = srv.stream("/completion", dict(GREEDY, n_predict=4, stream=True,
                                                    prompt=[PROMPT, "Once upon a time"]))
    assert status == 200
    finals = [e for e in events if e["stop"]]
    # the two run side by side and either may end first (llama-server sends each
    # result when it comes, too): one final under each index is the contract
    assert sorted(e["index"] for e in finals) == [0, 1]
    for index in (0, 1):
        pieces = [e for e in events if e["index"] == index and not e["stop"]]
        assert pieces and all(e["content"] is not None for e in pieces)


def test_n_on_completion_gives_that_many_results(srv):
    status, _, body = srv.post("/completion", {"prompt": PROMPT, "n_predict": 4, "n": 2,
                                               "seed": 7})
    assert status == 200 and [r["index"] for r in body] == [0, 1]


def test_chat_n_gives_that_many_choices_and_counts_their_tokens(srv):
    status, _, body = srv.post("/v1/chat/completions", chat_body(n=2, id_slot=0))
    assert status == 200
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["message"]["role"] == "assistant" and c["finish_reason"] == "length"
               for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 12      # 6 per choice


def test_chat_n_streams_each_choice_under_its_index(srv):
    status, events = srv.stream("/v1/chat/completions", chat_body(n=2, stream=True))
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": None}
        assert mine[-1]["finish_reason"] == "length"
    assert len({c["id"] for c in chunks}) == 1


def test_v1_completions_takes_several_prompts_and_n(srv):
    status, _, body = srv.post("/v1/completions", {"prompt": [PROMPT, "Once upon a time"],
                                                   "max_tokens": 3, "n": 2, "ignore_eos": True})
    assert status == 200
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["completion_tokens"] == 12
    one = srv.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3})[2]
    two = srv.post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 3})[2]
    assert body["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"] \
        + two["usage"]["prompt_tokens"]


# -- logit_bias keyed by text ---------------------------------------------------------

def _first_token(srv, **extra):
    body = srv.post("/completion", dict(GREEDY, prompt=PROMPT, n_predict=3, return_tokens=True,
                                        **extra))[2]
    return body["tokens"][0], body


@pytest.mark.parametrize("openai_style", [False, True])
def test_logit_bias_by_text_bans_every_token_of_that_text(srv, openai_style):
    first, _ = _first_token(srv)
    piece = srv.post("/detokenize", {"tokens": [first]})[2]["content"]
    ids = srv.post("/tokenize", {"content": piece, "parse_special": False})[2]["tokens"]
    assert first in ids         # the premise: the piece's text is that token again
    bias = {piece: -100} if openai_style else [[piece, False]]
    again, body = _first_token(srv, logit_bias=bias)
    assert again != first
    want = -100.0 if openai_style else False
    assert all([t, want] in body["generation_settings"]["logit_bias"] for t in ids)


def test_logit_bias_by_text_works_on_chat_too(srv):
    ids = srv.post("/tokenize", {"content": " red", "parse_special": False})[2]["tokens"]
    status, _, body = srv.post("/v1/chat/completions", chat_body(
        logit_bias={" red": -100}, verbose=True))
    assert status == 200
    assert all([t, -100.0] in body["__verbose"]["generation_settings"]["logit_bias"]
               for t in ids)


def test_a_token_id_outside_the_vocabulary_is_still_a_400(srv):
    status, _, body = srv.post("/completion", {"prompt": "x", "logit_bias": [[10 ** 7, 1]]})
    assert status == 400 and "logit_bias" in body["error"]["message"]


# -- return_progress ------------------------------------------------------------------

LONG = "the quick brown fox jumps over the lazy dog " * 10


def _check_progress(progress, n_batch=32):
    first, last = progress[0], progress[-1]
    assert first["cache"] == first["processed"]
    assert last["processed"] == last["total"] > 0
    for a, b in zip(progress, progress[1:]):
        assert (b["total"], b["cache"]) == (a["total"], a["cache"])
        assert b["processed"] > a["processed"]
    # one report before the first batch, one after each
    assert len(progress) == 1 + math.ceil((last["total"] - first["cache"]) / n_batch)


def test_completion_reports_prompt_progress_batch_by_batch(srv):
    status, events = srv.stream("/completion", dict(GREEDY, prompt=LONG, n_predict=2,
                                                    stream=True, return_progress=True,
                                                    timings_per_token=True))
    assert status == 200
    progress = [e for e in events if "prompt_progress" in e]
    assert len(progress) > 2
    _check_progress([e["prompt_progress"] for e in progress])
    assert progress[0]["timings"]["prompt_n"] == 0 and progress[0]["timings"]["prompt_ms"] == 0
    assert progress[-1]["timings"]["prompt_n"] == progress[-1]["prompt_progress"]["total"]
    assert events[-1]["stop"] and events[-1]["timings"]["prompt_n"] > 0


def test_chat_reports_prompt_progress_and_the_cache_it_reused(srv):
    body = chat_body(messages=[{"role": "user", "content": LONG}], stream=True,
                     return_progress=True, id_slot=1, max_tokens=2)
    srv.stream("/v1/chat/completions", body)       # fills slot 1's cache
    status, events = srv.stream("/v1/chat/completions", body)
    assert status == 200 and events[-1] == "[DONE]"
    progress = [e["prompt_progress"] for e in events[:-1] if "prompt_progress" in e]
    assert progress[0]["cache"] > 0
    _check_progress(progress)


def test_without_return_progress_no_progress_is_sent(srv):
    status, events = srv.stream("/completion", dict(GREEDY, prompt=LONG, n_predict=2,
                                                    stream=True))
    assert status == 200 and not any("prompt_progress" in e for e in events)


# -- what each streamed chunk carries -------------------------------------------------

def test_streamed_completion_chunks_carry_their_token_ids(srv):
    status, events = srv.stream("/completion", dict(GREEDY, prompt=PROMPT, n_predict=8,
                                                    ignore_eos=True, stream=True,
                                                    return_tokens=True))
    assert status == 200
    pieces, final = events[:-1], events[-1]
    assert final["stop"] and len(final["tokens"]) == 8      # return_tokens: all of them
    assert pieces and all(e["tokens"] for e in pieces), pieces
    # every generated token once, in order, each with the piece that shows its text
    assert [t for e in pieces for t in e["tokens"]] == final["tokens"]
    text = [srv.post("/detokenize", {"tokens": e["tokens"]})[2]["content"] for e in pieces]
    assert text == [e["content"] for e in pieces]
    assert pieces[-1]["tokens_predicted"] == 8
    # without return_tokens the chunks still carry theirs (llama-server's), the end none
    plain = srv.stream("/completion", dict(GREEDY, prompt=PROMPT, n_predict=3, stream=True))[1]
    assert all(e["tokens"] for e in plain[:-1]) and plain[-1]["tokens"] == []


def test_timings_per_token_puts_the_counts_so_far_on_every_chunk(srv):
    status, events = srv.stream("/completion", dict(GREEDY, prompt=PROMPT, n_predict=5,
                                                    ignore_eos=True, stream=True,
                                                    timings_per_token=True))
    assert status == 200
    counts = [e["timings"]["predicted_n"] for e in events if not e["stop"]]
    assert counts == sorted(counts) and counts[-1] == 5 and counts[0] >= 1
    assert all(e["timings"]["prompt_n"] + e["timings"]["cache_n"] > 0 for e in events)
    status, events = srv.stream("/v1/chat/completions", chat_body(stream=True,
                                                                  timings_per_token=True))
    chunks = [e for e in events[:-1] if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert chunks and all(c["timings"]["predicted_n"] >= 1 for c in chunks)
    assert "timings" not in events[0]       # the role chunk comes before any token
    plain = srv.stream("/completion", dict(GREEDY, prompt=PROMPT, n_predict=3, stream=True))[1]
    assert not any("timings" in e for e in plain if not e["stop"])


# -- the chat token count --------------------------------------------------------------

def test_chat_input_tokens_is_the_prompt_a_chat_would_evaluate(srv):
    body = chat_body(max_tokens=1)
    status, _, count = srv.post("/chat/completions/input_tokens", body)
    assert status == 200 and count["object"] == "response.input_tokens"
    used = srv.post("/v1/chat/completions", body)[2]["usage"]["prompt_tokens"]
    assert count["input_tokens"] == used
    assert srv.post("/v1/chat/completions/input_tokens", body)[2] == count


# -- /metrics ---------------------------------------------------------------------------

def test_metrics_has_llama_servers_counters_and_gauges(srv):
    before = srv.metrics()
    body = srv.post("/completion", dict(GREEDY, prompt=LONG, n_predict=5, ignore_eos=True))[2]
    status, _, text = srv.get("/metrics")
    after = srv.metrics()
    # a prompt in batches of 32, then one decode per token after the first
    n_prompt = math.ceil(body["timings"]["prompt_n"] / 32)
    assert after["llamacpp:n_decode_total"] - before["llamacpp:n_decode_total"] == n_prompt + 4
    assert after["llamacpp:n_tokens_max"] >= body["tokens_cached"]
    for name, kind in [("n_decode_total", "counter"), ("n_tokens_max", "counter"),
                       ("spec_decode_num_drafts_total", "counter"),
                       ("prompt_tokens_seconds", "gauge"), ("predicted_tokens_seconds", "gauge"),
                       ("n_busy_slots_per_decode", "gauge")]:
        assert "# TYPE llamacpp:%s %s" % (name, kind) in text
        assert "# HELP llamacpp:%s " % name in text


def test_throughput_gauges_are_over_the_time_since_the_last_scrape(srv):
    srv.post("/completion", dict(GREEDY, prompt=PROMPT, n_predict=4))
    first = srv.metrics()
    assert first["llamacpp:prompt_tokens_seconds"] > 0
    assert first["llamacpp:predicted_tokens_seconds"] > 0
    idle = srv.metrics()       # nothing ran since the previous scrape
    assert idle["llamacpp:prompt_tokens_seconds"] == 0
    assert idle["llamacpp:predicted_tokens_seconds"] == 0


# -- assistant prefill and continue_final_message ---------------------------------------

TWO_TURNS = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


@pytest.mark.parametrize("extra, messages", [
    ({"continue_final_message": True}, TWO_TURNS),          # add_generation_prompt's default
    ({"continue_final_message": True, "add_generation_prompt": True}, TWO_TURNS),
    ({}, TWO_TURNS + [{"role": "assistant", "content": "again"}]),
    ({"continue_final_message": True, "add_generation_prompt": False},
     [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [
         {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]),
])
def test_prefill_requests_llama_server_refuses_are_400s(srv, extra, messages):
    status, _, body = srv.post("/v1/chat/completions", dict(chat_body(), messages=messages,
                                                            **extra))
    assert status == 400 and "error" in body


def test_continue_final_message_continues_the_assistants_text(srv):
    body = {"messages": TWO_TURNS, "continue_final_message": True,
            "add_generation_prompt": False}
    status, _, out = srv.post("/apply-template", body)
    assert status == 200 and out["prompt"].endswith("Hello")
    assert srv.post("/apply-template", {"messages": TWO_TURNS})[2] == out     # the prefill


# -- --reasoning ------------------------------------------------------------------------

def test_reasoning_off_closes_the_thinking_block_unless_a_request_asks(smollm_path, llama_src):
    template = llama_src / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja"
    with ServerProcess(smollm_path, "--chat-template", template, "--reasoning", "off",
                       threads=1, ctx=512) as s:
        ask = {"messages": [{"role": "user", "content": "What is today?"}]}
        assert s.post("/apply-template", ask)[2]["prompt"].endswith(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n")
        on = dict(ask, chat_template_kwargs={"enable_thinking": True})
        assert s.post("/apply-template", on)[2]["prompt"].endswith("<|im_start|>assistant\n")


# -- several addresses --------------------------------------------------------------------

def test_a_comma_list_of_hosts_listens_on_each(smollm_path):
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    with ServerProcess(smollm_path, "--host", "127.0.0.1,::1", threads=1, ctx=512) as s:
        for host in ("127.0.0.1", "::1"):
            c = http.client.HTTPConnection(host, s.port, timeout=30)
            try:
                c.request("GET", "/health")
                assert c.getresponse().status == 200, host
            finally:
                c.close()


# -- --context-shift ----------------------------------------------------------------------

@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.slow
def test_context_shift_lets_a_reply_run_past_a_full_context(smollm_path, shift):
    flags = ["--context-shift"] if shift else []
    with ServerProcess(smollm_path, *flags, threads=1, ctx=256) as s:
        n_ctx = s.get("/props")[2]["default_generation_settings"]["n_ctx"]
        status, _, body = s.post("/completion", {"prompt": LONG, "n_predict": 300,
                                                 "ignore_eos": True, "temperature": 0})
    assert status == 200 and body["truncated"] is True
    n = body["timings"]["prompt_n"] + body["timings"]["predicted_n"]
    if shift:
        assert body["timings"]["predicted_n"] == 300 and n > n_ctx
    else:
        assert n == n_ctx       # the context, full


def test_a_prefilled_assistant_message_in_parts_is_continued_with_blank_lines(srv):
    # llama-server's render_content: the continued message's text parts, "\n\n" between
    parts = [{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": parts}]
    assert srv.post("/apply-template", {"messages": msgs})[2]["prompt"].endswith("Wh\n\nill")


# -- n_cache_reuse on any completion ------------------------------------------------------

@pytest.mark.parametrize("path", ["/completion", "/v1/completions"])
def test_a_request_asking_n_cache_reuse_moves_cached_runs(srv, path):
    """llama-server reads ``n_cache_reuse`` from any completion request (FIM
    ones take --cache-reuse by default): a prompt with a piece cut out of its
    middle then reuses the cached text after the cut, moved back, instead of
    evaluating it again; without it, only the common prefix."""
    # notes of their own: no state another test kept serves them
    lines = ["Line %d of the %s notes: the %s came by the %s." % (i, path, a, b) for i, (a, b) in
             enumerate(zip(["river", "stone", "cloud", "maple", "harbor"] * 6,
                           ["lantern", "copper", "meadow", "violet", "anchor", "willow"] * 5))]
    # two cuts: a state kept of the first does not serve the second
    whole = "\n".join(lines)
    cut, other_cut = ("\n".join(lines[:8] + lines[n:]) for n in (14, 16))
    head = len(srv.post("/tokenize", {"content": "\n".join(lines[:8])})[2]["tokens"])
    n_cut = len(srv.post("/tokenize", {"content": other_cut})[2]["tokens"])

    def cached(prompt, **extra):
        status, _, body = srv.post(path, dict({"prompt": prompt, "max_tokens": 1, "n_predict": 1,
                                               "id_slot": 0}, **extra))
        assert status == 200, body
        return body["timings"]["cache_n"] if "timings" in body else \
            body["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(whole)
    assert head <= cached(cut) <= head + 8          # the prefix ("\nLine 1" shared) only
    cached(whole)
    # all but the prompt's last token, whose logits the answer needs
    assert cached(other_cut, n_cache_reuse=16) == n_cut - 1
