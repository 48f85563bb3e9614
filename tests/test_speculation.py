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
    assert lk.lookup(3) == [4, 5, 9]
    lk.append(4)
    assert lk.lookup(2) == [5, 9]       # (2, 3, 4) was followed by 5
    lk.append(7)                        # a new turn: (3, 4, 7) and (4, 7) never seen
    assert lk.lookup(4) == []


def test_lookup_takes_the_latest_occurrence_and_falls_back_to_shorter_ngrams():
    lk = PromptLookup([5, 6, 1, 8, 6, 1, 2, 0, 6, 1])
    assert lk.lookup(1) == [2]          # (6, 1) latest before the end: followed by 2
    lk = PromptLookup([4, 1, 7, 3, 1])
    assert lk.lookup(2) == []           # (3, 1) never came before: no 1-gram drafts (n_min 2)
    assert lk.draft(0) == []


class _Clock:
    t = 0.0

    def __call__(self):
        return self.t


def _generate(lk, truth, step_cost, n_steps=40):
    """Drive ``lk`` as the session does: draft() before each decode (which
    costs step_cost(draft length) seconds), append() for each token the step
    gives (the drafted ones that match ``truth``, then one more)."""
    clock = lk.clock
    pos, lengths = len(lk.tokens), []
    for _ in range(n_steps):
        d = lk.draft(8)
        lengths.append(len(d))
        clock.t += step_cost(len(d))
        hits = 0
        while hits < len(d) and pos + hits < len(truth) and truth[pos + hits] == d[hits]:
            hits += 1
        for t in truth[pos:pos + hits + 1]:
            lk.append(t)
        pos += hits + 1
    return lengths


def test_drafts_grow_while_they_come_true():
    block = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    truth = block * 40
    lk = PromptLookup(truth[:len(block) * 2], clock=_Clock())
    lengths = _generate(lk, truth, lambda n: 1 + 0.1 * n, n_steps=12)
    assert lengths[:3] == [2, 4, 8]
    assert {n for n in lengths[3:] if n} == {8}      # (a few plain steps are timed)
    assert lk.paying


def test_a_failed_draft_shrinks_the_next_one():
    lk = PromptLookup([1, 2, 3, 4, 5, 6, 1, 2], clock=_Clock())
    lk.k = 8
    assert lk.draft(8) == [3, 4, 5, 6, 1, 2]
    for t in (3, 4, 99):             # two came true, then the model went elsewhere
        lk.append(t)
    lk.append(1)
    lk.append(2)
    assert lk.draft(8) == [3, 4, 99]     # (1, 2) then (3, 4, 99): one more than came true


def test_drafting_stops_where_it_does_not_beat_plain_decoding():
    """A busy CPU: a verify decode costs as much per token as single decodes,
    and half the drafts fail: drafting loses, and stops for the request."""
    truth = ([1, 2, 3, 4, 5, 6, 7, 8] + [50 + i for i in range(8)]) * 30
    lk = PromptLookup(truth[:16], clock=_Clock())
    lengths = _generate(lk, truth, lambda n: 1.0 + 1.0 * n, n_steps=60)
    assert not lk.paying
    assert lengths[-10:] == [0] * 10
    drafted_steps = sum(1 for n in lengths if n)
    assert drafted_steps < 20


def test_drafting_goes_on_where_it_pays():
    """An idle CPU: a verify decode of 1 + k tokens costs little more than
    one; with most drafts coming true, drafting keeps going (plain steps are
    timed by skipping a few drafts once)."""
    truth = ([1, 2, 3, 4, 5, 6, 7, 8] + [50 + i for i in range(8)]) * 30
    lk = PromptLookup(truth[:16], clock=_Clock())
    lengths = _generate(lk, truth, lambda n: 1.0 + 0.15 * n, n_steps=60)
    assert lk.paying
    assert sum(1 for n in lengths[-20:] if n) >= 18
    assert lk._seen[False][0] >= lk.judge_after      # it did time plain steps


# -- on the real code model --------------------------------------------------

from pathlib import Path     # noqa: E402

from offgrid.engine.session import ChatSession       # noqa: E402
from offgrid.request import GenerationParams, SamplingParams   # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# real files of different kinds: Python, Markdown, C
FILES = [ROOT / "offgrid" / "server" / "models" / "sessions.py", ROOT / "README.md",
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
    # draft all the way, whatever it costs on this machine: this checks the output
    spec.draft_probation = 10 ** 6
    judge, PromptLookup.judge_after = PromptLookup.judge_after, 10 ** 6
    yield plain, spec
    PromptLookup.judge_after = judge
    plain.close()
    spec.close()


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_speculation_stops_when_drafts_do_not_pay(qwen, monkeypatch):
    """After draft_probation drafted tokens below the draft_keep rate, no more drafts.

    The rate is made unreachable (draft_keep above 1) on a text whose drafts do
    come true, so the switch is what stops them, whatever the model writes.
    """
    s = ChatSession(qwen, n_ctx=2048, n_threads=1, draft_max=8)
    s.draft_keep = 1.01
    # the session's rule alone: the timing judge and short first drafts aside
    monkeypatch.setattr(PromptLookup, "judge_after", 10 ** 6)
    monkeypatch.setattr(PromptLookup, "k_start", 8)
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


@pytest.mark.slow
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
    with ServerProcess(qwen_path, threads=1) as server:       # the default: none
        status, _, out = server.post("/completion", body)
        assert status == 200
        assert "draft_n" not in out["timings"]      # llama-server's shape without drafts
        assert out["content"] == spec_text


@pytest.mark.slow
def test_spec_type_auto_drafts_for_completions_and_not_for_chat(qwen_path):
    try:
        from .serverproc import ServerProcess
    except ImportError:
        from serverproc import ServerProcess
    block = "def add_%d(a, b):\n    return a + b\n\n"
    code = "".join(block % i for i in range(12))
    with ServerProcess(qwen_path, "--spec-type", "auto", threads=1) as server:
        status, _, out = server.post("/completion", {"prompt": code, "n_predict": 16,
                                                     "temperature": 0})
        assert status == 200 and out["timings"]["draft_n"] > 0
        # llama-server's per-request limit: 0 drafts nothing
        status, _, out = server.post("/completion", {"prompt": code, "n_predict": 16,
                                                     "temperature": 0, "cache_prompt": False,
                                                     "speculative.n_max": 0})
        assert status == 200 and "draft_n" not in out["timings"]
        status, _, out = server.post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Repeat this code:\n" + code}],
            "max_tokens": 16, "temperature": 0})
        assert status == 200 and "draft_n" not in out["timings"]
