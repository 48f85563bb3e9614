"""Chunk reuse on the real library: cached runs moved to new positions.

The editor case: the line being typed sits between the prefix and a long
suffix.  With cache_reuse the suffix's keys and values are moved, not
recomputed, and the cache ends up exactly as long as the prompt, with every
position present, so the next request builds on it like any other.
"""

import contextlib
import pytest

from offgrid.engine.session import ChatSession, GenerationParams, shared_decoder
from offgrid.request import SamplingParams

try:
    from .serverproc import TEST_THREADS
except ImportError:
    from serverproc import TEST_THREADS


@pytest.fixture(params=["alone", "second of two", "second of two streams"])
def session(request, fim_model):
    """A session with a context of its own, or the second session of a shared
    context (its sequences numbered from 3) beside one that holds a prompt: in
    one cache, or in a stream of cells of its own (--no-kv-unified)."""
    if request.param == "alone":
        with ChatSession(fim_model, n_ctx=2048, n_batch=64, n_threads=TEST_THREADS) as s:
            yield s
        return
    decoder = shared_decoder(fim_model, 2, n_ctx=2048, n_batch=64, n_threads=TEST_THREADS,
                             kv_unified=request.param != "second of two streams")
    first, second = (ChatSession(fim_model, decoder=decoder) for _ in range(2))
    held = text_tokens(fim_model, "class Neighbour:\n    pass\n" * 20)
    first.evaluate(held)
    try:
        yield second
        assert first.cached == held and positions(first) == (0, len(held) - 1)
    finally:
        first.close()
        second.close()
        decoder.close()


def text_tokens(model, text):
    return model.tokenize(text, add_special=False)


def layout(model, middle):
    prefix = text_tokens(model, "import os\n\n\ndef walk(root):\n" * 8)
    suffix = text_tokens(model, "\n    return files\n\n\ndef main():\n    print(walk('.'))\n" * 6)
    return prefix, text_tokens(model, middle), suffix


def positions(session):
    mem = session._ctx.memory
    return mem.seq_pos_min(session._seq), mem.seq_pos_max(session._seq)


def test_typed_line_before_the_suffix_reuses_the_suffix(session, fim_model):
    prefix, line, suffix = layout(fim_model, "    files = os.listdir(")
    first = prefix + line + suffix + [fim_model.fim_mid]
    session.evaluate(first)
    _, typed, _ = layout(fim_model, "    files = os.listdir(root")
    assert typed[:len(line) - 1] == line[:-1] and len(typed) > len(line)
    second = prefix + typed + suffix + [fim_model.fim_mid]
    keep = len(prefix) + len(line) - 1   # the last token of the old line changed
    reused = session.evaluate(second, cache_reuse=16)
    assert reused == pytest.approx(keep + len(suffix), abs=2)
    assert reused > keep + 0.9 * len(suffix)
    assert session.cached == second
    # every position 0..n-1 is present in sequence 0, nothing else
    assert positions(session) == (0, len(second) - 1)


def test_without_cache_reuse_only_the_prefix_is_kept(session, fim_model):
    prefix, line, suffix = layout(fim_model, "    x = 1")
    first = prefix + line + suffix + [fim_model.fim_mid]
    session.evaluate(first)
    _, typed, _ = layout(fim_model, "    x = 12")
    second = prefix + typed + suffix + [fim_model.fim_mid]
    shared = session.common_prefix(second)
    assert shared < len(prefix) + len(typed)
    assert session.evaluate(second) == shared
    assert positions(session) == (0, len(second) - 1)


def test_removed_chunk_shifts_what_follows(session, fim_model):
    a = text_tokens(fim_model, "def first():\n    pass\n" * 10)
    b = text_tokens(fim_model, "def second():\n    return 2\n" * 10)
    c = text_tokens(fim_model, "def third():\n    return 3\n" * 10)
    session.evaluate(a + b + c + [fim_model.fim_mid])
    second = a + c + [fim_model.fim_mid]
    reused = session.evaluate(second, cache_reuse=16)
    assert reused >= len(a) + len(c) - 2
    assert positions(session) == (0, len(second) - 1)


def test_generation_after_reuse_builds_on_a_consistent_cache(session, fim_model):
    prefix, line, suffix = layout(fim_model, "    y = walk(")
    session.evaluate(prefix + line + suffix + [fim_model.fim_mid])
    _, typed, _ = layout(fim_model, "    y = walk(root")
    prompt = prefix + typed + suffix + [fim_model.fim_mid]
    greedy = GenerationParams(n_predict=8, sampling=SamplingParams(temperature=0), cache_reuse=16)
    c = session.complete(prompt, greedy)
    assert c.usage.cached_tokens > len(prefix) + 0.9 * len(suffix)
    assert len(c.tokens) == 8
    # the generated tokens extend the cache like any prompt tokens
    follow = prompt + c.tokens[:-1]
    assert session.common_prefix(follow) == len(follow)
    assert positions(session) == (0, len(follow) - 1)
    again = session.complete(prompt + c.tokens, greedy)
    assert again.usage.cached_tokens == len(follow)


