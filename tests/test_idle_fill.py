"""The idle fill (engine/fill.py, ChatSession.fill): what a prompt budget dropped
goes into the cache while the worker has nothing to do, a few tokens a decode,
and a request between two steps loses none of the steps done.

Engine tests on the real library and models; the scheduling on a stand-in
session (it is about threads, not decodes); the whole loop on a real server
with the code model, where a budgeted request's dropped parts come back.
"""

import threading
import time

import pytest

from offgrid.engine import cachereuse, promptfit
from offgrid.engine.fill import IdleFill
from offgrid.engine.infill import layout_infill
from offgrid.engine.session import ChatSession
from offgrid.jobs import Threads
from offgrid.request import GenerationParams, RequestCancel, SamplingParams

try:
    from .serverproc import ServerProcess
    from .test_infill_budget import _infill, _rate, _request
except ImportError:
    from serverproc import ServerProcess
    from test_infill_budget import _infill, _rate, _request

TEXT = ("The lighthouse keeper climbed the stairs every evening, counting each of the "
        "hundred and twelve steps, and at the top he wound the clockwork, trimmed the wick "
        "and wrote the weather in his book: wind from the west, a grey sea, two ships. ") * 3


def _greedy(n):
    return GenerationParams(n_predict=n, sampling=SamplingParams(temperature=0.0))


def _counting_cancel(session, after):
    """A RequestCancel flipped just before the session's decode number ``after``."""
    cancel = RequestCancel()
    decode, calls = session._decode, []

    def counted(*a, **kw):
        calls.append(1)
        if len(calls) == after:
            cancel.cancel("a request came")
        return decode(*a, **kw)
    session._decode = counted
    return cancel, calls


@pytest.mark.parametrize("name", ["smollm", "gemma"])    # gemma: a sliding window, pinned
def test_a_fill_cut_short_keeps_its_steps_and_ends_as_one_whole_evaluation(request, name):
    model = request.getfixturevalue(name)
    tokens = model.tokenize(TEXT, add_special=True, parse_special=False)
    assert len(tokens) > 100
    with ChatSession(model, n_ctx=1024, n_batch=16, n_threads=1) as ref:
        # the same steps of 16, then the last token alone: as a fill and a request make them
        ref.evaluate(tokens[:-1])
        want = ref.complete(tokens, _greedy(12))
    with ChatSession(model, n_ctx=1024, n_batch=512, n_threads=1) as s:
        cancel, calls = _counting_cancel(s, after=4)
        assert s.fill(tokens, cancel, step=16) is False
        assert s.cached == tokens[:48]          # three steps done, the fourth cut
        del s._decode
        assert s.fill(tokens, RequestCancel(), step=16) is True
        assert s.cached == tokens
        got = s.complete(tokens, _greedy(12))
        assert got.usage.cached_tokens == len(tokens) - 1
        assert got.tokens == want.tokens, (got.text, want.text)


def test_a_fill_before_a_moved_run_fills_the_gap_step_by_step(smollm):
    """The ring of chunks turned: the cached text after the new head is moved
    (chunk reuse), and only the gap before it is evaluated, in steps; a cut
    gap keeps its steps (holes only where no step was done)."""
    old_head = smollm.tokenize("A note on the first page. " * 4, add_special=True,
                               parse_special=False)
    new_head = smollm.tokenize("Another, longer note that opens the book now. " * 5,
                               add_special=True, parse_special=False)
    body = smollm.tokenize(TEXT, add_special=False, parse_special=False)
    with ChatSession(smollm, n_ctx=1024, n_batch=512, n_threads=1) as s:
        s.evaluate(old_head + body)
        tokens = new_head + body
        plan = cachereuse.plan(s.cached, tokens, 64, False)
        assert plan.reused >= len(body) - 1     # the body is moved, not evaluated
        k = plan.keep           # the gap starts after the common prefix
        cancel, calls = _counting_cancel(s, after=3)
        assert s.fill(tokens, cancel, cache_reuse=64, step=16) is False
        assert s.cached[:k + 32] == tokens[:k + 32] and s.cached[k + 32] is None
        del s._decode
        decodes = s.n_decodes
        assert s.fill(tokens, RequestCancel(), cache_reuse=64, step=16) is True
        assert s.cached == tokens
        # what was left of the gap, in steps of 16: the moved body was not evaluated
        left = len(new_head) - (k + 32)
        assert s.n_decodes - decodes <= (left + 15) // 16 + 1     # + the last token
        c = s.complete(tokens, _greedy(4))
        assert c.usage.cached_tokens == len(tokens) - 1 and c.tokens


# -- the scheduling ---------------------------------------------------------------

