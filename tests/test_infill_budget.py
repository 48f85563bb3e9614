"""t_max_prompt_ms on fill-in-the-middle requests (engine/promptfit.py).

llama.vscode and llama.vim send it with every completion; what does not fit
the budget is dropped (extra chunks oldest first, then prefix lines, then
suffix lines, never the cursor's line) and the response's timings say what.
The fitting is tested on the real code model's tokenizer and FIM layout with
a prompt speed set by the test; the budget on a real server, timed.
"""

from pathlib import Path

import pytest

from offgrid.engine import cachereuse, promptfit
from offgrid.engine.infill import layout_infill
from offgrid.request import InfillRequest, Usage

try:
    from .serverproc import ServerProcess
except ImportError:
    from serverproc import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
CURSOR_LINE = "        plan = cachereuse.plan(self.cached, tok"
CURSOR_REST = "ens, min_run, need_logits)"


def _chunks(n, lines=32):
    """n chunks of real source, as editors send them: (filename, text)."""
    texts = [(f.name, f.read_text("utf-8").split("\n"))
             for f in sorted((ROOT / "offgrid" / "server").rglob("*.py"))]
    return [(name, "\n".join(text[10:10 + lines]) + "\n")
            for name, text in texts if len(text) >= 10 + lines][:n]


def _request(n_chunks=16, prefix_lines=256, suffix_lines=64, chunk_lines=32):
    """A FIM request at a line of session.py: 7,937 tokens of Qwen's layout
    as it stands; the server tests' smaller one (_small_request) 695."""
    src = (ROOT / "offgrid" / "engine" / "session.py").read_text("utf-8").split("\n")
    return InfillRequest(input_prefix="\n".join(src[296 - prefix_lines:296]) + "\n",
                         input_suffix=CURSOR_REST + "\n"
                         + "\n".join(src[300:300 + suffix_lines]) + "\n",
                         input_extra=_chunks(n_chunks, chunk_lines), prompt=CURSOR_LINE)


def _small_request():
    # What a test evaluates whole: a few seconds of prompt here, not minutes,
    # and still several times what a 500 ms budget lets through (one thread
    # of this 2-core host evaluated Qwen's prompts at 41-45 tok/s at load 7:
    # about 16 s for these 695 tokens).
    return _request(n_chunks=2, prefix_lines=16, suffix_lines=12, chunk_lines=12)


def _fit(qwen, req, rate, budget_ms=500, cached=()):
    def layout(r):
        return layout_infill(qwen, r, 8192, 2048, 128)

    def plan_of(tokens):
        return cachereuse.plan(list(cached), tokens, 64)
    return promptfit.fit(qwen, req, layout, plan_of, rate, budget_ms)


def _rate(qwen, tokens_per_second):
    rate = promptfit.PromptRate(qwen, 2)
    rate.rate = tokens_per_second
    return rate


def test_a_prompt_that_fits_is_left_as_it_is(qwen):
    req = _request()
    tokens, dropped = _fit(qwen, req, _rate(qwen, 1e9))
    assert dropped is None
    assert tokens == layout_infill(qwen, req, 8192, 2048, 128)[0]


@pytest.mark.parametrize("speed", [2e4, 1e4, 3e3, 1e3, 300])
def test_the_estimate_of_what_is_left_fits_the_budget(qwen, speed):
    rate = _rate(qwen, speed)
    tokens, dropped = _fit(qwen, _request(), rate)
    assert dropped is not None
    assert dropped["estimate_ms"] <= 500 * promptfit.TARGET
    # the estimate is the prompt's cost at the speed given (nothing is cached)
    assert dropped["estimate_ms"] == pytest.approx(rate.gaps_ms([(0, len(tokens))]), abs=0.1)


def _present(qwen, req):
    """How many of the request's chunks its prompt holds (the window may cut the oldest)."""
    spans = layout_infill(qwen, req, 8192, 2048, 128)[1]["chunks"]
    return sum(1 for a, b in spans if b > a)