def test_cancel_inside_a_gap_keeps_the_prefix_and_the_moved_suffix(session, fim_model):
    prefix, line, suffix = layout(fim_model, "    z = 0")
    session.evaluate(prefix + line + suffix + [fim_model.fim_mid])
    insert = text_tokens(fim_model, "    more = [i for i in range(100)]\n" * 8)
    prompt = prefix + line + insert + suffix + [fim_model.fim_mid]

    class Cancelled:
        cancelled = True
    session.evaluate(prompt, cancel=Cancelled(), cache_reuse=16)
    # the gap never ran: the cache has a hole there, and the suffix after it
    gap = (len(prefix) + len(line), len(prefix) + len(line) + len(insert))
    assert session.cached[:gap[0]] == prompt[:gap[0]]
    assert set(session.cached[gap[0]:gap[1]]) == {None}
    assert session.cached[gap[1]:] == prompt[gap[1]:len(session.cached)]
    assert len(session.cached) >= gap[1] + 0.9 * len(suffix)
    # the next request evaluates only the gap (and the last token) again
    reused = session.evaluate(prompt, cache_reuse=16)
    assert reused >= len(prompt) - len(insert) - 2
    assert session.cached == prompt
    assert positions(session) == (0, len(prompt) - 1)


def test_warm_up_of_a_cached_prompt_decodes_nothing(session, fim_model):
    prompt = text_tokens(fim_model, "def warm():\n    return 1\n" * 5)
    warm = GenerationParams(n_predict=0)
    first = session.complete(prompt, warm)
    assert first.usage.cached_tokens == 0
    again = session.complete(prompt, warm)
    assert again.usage.cached_tokens == len(prompt)      # nothing evaluated
    # a real request afterwards still gets logits for its last token
    c = session.complete(prompt, GenerationParams(n_predict=3,
                                                  sampling=SamplingParams(temperature=0)))
    assert c.usage.cached_tokens == len(prompt) - 1 and len(c.tokens) == 3


def test_the_decode_that_rotates_moved_keys_is_never_aborted(session, fim_model):
    # libllama rotates moved keys at the start of the next decode and, if that
    # decode is aborted part way, rotates them all again the time after
    prefix, line, suffix = layout(fim_model, "    w = 1")
    session.evaluate(prefix + line + suffix + [fim_model.fim_mid])
    _, typed, _ = layout(fim_model, "    w = 12")
    second = prefix + typed + suffix + [fim_model.fim_mid]
    decoder = session.decoder
    turn = decoder._turn

    aborted = []

    @contextlib.contextmanager
    def aborting_turn():                # a cancel lands just as the first decode starts
        with turn():
            if not aborted:
                aborted.append(True)
                decoder.ctx.request_abort()
            yield
    decoder._turn = aborting_turn
    try:
        session.evaluate(second, cache_reuse=16)
    finally:
        decoder._turn = turn
        decoder.ctx.clear_abort()
    assert not decoder._shift           # the rotating decode ran to the end
    assert session.evaluate(second, cache_reuse=16) >= len(second) - len(typed) - 2
    assert positions(session) == (0, len(second) - 1)


@pytest.mark.slow
def test_a_windowed_cache_keeps_the_whole_prompt_through_an_editing_session(gemma):
    # gemma-3 attends over a 512-token window in 5 of its 6 layers, and
    # libllama's windowed cache recycles cells a window behind a sequence's
    # end, dropping that sequence's start.  Without SEQ_PIN that happened
    # here when the second chunk rotated in (the new chunk is decoded in
    # the scratch sequence, and the moved prefix looked old), and the next
    # keystroke found the window before the cursor gone: all 2600 tokens
    # were evaluated again.
    def code(i, n):
        return "".join("def f%d_%d(x):\n    return x * %d + %d\n" % (i, j, j, i) for j in range(n))
    chunks = [text_tokens(gemma, "# chunk %d\n" % i + code(i, 6)) for i in range(8)]
    prefix = text_tokens(gemma, code(100, 70))
    suffix = text_tokens(gemma, code(200, 28))
    line = "    result = compute(alpha, beta, gamma) + other_value\n"
    # a few tokens a keystroke: the next request cuts them off the cache as it
    # would sixteen (no check reads them; each costs a decode over ~3k cells)
    greedy = GenerationParams(n_predict=4, sampling=SamplingParams(temperature=0), cache_reuse=64)
    with ChatSession(gemma, n_ctx=4096, n_batch=512, n_threads=TEST_THREADS) as session:
        first = 0
        for k in range(14):
            rotated = k % 6 == 5
            first += rotated
            extra = sum(chunks[first:first + 6], [])
            prompt = [gemma.bos] + extra + prefix + text_tokens(gemma, line[:k]) + suffix
            done = session.complete(prompt, greedy)
            if k == 0:
                assert len(prompt) > 2000
                continue
            # at most the new chunk, or the typed line's last tokens, is evaluated
            new = len(chunks[first + 5]) if rotated else 0
            assert done.usage.evaluated_tokens <= new + 8, (k, done.usage)
            assert positions(session) == (0, len(session.cached) - 1)
