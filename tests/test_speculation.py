"""Speculative decoding from the request's own text (engine/lookup.py, session.py).

The drafts are checked against what the sampler picks at each position, so
the output must be plain decoding's: greedy generation with speculation is
compared token for token with generation without it, on real source files
and the real code model.  A decode of several tokens may differ from
single-token decodes in the last bits of a logit; where a greedy pick flips
the test demands that it was a near-tie and reports it.
"""

import pytest

from offgrid.engine.copydraft import CopyDraft
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


def _plain_and_drafted(plain, spec, tokens, n, **kw):
    """Greedy replies to ``tokens`` without drafts and with (``kw``: the
    drafted one's GenerationParams), from one evaluation of the prompt: the
    plain session's cells, copied into the other's context (the same model and
    settings), so both go on from the same cache, and the prompt costs once."""
    plain.reset()
    plain.evaluate(tokens)
    state = plain.copy_state()
    assert state is not None and spec.load_state(tokens, state)
    greedy = dict(n_predict=n, sampling=SamplingParams(temperature=0.0), cache_prompt=True)
    a = plain.complete(tokens, GenerationParams(speculate=False, **greedy))
    b = spec.complete(tokens, GenerationParams(speculate=True, **dict(greedy, **kw)))
    return a, b


@pytest.fixture(scope="module")
def sessions(qwen):
    plain = ChatSession(qwen, n_ctx=2048, n_threads=1)
    spec = ChatSession(qwen, n_ctx=2048, n_threads=1, draft_max=8)
    # draft all the way, whatever it costs on this machine: this checks the output
    spec.draft_probation = 10 ** 6
    judge, PromptLookup.judge_after = PromptLookup.judge_after, 10 ** 6
    copy_judge, CopyDraft.judge_after = CopyDraft.judge_after, 10 ** 6
    yield plain, spec
    PromptLookup.judge_after = judge
    CopyDraft.judge_after = copy_judge
    plain.close()
    spec.close()


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
@pytest.mark.slow
def test_greedy_speculation_is_plain_decoding(qwen, sessions, path):
    import math
    plain, spec = sessions
    text = path.read_text("utf-8")[:1500]
    tokens = qwen.tokenize(text, add_special=True, parse_special=False)
    a, b = _plain_and_drafted(plain, spec, tokens, 64)
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


def _edit_prompts():
    """Prompts whose answer copies them: a next-edit window in Zed's Sweep
    layout, and a chat request (Qwen's template, as the worker renders it)
    quoting a function to return with a name changed."""
    src = (ROOT / "offgrid" / "engine" / "lookup.py").read_text("utf-8").split("\n")
    window = "\n".join(src[76:97]) + "\n"
    changed = window.replace("step = self._step", "current = self._step", 1)
    sweep = ("<|file_sep|>offgrid/engine/lookup.py.diff\noriginal:\n        step = self._step\n"
             "updated:\n        current = self._step\n"
             "<|file_sep|>original/offgrid/engine/lookup.py\n" + window +
             "<|file_sep|>current/offgrid/engine/lookup.py\n" + changed +
             "<|file_sep|>updated/offgrid/engine/lookup.py\n")
    func = "\n".join(src[100:125])
    chat = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
            "Return this method with `seen` renamed to `tally`, in one code block.\n\n"
            "```python\n" + func + "\n```<|im_end|>\n<|im_start|>assistant\n")
    return {"next-edit": sweep, "apply-edit": chat}


@pytest.mark.parametrize("kind", ["next-edit", "apply-edit"])
@pytest.mark.slow
def test_greedy_copy_drafts_are_plain_decoding_on_edit_prompts(qwen, sessions, kind):
    """The copy drafter (long drafts along the prompt's text) on the prompts it
    is for: the same tokens as plain decoding, and most drafts come true."""
    import math
    plain, spec = sessions
    tokens = qwen.tokenize(_edit_prompts()[kind], add_special=True, parse_special=True)
    a, b = _plain_and_drafted(plain, spec, tokens, 160, drafter="copy")
    u = b.usage
    assert u.draft_tokens > 0 and u.draft_accepted > 0.5 * u.draft_tokens, u
    if a.tokens == b.tokens:
        return
    i = next(i for i in range(min(len(a.tokens), len(b.tokens))) if a.tokens[i] != b.tokens[i])
    probe = _greedy(plain, tokens + a.tokens[:i], 1, speculate=False, with_probs=True,
                    n_probs=2)
    top = probe.probs[0].top
    margin = math.log(top[0].prob) - math.log(top[1].prob)
    print("%s: token %d differs, a near-tie of %.3f nats" % (kind, i, margin))
    assert margin < NEAR_TIE, (kind, i, margin)


