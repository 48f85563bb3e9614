"""The generation engine on the real libllama.

Most tests run gemma-3-270m (the default model: a real tokenizer, real text,
sliding-window attention); the fill-in-the-middle tests run the tiny random
models from tinymodels.py, whose FIM tokens are exactly what each test needs.

Generation is greedy wherever text is compared, so outputs are reproducible.
Time bounds are loose (this runs on two shared cores): they separate "stopped
at once" from "ran to the end", not fast from slow.
"""

import ctypes
import json
import threading
import time

import pytest

from offgrid.errors import ContextError, ContextFull, InvalidRequest, InvalidToken, NotSupported
from offgrid.engine.infill import build_infill_prompt
from offgrid.request import InfillRequest
from offgrid.request import SamplingParams
from offgrid.engine.session import ChatSession, FinishReason, GenerationParams, RequestCancel

try:
    from .serverproc import ROOT, TEST_THREADS
except ImportError:
    from serverproc import ROOT, TEST_THREADS

STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


def greedy(n_predict, **kw):
    return GenerationParams(n_predict=n_predict, sampling=SamplingParams(temperature=0), **kw)


@pytest.fixture
def new_session():
    """Make ChatSessions (two threads each) that are closed after the test."""
    made = []

    def make(model, n_ctx=1024, n_batch=64, **kw):
        session = ChatSession(model, n_ctx=n_ctx, n_batch=n_batch, n_threads=TEST_THREADS, **kw)
        made.append(session)
        return session

    yield make
    for session in made:
        session.close()


def cold(new_session, model, tokens, params, **kw):
    """What a fresh session generates for ``tokens``, the reference for a reused cache.

    On gemma the greedy pick can flip with the shape of the batches a prompt
    was evaluated in, so a comparison there must evaluate in the same chunks;
    the tiny models' picks do not flip.
    """
    return new_session(model, **kw).complete(tokens, params)


def words(model, text):
    """Tokens of ``text`` to append to a prompt (no BOS)."""
    return model.tokenize(text, add_special=False)


def long_prompt(model, n_tokens):
    """A prompt of exactly ``n_tokens`` tokens of varied text, starting with BOS."""
    text = " ".join("item %d is %s;" % (i, ("red", "green", "blue", "old", "new")[i % 5])
                    for i in range(n_tokens))
    return model.tokenize(text)[:n_tokens]


# --------------------------------------------------------------------------
# Determinism and sampling
# --------------------------------------------------------------------------

def test_greedy_generation_is_the_same_in_two_sessions(gemma, new_session):
    prompt = gemma.tokenize(STORY)
    first = new_session(gemma).complete(prompt, greedy(24))
    second = new_session(gemma).complete(prompt, greedy(24))

    assert first.text.strip()
    assert (second.text, second.tokens) == (first.text, first.tokens)
    assert first.finish_reason is FinishReason.LENGTH
    assert first.usage.completion_tokens == 24


def test_a_seeded_sampled_generation_repeats(gemma, new_session):
    prompt = gemma.tokenize(STORY)
    params = GenerationParams(n_predict=16, sampling=SamplingParams(temperature=1.0, seed=42))
    first = new_session(gemma).complete(prompt, params)
    second = new_session(gemma).complete(prompt, params)
    assert first.tokens == second.tokens


# --------------------------------------------------------------------------
# Prompt cache reuse
# --------------------------------------------------------------------------

def test_a_repeated_prompt_comes_from_the_cache_but_its_last_token(gemma, new_session):
    session = new_session(gemma)
    prompt = gemma.tokenize(STORY)
    first = session.complete(prompt, greedy(8))
    again = session.complete(prompt, greedy(8))

    assert first.usage.cached_tokens == 0
    assert again.usage.cached_tokens == len(prompt) - 1
    assert again.text == first.text