class _Session:
    """Stands in for a ChatSession: fill() runs until cancelled or let go."""

    closed = False

    def __init__(self):
        self.started = threading.Semaphore(0)
        self.finish = threading.Event()
        self.calls = []

    def fill(self, tokens, cancel, cache_reuse, step):
        self.calls.append((list(tokens), cache_reuse, step))
        self.started.release()
        while not cancel.cancelled and not self.finish.is_set():
            time.sleep(0.005)
        return not cancel.cancelled


def test_a_fill_runs_only_while_no_job_does_and_each_job_stops_it():
    rate = promptfit.PromptRate.__new__(promptfit.PromptRate)
    rate.rate = None
    fill, s = IdleFill(Threads("test-fill"), rate), _Session()
    fill.busy()
    fill.want(s, [1, 2, 3], 64)
    assert not s.started.acquire(timeout=0.2)      # a job runs: no fill yet
    fill.done()
    assert s.started.acquire(timeout=5)            # idle: it starts
    assert s.calls[-1] == ([1, 2, 3], 64, 16)
    fill.busy()                                    # a frame comes in: it stops
    fill.wait()
    assert not s.started.acquire(timeout=0.2)
    fill.busy()                                    # two jobs; the fill waits for both
    fill.done()
    assert not s.started.acquire(timeout=0.2)
    fill.done()
    assert s.started.acquire(timeout=5)            # resumed: still wanted
    s.finish.set()
    fill.wait()
    deadline = time.monotonic() + 5
    while fill.n_filled == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fill.n_filled == 1
    fill.busy()
    fill.done()                                    # done: not started again
    assert not s.started.acquire(timeout=0.2)
    assert len(s.calls) == 2


def test_a_newer_prompt_replaces_the_one_wanted():
    rate = promptfit.PromptRate.__new__(promptfit.PromptRate)
    rate.rate = None
    fill, s = IdleFill(Threads("test-fill"), rate), _Session()
    s.finish.set()
    fill.busy()
    fill.want(s, [1], 0)
    fill.want(s, [2], 0)
    fill.done()
    assert s.started.acquire(timeout=5)
    fill.wait()
    assert [c[0] for c in s.calls] == [[2]]


# -- the fit keeps what a fill did ------------------------------------------------

def test_the_fit_keeps_a_chunk_a_fill_has_half_done(qwen):
    """The cache holds the whole prompt up to the middle of its second chunk
    (a fill cut short): the fit keeps all of that, the first chunk and the
    second's head, and drops what costs."""
    req = _request(n_chunks=4)
    full, spans = layout_infill(qwen, req, 8192, 2048, 128)
    (a1, b1), (a2, b2) = spans["chunks"][:2]
    assert a1 > 0       # the repository's header is no chunk's: it stays when chunk 0 goes
    half = (a2 + b2) // 2
    cached = full[:half]

    def layout(r):
        return layout_infill(qwen, r, 8192, 2048, 128)

    def plan_of(tokens):
        return cachereuse.plan(cached, tokens, 64)
    tokens, dropped = promptfit.fit(qwen, req, layout, plan_of, _rate(qwen, 300), 500)
    assert dropped is not None and dropped["input_extra"] >= 1
    assert tokens[:half] == cached
    # with nothing cached, the same fit drops the first chunk
    tokens, _ = promptfit.fit(qwen, req, layout, lambda t: cachereuse.plan([], t, 64),
                              _rate(qwen, 300), 500)
    assert tokens[a1:b1] != full[a1:b1]
    assert tokens[:a1] == full[:a1]


# -- on a server ------------------------------------------------------------------

@pytest.mark.slow
def test_what_a_budget_dropped_is_cached_after_idle_time(qwen_path):
    """A request over its budget drops parts; with the worker left idle, they
    go into the cache, and the same request then keeps everything, from the
    cache.  Requests in between (each stops the fill for a while) get
    answers, and the fill goes on after them."""
    req = _request(n_chunks=2, prefix_lines=30, suffix_lines=10, chunk_lines=12)
    with ServerProcess(qwen_path, "-b", "2048", ctx=8192) as server:
        out = _infill(server, req, t_max_prompt_ms=100)
        dropped = out["timings"].get("dropped")
        assert dropped, out["timings"]
        cached = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            time.sleep(2.0)
            out = _infill(server, req, t_max_prompt_ms=100)
            t = out["timings"]
            cached.append(t["cache_n"])
            if "dropped" not in t:
                break
        assert "dropped" not in t, (dropped, cached)
        full = t["cache_n"] + t["prompt_n"]
        assert t["cache_n"] >= full - 2, t
        # without a budget, the same prompt: the same tokens, all but the last cached
        out = _infill(server, req)
        assert out["timings"]["cache_n"] + out["timings"]["prompt_n"] == full
        assert out["timings"]["cache_n"] >= full - 2