def _header(name):
    return "<|file_sep|>%s\n" % name


def test_chunks_go_first_then_prefix_lines_then_suffix_lines(qwen):
    seen = []
    for speed in (2e4, 5e3, 1e3, 300):
        _, dropped = _fit(qwen, _request(), _rate(qwen, speed))
        seen.append(dropped)
    # slower: more goes, in order
    n = _present(qwen, _request())
    assert 0 < seen[0]["input_extra"] < n and seen[0]["prefix_lines"] == 0
    assert seen[1]["input_extra"] == n and seen[1]["suffix_lines"] == 0
    assert seen[2]["prefix_lines"] > seen[1]["prefix_lines"]
    assert seen[3]["suffix_lines"] > seen[2]["suffix_lines"]


def test_the_oldest_chunks_go_and_the_cursor_line_stays(qwen):
    req = _request()
    tokens, dropped = _fit(qwen, req, _rate(qwen, 2e4))
    text = qwen.detokenize(tokens, special=True)
    n = 16 - _present(qwen, req) + dropped["input_extra"]      # what the window cut, and more
    assert all(_header(name) not in text for name, _ in req.input_extra[:n])
    assert all(_header(name) in text for name, _ in req.input_extra[n:])
    # even when nothing else fits
    tokens, dropped = _fit(qwen, req, _rate(qwen, 10))
    text = qwen.detokenize(tokens, special=True)
    assert CURSOR_LINE in text and CURSOR_REST + "\n" in text
    assert dropped["input_extra"] == _present(qwen, req) and dropped["suffix_lines"] > 0
    # the prefix lines nearest the cursor go last
    tokens, dropped = _fit(qwen, req, _rate(qwen, 5e3))
    assert dropped["prefix_lines"] > 0 and dropped["suffix_lines"] == 0
    text = qwen.detokenize(tokens, special=True)
    kept = [line for line in req.input_prefix.split("\n")[:-1] if line.strip()]
    assert "\n" + kept[-1] + "\n" in text and "\n" + kept[-2] + "\n" in text
    body = text[text.index("<|fim_prefix|>"):]
    assert not body.startswith("<|fim_prefix|>" + kept[0])


def test_a_chunk_in_the_cache_is_kept_and_a_new_one_dropped(qwen):
    """The ring of chunks turned by one: the old ones are in the cache (chunk
    reuse moves them), so only the new one costs anything, and goes."""
    req = _request()
    before = layout_infill(qwen, req, 8192, 2048, 128)[0]
    new = InfillRequest(input_prefix=req.input_prefix, input_suffix=req.input_suffix,
                        input_extra=req.input_extra[1:] + [("new.py", "def f():\n    pass\n" * 40)],
                        prompt=req.prompt + "e")
    tokens, dropped = _fit(qwen, new, _rate(qwen, 300), cached=before)
    assert dropped["input_extra"] == 1 and dropped["prefix_lines"] == 0
    text = qwen.detokenize(tokens, special=True)
    assert _header("new.py") not in text
    assert all(_header(name) in text for name, _ in new.input_extra[16 - _present(qwen, new):-1])