@pytest.mark.slow
def test_a_prompt_extending_the_last_one_reuses_all_of_it(gemma, new_session):
    # Longer than gemma-3's 512-token attention window, which most layers use:
    # the session keeps the whole cache (swa_full) so that it can be cut.
    assert gemma.n_swa and gemma.n_swa < 600
    session = new_session(gemma, n_batch=512)
    prompt = long_prompt(gemma, 600)
    first = session.complete(prompt, greedy(8))
    extended = prompt + words(gemma, " and that is all")
    assert extended[len(prompt)] != first.tokens[0]     # the cache holds first.tokens[:-1]

    result = session.complete(extended, greedy(12))

    assert result.usage.cached_tokens == len(prompt)
    assert result.usage.evaluated_tokens == len(extended) - len(prompt)
    # The generated tokens were really dropped from the cache: the output is
    # that of a session that never generated them.  (That session evaluates
    # in the same chunks: gemma's greedy pick can flip with the batch shape.)
    fresh = new_session(gemma, n_batch=512)
    fresh.complete(prompt, greedy(0))
    assert result.text == fresh.complete(extended, greedy(12)).text


@pytest.mark.slow
def test_without_swa_full_long_prompts_still_run(gemma, new_session):
    # The windowed cache then holds about three windows and a batch (libllama's
    # size_swa: n_swa * 3 sequences + n_ubatch, 1792 cells here), so libllama
    # must recycle its cells: the prompt must not be pinned there (SEQ_PIN), or
    # a prompt longer than that cache finds no room (2000 tokens: pinned, the
    # first request fails with ContextFull).  Reuse is limited to what the
    # window check allows; the output must be what a fresh session gives.
    # (Batches of 256 make that cache 256 cells smaller than 512 would, and the
    # prompts as much shorter: 3000 tokens took half again the time.)
    session = new_session(gemma, n_ctx=4096, n_batch=256, swa_full=False)
    prompt = long_prompt(gemma, 2000)
    session.complete(prompt, greedy(4))
    changed = prompt[:1900] + words(gemma, " but then it rained")
    result = session.complete(changed, greedy(8))
    fresh = new_session(gemma, n_ctx=4096, n_batch=256, swa_full=False)
    expected = fresh.complete(changed, greedy(8))
    if result.tokens != expected.tokens:
        # Reused keys (where the window check lets any be) were computed in a batch of
        # another shape than the fresh session's, so logits differ in their
        # last bits (measured: up to 0.8 of gemma's ~21); a greedy pick may
        # flip only where the fresh session's two best were that close.
        i = next(k for k, (a, b) in enumerate(zip(result.tokens, expected.tokens)) if a != b)
        fresh.evaluate(changed + expected.tokens[:i])
        logits = (ctypes.c_float * gemma.n_vocab).from_address(fresh._ctx.logits(-1))
        margin = logits[expected.tokens[i]] - logits[result.tokens[i]]
        assert 0 <= margin < 1.0, "token %d differs, and not by a near-tie (%.3f)" % (i, margin)


def test_a_context_of_0_is_the_models_own(plain_model, new_session):
    session = new_session(plain_model, n_ctx=0)
    assert session.n_ctx == plain_model.n_ctx_train > 16


def test_generated_text_sent_back_is_reused(gemma, new_session):
    # An editor's next request repeats the last prompt and what was generated.
    session = new_session(gemma)
    prompt = gemma.tokenize(STORY)
    first = session.complete(prompt, greedy(8))
    follow_up = prompt + first.tokens + words(gemma, " Every day")

    result = session.complete(follow_up, greedy(4))

    # all but the last generated token went through llama_decode
    assert result.usage.cached_tokens == len(prompt) + len(first.tokens) - 1


def test_a_prompt_that_diverges_reuses_only_the_shared_start(gemma, new_session):
    session = new_session(gemma)
    prompt = gemma.tokenize(STORY)
    session.complete(prompt, greedy(8))
    other = prompt[:10] + words(gemma, " a young baker who sold bread at dawn and")

    result = session.complete(other, greedy(4))

    assert result.usage.cached_tokens == 10


# The tiny model's greedy pick does not flip with the batch shape, so a reused
# cache can be compared with a fresh session evaluating the prompt in one go.
_CODE = "".join("def f%d(x):\n    return x * %d + %d\n" % (i, i, i * i) for i in range(30))