@pytest.mark.slow
def test_sampled_copy_drafts_keep_plain_sampling(qwen, sessions):
    """Sampling with drafts samples each position from its own logits with the
    same random draws, in the same order, as plain decoding, so with one seed
    the two give the same tokens, but for one thing: a verify decode's logits
    differ from a single token's in the last bits (by up to ~0.3 here, the
    batched and the single-row products round differently), and a random draw
    that falls at the border of two tokens may go either way.  So where the two
    part, plain decoding's two picks must be neighbours in its own ranking of
    the candidates (the draw walks them in that order), with little between
    their probabilities."""
    plain, spec = sessions
    tokens = qwen.tokenize(_edit_prompts()["apply-edit"], add_special=True, parse_special=True)
    drafted = 0
    # the prompt evaluated once, its cells copied into the other session's
    # context: at each seed the two start from the same cached prompt, so the
    # comparison is as even as with a fresh prompt each time, and 2 x 325
    # tokens cheaper a seed
    plain.reset()
    plain.evaluate(tokens)
    state = plain.copy_state()
    assert state is not None and spec.load_state(tokens, state)
    for seed in (1, 2, 3):
        sampling = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=seed)
        kw = dict(n_predict=96, cache_prompt=True, sampling=sampling)
        a = plain.complete(tokens, GenerationParams(speculate=False, **kw))
        b = spec.complete(tokens, GenerationParams(speculate=True, drafter="copy", **kw))
        drafted += b.usage.draft_tokens
        if a.tokens == b.tokens:
            continue
        i = next(i for i in range(min(len(a.tokens), len(b.tokens)))
                 if a.tokens[i] != b.tokens[i])
        plain.reset()
        probe = plain.complete(tokens + a.tokens[:i], GenerationParams(
            n_predict=1, cache_prompt=False, with_probs=True, n_probs=40,
            post_sampling_probs=True, speculate=False, sampling=sampling))
        ranked = [t.id for t in probe.probs[0].top]
        probs = {t.id: t.prob for t in probe.probs[0].top}
        assert a.tokens[i] in ranked and b.tokens[i] in ranked, (seed, i)
        ra, rb = ranked.index(a.tokens[i]), ranked.index(b.tokens[i])
        print("seed %d: token %d differs, ranks %d and %d, p %.3f and %.3f"
              % (seed, i, ra, rb, probs[a.tokens[i]], probs[b.tokens[i]]))
        assert abs(ra - rb) == 1, (seed, i, ra, rb)
        assert abs(probs[a.tokens[i]] - probs[b.tokens[i]]) < 0.05, (seed, i, probs)
    assert drafted > 0


@pytest.mark.slow
def test_drafts_come_true_on_repeating_code(qwen, sessions):
    """A file that repeats itself: most drafts are right, and the output is the same."""
    plain, spec = sessions
    block = "def add_%d(a, b):\n    return a + b\n\n"
    text = "".join(block % i for i in range(12))
    tokens = qwen.tokenize(text, add_special=True, parse_special=False)
    a, b = _plain_and_drafted(plain, spec, tokens, 48)
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


def _out_of_order_prompt():
    """A chat request (Qwen's template) whose answer takes the prompt's lines in
    another order: stubs and their docstrings, listed apart and in another
    order, to be put together."""
    funcs = [("read_header", "def read_header(f: BinaryIO) -> Header:",
              "Read the magic, the version and the two counts, and check them."),
             ("read_metadata", "def read_metadata(f: BinaryIO, count: int) -> Dict[str, Value]:",
              "Read count key/value pairs; a key seen twice is an error."),
             ("tensor_data_offset",
              "def tensor_data_offset(header_end: int, alignment: int) -> int:",
              "Where the tensor data starts: the end of the header, aligned up."),
             ("write_metadata",
              "def write_metadata(f: BinaryIO, metadata: Dict[str, Value]) -> None:",
              "Write every key/value pair in the order they were added."),
             ("pad_to_alignment", "def pad_to_alignment(f: BinaryIO, alignment: int) -> None:",
              "Write zero bytes until the file's position is a multiple of alignment.")]
    stubs = "\n\n".join("%s\n    pass" % f[1] for f in funcs)
    docs = "\n".join('# %s\n    """%s"""' % (funcs[i][0], funcs[i][2]) for i in (3, 1, 4, 0, 2))
    user = ("Here are some functions:\n\n```python\n%s\n```\n\nTheir docstrings, each under the "
            "name of its function:\n\n```python\n%s\n```\n\nPut each docstring into its "
            "function, above the `pass`. Reply with all the functions in one code block and "
            "nothing else." % (stubs, docs))
    text = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
            + user + "<|im_end|>\n<|im_start|>assistant\n")
    return text, user


@pytest.mark.slow
def test_greedy_copy_drafts_are_plain_decoding_on_lines_out_of_order(qwen, sessions):
    """Lines copied out of order (issue #52): the answer's lines are mostly the
    prompt's, after other lines than there; drafting each line from its first
    tokens gives plain decoding's tokens, and most drafts come true."""
    import math
    plain, spec = sessions
    text, user = _out_of_order_prompt()
    tokens = qwen.tokenize(text, add_special=True, parse_special=True)
    a, b = _plain_and_drafted(plain, spec, tokens, 150, drafter="copy")
    prompt_lines = [ln.strip() for ln in user.split("\n") if ln.strip()]
    lines = [ln.strip() for ln in a.text.split("\n")
             if ln.strip() and not ln.startswith("```")][:-1]      # the last may be cut
    copied = [j for j, ln in enumerate(lines) if ln in prompt_lines]
    # after another line than in the prompt (at the first place it is there)
    moved = [j for j in copied if j == 0 or prompt_lines.index(lines[j]) == 0
             or prompt_lines[prompt_lines.index(lines[j]) - 1] != lines[j - 1]]
    print("%d lines, %d of the prompt, %d of them moved" % (len(lines), len(copied), len(moved)))
    assert len(copied) >= 0.7 * len(lines) and len(moved) >= 0.5 * len(copied), a.text
    u = b.usage
    assert u.draft_tokens > 0 and u.draft_accepted > 0.6 * u.draft_tokens, u
    if a.tokens == b.tokens:
        return
    i = next(i for i in range(min(len(a.tokens), len(b.tokens))) if a.tokens[i] != b.tokens[i])
    probe = _greedy(plain, tokens + a.tokens[:i], 1, speculate=False, with_probs=True,
                    n_probs=2)
    top = probe.probs[0].top
    margin = math.log(top[0].prob) - math.log(top[1].prob)
    print("out of order: token %d differs, a near-tie of %.3f nats" % (i, margin))
    assert margin < NEAR_TIE, (i, margin)