def test_the_rate_follows_what_prompts_took():
    class M:        # the shape PromptRate reads
        meta = {"general.architecture": "x", "x.block_count": 24}
        n_params, n_vocab, n_embd = 630_000_000, 151_936, 896
    rate = promptfit.PromptRate(M, 2)
    assert rate.rate is None and rate.prior > 0
    rate.observe(Usage(prompt_tokens=40, prompt_ms=10.0))       # too short to say
    assert rate.rate is None
    rate.observe(Usage(prompt_tokens=1000, prompt_ms=500.0))
    assert rate.ms(rate.cost(0, 1000)) == pytest.approx(500.0)
    fast = rate.rate
    # one slow request among fast ones moves nothing
    rate.observe(Usage(prompt_tokens=1000, prompt_ms=5000.0))
    rate.observe(Usage(prompt_tokens=1000, prompt_ms=500.0))
    assert rate.rate == pytest.approx(fast)
    # a machine that stays busy is seen within a few requests
    for _ in range(2):
        rate.observe(Usage(prompt_tokens=1000, prompt_ms=5000.0))
    assert rate.rate == pytest.approx(fast / 10)
    # a cached prefix: only what was evaluated counts, at its positions
    rate = promptfit.PromptRate(M, 2)
    rate.observe(Usage(prompt_tokens=5000, cached_tokens=4000, prompt_ms=2000.0))
    assert rate.rate == pytest.approx(rate.cost(4000, 5000) / 2.0)
    assert rate.rate > 1000 / 2.0       # late positions cost more than early ones


# -- on a server ---------------------------------------------------------------

def _infill(server, req, **kw):
    body = {"input_prefix": req.input_prefix, "input_suffix": req.input_suffix,
            "input_extra": [{"filename": a, "text": b} for a, b in req.input_extra],
            "prompt": req.prompt, "n_predict": 16, "temperature": 0, "id_slot": 0}
    body.update(kw)
    status, _, out = server.post("/infill", body, timeout=600)
    assert status == 200, out
    return out


@pytest.mark.slow
def test_a_cold_request_with_16_chunks_keeps_to_500_ms(qwen, qwen_path):
    """The issue's bound: at most ~650 ms of prompt evaluation for a 500 ms
    budget.  The worker first learns the machine's speed from one request
    without a budget (as an editor's first requests, or its warm-ups, teach
    it); the budgeted request then starts from an empty cache."""
    req = _request()
    with ServerProcess(qwen_path, "-b", "2048", ctx=8192) as server:
        # (300 tokens: several times promptfit.MIN_OBSERVED, a second or more of prompt)
        learn = InfillRequest(input_prefix="".join("x%d = %d\n" % (i, i) for i in range(40)),
                              input_suffix="\n")
        _infill(server, learn, n_predict=1, cache_prompt=False)
        out = _infill(server, req, t_max_prompt_ms=500, cache_prompt=False, n_predict=1)
        t = out["timings"]
        print("prompt %.0f ms for %d tokens; dropped %s" % (t["prompt_ms"], t["prompt_n"],
                                                          t["dropped"]))
        assert t["dropped"]["input_extra"] > 0
        if t["prompt_ms"] > 650:
            # a machine so busy that the cursor's line alone takes longer:
            # then everything else must have gone
            assert t["prompt_n"] < 64 and t["dropped"]["input_extra"] == _present(qwen, req), t
        # without a budget nothing is dropped: a smaller request (the
        # 16-chunk one whole takes minutes here), still far over 500 ms of prompt
        small = _small_request()
        out = _infill(server, small, cache_prompt=False, n_predict=1)
        assert "dropped" not in out["timings"]
        assert out["timings"]["prompt_n"] > 600
        assert out["timings"]["prompt_ms"] > 500, out["timings"]


@pytest.mark.slow
def test_a_warm_up_is_not_cut_and_makes_the_next_request_fit(qwen_path):
    """llama.vim and llama.vscode send n_predict 0 with the chunks to get them
    into the cache off the typing path (llama.vim with t_max_prompt_ms 1):
    that request is evaluated whole, and the next completion, which then
    finds them cached, drops nothing."""
    req = _small_request()
    with ServerProcess(qwen_path, "-b", "2048", ctx=8192) as server:
        out = _infill(server, req, n_predict=0, t_max_prompt_ms=1)
        assert "dropped" not in out["timings"]
        full = out["timings"]["prompt_n"]
        assert full > 600
        out = _infill(server, req, t_max_prompt_ms=500, n_predict=1)
        assert "dropped" not in out["timings"]
        assert out["timings"]["cache_n"] >= full - 1