@pytest.mark.parametrize("scenario", ["same", "extend", "follow_up", "diverge", "shorter"])
def test_a_reused_cache_generates_what_a_fresh_session_does(fim_model, new_session, scenario):
    m = fim_model
    code = words(m, _CODE)
    prompt = code[:120]
    session = new_session(m)
    first = session.complete(prompt, greedy(8))
    # (the second prompt, how many of its tokens the cache holds)
    second, reusable = {
        "same": (prompt, 119),                      # all but the last token
        "extend": (code[:160], 120),
        "follow_up": (prompt + first.tokens + code[120:140], 120 + 7),
        "diverge": (prompt[:60] + words(m, "class Other:\n    pass\n"), 60),
        "shorter": (prompt[:50], 49),
    }[scenario]
    assert first.tokens[0] != code[120]                   # no accidental extra match
    assert words(m, "class")[0] != prompt[60]

    result = session.complete(second, greedy(12))

    assert result.usage.cached_tokens == reusable
    assert result.tokens == cold(new_session, m, second, greedy(12)).tokens


def test_cache_prompt_false_evaluates_everything(gemma, new_session):
    session = new_session(gemma)
    prompt = gemma.tokenize(STORY)
    session.complete(prompt, greedy(4))
    result = session.complete(prompt, greedy(4, cache_prompt=False))
    assert result.usage.cached_tokens == 0


def test_n_predict_0_caches_the_prompt_for_the_next_request(gemma, new_session):
    session = new_session(gemma)
    prompt = gemma.tokenize(STORY)

    warm = session.complete(prompt, greedy(0))
    result = session.complete(prompt + words(gemma, " sang"), greedy(4))

    assert (warm.text, warm.tokens, warm.usage.prompt_tokens) == ("", [], len(prompt))
    assert result.usage.cached_tokens == len(prompt)


# --------------------------------------------------------------------------
# Limits and bad input
# --------------------------------------------------------------------------

def test_a_prompt_longer_than_the_context_is_refused(gemma, new_session):
    session = new_session(gemma, n_ctx=256)
    for n in (session.n_ctx, session.n_ctx + 50):
        with pytest.raises(ContextFull):
            session.complete(long_prompt(gemma, n), greedy(4))
    # and the session still serves
    assert session.complete(gemma.tokenize(STORY), greedy(4)).usage.completion_tokens == 4


def test_generation_stops_when_the_context_is_full(gemma, new_session):
    session = new_session(gemma, n_ctx=256)
    prompt = long_prompt(gemma, session.n_ctx - 20)

    result = session.complete(prompt, greedy(-1, ignore_eos=True))

    assert result.truncated
    assert result.finish_reason is FinishReason.LENGTH
    assert session.n_ctx - 1 <= len(prompt) + result.usage.completion_tokens <= session.n_ctx
    assert session.complete(gemma.tokenize(STORY), greedy(4)).usage.completion_tokens == 4


def test_an_empty_prompt_is_refused_as_a_bad_request(gemma, new_session):
    with pytest.raises(InvalidRequest) as e:
        new_session(gemma).complete([], greedy(4))
    assert not isinstance(e.value, ContextFull)


@pytest.mark.parametrize("field, value", [("temperature", float("nan")),
                                          ("top_p", float("inf")), ("repeat_penalty", -1.0),
                                          ("repeat_penalty", 0.0), ("min_p", 1e39),
                                          ("top_k", 2 ** 31), ("logit_bias", [(5, float("inf"))])])
def test_sampling_values_libllama_cannot_take_are_refused(gemma, new_session, field, value):
    params = GenerationParams(n_predict=4, sampling=SamplingParams(**{field: value}))
    with pytest.raises(InvalidRequest):
        new_session(gemma).complete(gemma.tokenize(STORY), params)


@pytest.mark.parametrize("bad", [-1, "vocab", 2 ** 40, True, 1.0])
def test_token_ids_outside_the_vocabulary_are_refused_before_libllama(gemma, new_session, bad):
    session = new_session(gemma)
    prompt = gemma.tokenize(STORY)
    session.complete(prompt, greedy(2))
    cached = list(session.cached)
    bad_id = gemma.n_vocab if bad == "vocab" else bad

    with pytest.raises(InvalidToken):
        session.complete(prompt[:5] + [bad_id] + prompt[5:], greedy(2))

    assert session.cached == cached         # nothing was evaluated or dropped
    assert session.complete(prompt, greedy(2)).usage.cached_tokens == len(prompt) - 1


def test_a_closed_session_refuses_requests(gemma):
    session = ChatSession(gemma, n_ctx=256, n_threads=TEST_THREADS)
    session.close()
    session.close()                         # closing twice is harmless
    with pytest.raises(ContextError):
        session.complete(gemma.tokenize(STORY), greedy(4))


