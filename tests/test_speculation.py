"""Speculative decoding from the request's own text (engine/lookup.py, session.py).

The drafts are checked against what the sampler picks at each position, so
the output must be plain decoding's: greedy generation with speculation is
compared token for token with generation without it, on real source files
and the real code model.  A decode of several tokens may differ from
single-token decodes in the last bits of a logit; where a greedy pick flips
the test demands that it was a near-tie and reports it.
"""

import pytest

from offgrid.engine.lookup import PromptLookup


def test_lookup_drafts_what_followed_the_last_occurrence():
    t = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    lk = PromptLookup(t)
    # the end (2, 3) and (1, 2, 3) last came before 4, 5, 9, ...
    assert lk.draft(3) == [4, 5, 9]
    lk.append(4)
    assert lk.draft(2) == [5, 9]        # (2, 3, 4) was followed by 5
    lk.append(7)                        # a new turn: (3, 4, 7) and (4, 7) never seen
    assert lk.draft(4) == []


def test_lookup_takes_the_latest_occurrence_and_falls_back_to_shorter_ngrams():
    lk = PromptLookup([5, 6, 1, 8, 6, 1, 2, 0, 6, 1])
    assert lk.draft(1) == [2]           # (6, 1) latest before the end: followed by 2
    lk = PromptLookup([4, 1, 7, 3, 1])
    assert lk.draft(2) == []            # (3, 1) never came before: no 1-gram drafts (n_min 2)
    assert lk.draft(0) == []


# -- on the real code model --------------------------------------------------

from pathlib import Path     # noqa: E402

from offgrid.engine.session import ChatSession       # noqa: E402
from offgrid.request import GenerationParams, SamplingParams   # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# real files of different kinds: Python, Markdown, C
FILES = [ROOT / "offgrid" / "server" / "pool.py", ROOT / "README.md",
         ROOT / "tests" / "gguf.py"]
NEAR_TIE = 0.25     # nats between the two most likely tokens


def _greedy(session, tokens, n, speculate, **kw):
    session.reset()
    gen = GenerationParams(n_predict=n, sampling=SamplingParams(temperature=0.0),
                           speculate=speculate, cache_prompt=False, **kw)
    return session.complete(tokens, gen)


@pytest.fixture(scope="module")
def sessions(qwen):
    plain = ChatSession(qwen, n_ctx=2048, n_threads=1)
    spec = ChatSession(qwen, n_ctx=2048, n_threads=1, draft_max=8)
    spec.draft_probation = 10 ** 6      # draft all the way: this checks the output
    yield plain, spec
    plain.close()
    spec.close()


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_greedy_speculation_is_plain_decoding(qwen, sessions, path):
    import math
    plain, spec = sessions
    text = path.read_text("utf-8")[:1500]
    tokens = qwen.tokenize(text, add_special=True, parse_special=False)
    a = _greedy(plain, tokens, 64, speculate=False)
    b = _greedy(spec, tokens, 64, speculate=True)
    assert b.usage.draft_tokens > 0, "no draft was ever made"
    assert 0 <= b.usage.draft_accepted <= b.usage.draft_tokens
    if a.tokens == b.tokens:
        return
    # where they part, plain decoding's pick must have been a near-tie
    i = next(i for i in range(min(len(a.tokens), len(b.tokens))) if a.tokens[i] != b.tokens[i])
    probe = _greedy(plain, tokens + a.tokens[:i], 1, speculate=False, with_probs=True,
                    n_probs=2)
    top = probe.probs[0].top
    assert {top[0].id, top[1].id} == {a.tokens[i], b.tokens[i]}
    margin = math.log(top[0].prob) - math.log(top[1].prob)
    print("%s: token %d differs, a near-tie of %.3f nats" % (path.name, i, margin))
    assert margin < NEAR_TIE, (path.name, i, margin)


def test_drafts_come_true_on_repeating_code(qwen, sessions):
    """A file that repeats itself: most drafts are right, and the output is the same."""
    plain, spec = sessions
    block = "def add_%d(a, b):\n    return a + b\n\n"
    text = "".join(block % i for i in range(12))
    tokens = qwen.tokenize(text, add_special=True, parse_special=False)
    a = _greedy(plain, tokens, 48, speculate=False)
    b = _greedy(spec, tokens, 48, speculate=True)
    assert a.tokens == b.tokens
    assert b.usage.draft_accepted > 0.6 * b.usage.draft_tokens > 0, b.usage


def test_speculation_stops_when_drafts_do_not_pay(qwen):
    """After draft_probation drafted tokens below the draft_keep rate, no more drafts.

    The rate is made unreachable (draft_keep above 1) on a text whose drafts do
    come true, so the switch is what stops them, whatever the model writes.
    """
    s = ChatSession(qwen, n_ctx=2048, n_threads=1, draft_max=8)
    s.draft_keep = 1.01
    try:
        block = "def add_%d(a, b):\n    return a + b\n\n"
        tokens = qwen.tokenize("".join(block % i for i in range(12)), add_special=True,
                               parse_special=False)
        c = _greedy(s, tokens, 96, speculate=True)
        u = c.usage
        assert s.draft_probation <= u.draft_tokens < s.draft_probation + s.draft_max, u
        assert len(c.tokens) == 96
    finally:
        s.close()


def test_server_reports_drafts_in_timings(qwen_path):
    try:
        from .serverproc import ServerProcess
    except ImportError:
        from serverproc import ServerProcess
    block = "def add_%d(a, b):\n    return a + b\n\n"
    body = {"prompt": "".join(block % i for i in range(12)), "n_predict": 32,
            "temperature": 0, "cache_prompt": False}
    with ServerProcess(qwen_path, "--spec-type", "ngram-simple", "--spec-draft-n-max", "6",
                       threads=1) as server:
        status, _, out = server.post("/completion", body)
        assert status == 200
        t = out["timings"]
        assert 0 < t["draft_n_accepted"] <= t["draft_n"]
        spec_text = out["content"]
    with ServerProcess(qwen_path, threads=1) as server:
        status, _, out = server.post("/completion", body)
        assert status == 200
        assert "draft_n" not in out["timings"]      # llama-server's shape without drafts
        assert out["content"] == spec_text