@pytest.mark.parametrize("lookup", ["token_bytes", "token_text"])
def test_looking_up_a_token_outside_the_vocabulary_is_refused(gemma, lookup):
    # libllama would throw a C++ exception through its C API: the process aborts
    with pytest.raises(InvalidToken):
        getattr(gemma, lookup)(gemma.n_vocab)
    with pytest.raises(InvalidToken):
        gemma.detokenize([gemma.bos, -5])


# --------------------------------------------------------------------------
# Stopping: the callback, stop strings, cancellation
# --------------------------------------------------------------------------

def test_on_piece_returning_false_stops_generation(gemma, new_session):
    session = new_session(gemma)
    pieces = []

    def on_piece(text):
        pieces.append(text)
        return len(pieces) < 3

    result = session.complete(gemma.tokenize(STORY), greedy(64, ignore_eos=True), on_piece)

    assert len(pieces) == 3
    assert result.finish_reason is FinishReason.CANCELLED
    assert result.usage.completion_tokens < 64


def test_stop_strings_end_the_text_even_across_tokens(gemma, new_session):
    session = new_session(gemma)
    prompt = gemma.tokenize(STORY)
    full = session.complete(prompt, greedy(24))
    # a stop string straddling the boundary between two generated tokens
    pieces = [gemma.token_bytes(t).decode() for t in full.tokens]
    k = next(i for i in range(2, len(pieces) - 1)
             if len(pieces[i].strip()) >= 2 and len(pieces[i + 1].strip()) >= 2)
    boundary = len("".join(pieces[:k + 1]))
    stop = full.text[boundary - 2:boundary + 2]
    streamed = []

    result = session.complete(prompt, greedy(24, stop=["never said", stop]), streamed.append)

    assert result.text == full.text[:full.text.index(stop)]
    assert "".join(streamed) == result.text
    assert (result.finish_reason, result.stop_type, result.stopping_word) == \
        (FinishReason.STOP, "word", stop)


def test_cancel_from_another_thread_stops_generation(gemma, new_session):
    session = new_session(gemma, n_ctx=2048)
    cancel = RequestCancel()
    first_piece = threading.Event()

    def canceller():
        if first_piece.wait(30):
            cancel.cancel()
    threading.Thread(target=canceller, daemon=True).start()

    start = time.monotonic()
    result = session.complete(gemma.tokenize(STORY), greedy(-1, ignore_eos=True),
                              lambda _text: first_piece.set(), cancel)
    elapsed = time.monotonic() - start

    assert result.finish_reason is FinishReason.CANCELLED
    assert 1 <= result.usage.completion_tokens < 200      # 2000 if it ran on
    assert elapsed < 10
    assert session.complete(gemma.tokenize(STORY), greedy(4)).usage.completion_tokens == 4


# A long prompt takes this machine about two seconds; the cancel comes after
# a tenth of one, long before any machine could finish it on two threads.
CANCEL_AFTER = 0.1


def _cancel_soon():
    cancel = RequestCancel()
    timer = threading.Timer(CANCEL_AFTER, cancel.cancel)
    timer.daemon = True
    timer.start()
    return cancel


def test_cancel_inside_one_long_prompt_chunk(gemma, new_session, capsys):
    # One 2000-token chunk, one llama_decode: only the abort callback stops it.
    session = new_session(gemma, n_ctx=2048, n_batch=2048)
    prompt = long_prompt(gemma, 2000)
    cancel = _cancel_soon()

    start = time.monotonic()
    result = session.complete(prompt, greedy(8), cancel=cancel)
    elapsed = time.monotonic() - start

    assert result.finish_reason is FinishReason.CANCELLED
    assert result.usage.completion_tokens == 0
    assert session.cached == []             # the chunk was cut short and dropped whole
    assert elapsed < CANCEL_AFTER + 1.0
    # an expected abort is not reported as libllama errors on the terminal
    assert "failed" not in capsys.readouterr().err
    follow_up = prompt[:40]
    assert session.complete(follow_up, greedy(8)).text == \
        cold(new_session, gemma, follow_up, greedy(8)).text


def test_cancel_between_small_prompt_chunks_keeps_a_consistent_cache(gemma, new_session):
    session = new_session(gemma, n_ctx=2048, n_batch=32)
    prompt = long_prompt(gemma, 2000)
    cancel = _cancel_soon()

    start = time.monotonic()
    result = session.complete(prompt, greedy(8), cancel=cancel)
    elapsed = time.monotonic() - start

    kept = len(session.cached)
    assert result.finish_reason is FinishReason.CANCELLED
    assert session.cached == prompt[:kept]
    assert kept < len(prompt) // 2          # it stopped early in the prompt
    assert elapsed < CANCEL_AFTER + 1.0
    # The next request starts just past what was kept, so the cut must be
    # clean.  A fresh session with the same n_batch evaluates in the same
    # chunks (whole chunks were kept), so its output must be identical.
    follow_up = prompt[:kept + 20]
    again = session.complete(follow_up, greedy(8))
    assert again.usage.cached_tokens == kept
    assert again.text == cold(new_session, gemma, follow_up, greedy(8), n_batch=32).text


def test_a_request_cancelled_before_it_starts_does_nothing(gemma, new_session):
    session = new_session(gemma)
    cancel = RequestCancel()
    cancel.cancel()
    result = session.complete(gemma.tokenize(STORY), greedy(8), cancel=cancel)
    assert result.finish_reason is FinishReason.CANCELLED
    assert (result.usage.completion_tokens, session.cached) == (0, [])


# --------------------------------------------------------------------------
# Fill in the middle (tiny models)
# --------------------------------------------------------------------------

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n    return c\n"
EXTRA = [("util.py", "import os\n"), ("math.py", "PI = 3\n")]


def layout(model, tokens):
    """A FIM prompt as text, special tokens written out."""
    return model.detokenize(tokens, special=True)


def between(tokens, start, end):
    """The tokens after the first ``start`` token and before the next ``end`` token."""
    i = tokens.index(start) + 1
    return tokens[i:tokens.index(end, i)]


# The layouts expected are llama-server's own: its /infill answers with the
# prompt it evaluated, recorded on the same tiny models with the pinned source
# by scripts/make_infill_goldens.py (the case's request, -c and -b beside it).
INFILL = json.loads((ROOT / "tests" / "golden" / "infill_layouts.json")
                    .read_text(encoding="utf-8"))["cases"]


def infill_case(model, name):
    """(tokens, llama-server's prompt text) of a recorded case, laid out by offgrid."""
    c = INFILL[name]
    r = c["request"]
    req = InfillRequest(input_prefix=r["input_prefix"], input_suffix=r["input_suffix"],
                        input_extra=[(e["filename"], e["text"]) for e in r["input_extra"]],
                        prompt=r["prompt"], spm_infill=c["spm_infill"])
    tokens = build_infill_prompt(model, req, n_ctx=c["n_ctx"], n_batch=c["n_batch"],
                                 n_predict=r["n_predict"])
    return tokens, c["prompt"]


def test_infill_prompt_with_repo_tokens(fim_model):
    tokens, want = infill_case(fim_model, "repo_tokens")
    assert layout(fim_model, tokens) == want
    assert want.startswith("<repo_name>myproject\n<file_sep>util.py\nimport os\n")
    assert tokens[0] == fim_model.fim_rep
    assert tokens[-1] == fim_model.fim_mid


def test_infill_prompt_without_repo_tokens_uses_snippet_separators(fim_norepo_model):
    tokens, want = infill_case(fim_norepo_model, "no_repo_tokens")
    assert layout(fim_norepo_model, tokens) == want
    assert want.startswith("\n\n--- snippet ---\n\nimport os\n")


def test_infill_prompt_puts_the_prompt_after_the_prefix(fim_model):
    tokens, want = infill_case(fim_model, "prompt_after_prefix")
    assert layout(fim_model, tokens) == want
    assert "<fim_prefix>def add(a, b):\n    x = <fim_suffix>" in want


def test_spm_infill_puts_the_suffix_first(fim_model):
    tokens, want = infill_case(fim_model, "spm")
    assert layout(fim_model, tokens) == want
    assert want.endswith("<fim_suffix>\n    return c\n<fim_prefix>def add(a, b):\n    "
                         "<fim_middle>")


def test_the_spm_infill_flag_lays_out_the_workers_fim_prompts_suffix_first(fim_model):
    # --spm-infill reaches the worker in its settings; the front never sets it per request
    import io
    from offgrid import protocol
    from offgrid.engine.loaded import Loaded
    from offgrid.engine.worker import Worker
    session = ChatSession(fim_model, n_ctx=4096, n_batch=512, n_threads=1)
    try:
        worker = Worker(Loaded(fim_model, [session]), io.BytesIO(), spm_infill=True)
        req = InfillRequest(input_prefix=PREFIX, input_suffix=SUFFIX)
        out = worker.call_prepare_infill(protocol.encode_infill(req), reserve=16)
        assert layout(fim_model, out["tokens"]).endswith(
            "<fim_suffix>\n    return c\n<fim_prefix>def add(a, b):\n    <fim_middle>")
    finally:
        session.close()


def test_a_long_prefix_keeps_its_end_and_a_long_suffix_its_start(fim_model):
    m = fim_model
    tokens, want = infill_case(m, "long_prefix_and_suffix")
    assert layout(m, tokens) == want
    r = INFILL["long_prefix_and_suffix"]["request"]
    prefix, suffix = words(m, r["input_prefix"]), words(m, r["input_suffix"])
    kept_prefix = between(tokens, m.fim_pre, m.fim_suf)
    kept_suffix = between(tokens, m.fim_suf, m.fim_mid)
    assert 0 < len(kept_prefix) < len(prefix) and kept_prefix == prefix[-len(kept_prefix):]
    assert 0 < len(kept_suffix) < len(suffix) and kept_suffix == suffix[:len(kept_suffix)]


def test_the_prompt_takes_its_room_from_the_suffix(fim_model):
    m = fim_model
    tokens, want = infill_case(m, "prompt_takes_room_from_suffix")
    assert layout(m, tokens) == want
    # the same long suffix with no prompt keeps more of its start
    alone, _ = infill_case(m, "long_prefix_and_suffix")
    kept = between(tokens, m.fim_suf, m.fim_mid)
    assert len(kept) < len(between(alone, m.fim_suf, m.fim_mid))
    assert kept == words(m, INFILL["prompt_takes_room_from_suffix"]["request"]
                         ["input_suffix"])[:len(kept)]


def test_extra_context_keeps_its_last_tokens_to_fit_the_context(fim_model):
    m = fim_model
    full, want_full = infill_case(m, "extra_context_whole")
    assert layout(m, full) == want_full
    tokens, want = infill_case(m, "extra_context_cut")
    assert layout(m, tokens) == want
    extra, kept = full[:full.index(m.fim_pre)], tokens[:tokens.index(m.fim_pre)]
    assert 0 < len(kept) < len(extra) and kept == extra[-len(kept):]


def test_infill_on_a_model_without_fim_tokens_is_not_supported(plain_model):
    with pytest.raises(NotSupported, match="prefix, suffix, middle"):
        build_infill_prompt(plain_model, InfillRequest(PREFIX, SUFFIX), n_ctx=4096, n_batch=512)


def test_completing_an_infill_prompt(fim_model, new_session):
    req = InfillRequest(input_prefix=PREFIX, input_suffix=SUFFIX, input_extra=EXTRA)
    tokens = build_infill_prompt(fim_model, req, n_ctx=1024, n_batch=64)
    session = new_session(fim_model)

    first = session.complete(tokens, greedy(10))
    again = session.complete(tokens, greedy(10))

    assert first.usage.completion_tokens == 10
    assert first.finish_reason is FinishReason.LENGTH
    assert first.text
    assert again.text == first.text
    assert again.usage.cached_tokens == len(tokens) - 1


@pytest.mark.parametrize("n_ctx,n_batch,n_ubatch,n_threads", [
    (0, 512, 512, 2), (1, 512, 512, 2), (256, 1, 1, 2), (64, 100000, 100000, 2),
    (4096, 512, 1, 2), (256, 7, 3, -4),
])
def test_odd_context_settings_never_abort(fim_model, n_ctx, n_batch, n_ubatch, n_threads):
    # libllama asserts (killing the process) on some of these as given; the
    # session must clamp them to something it accepts and still generate
    with ChatSession(fim_model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch,
                     n_threads=n_threads) as s:
        c = s.complete(fim_model.tokenize("hello world " * 3, add_special=False),
                       GenerationParams(n_predict=4, sampling=SamplingParams(temperature=0)))
        assert c.usage.completion_tokens == 4
