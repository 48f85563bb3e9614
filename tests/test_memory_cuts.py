"""Cuts a memory class can and cannot make: drafts taken back natively (one
session), a windowed cache (--no-swa-full), a hybrid under --no-kv-unified,
and a turn that diverges where the reply began (a checkpoint restored).
"""

import concurrent.futures

import pytest

import archmodels
from memclass import BASE, ROLLBACK, complete, fresh, reference_server, text, tokens_of
from serverproc import TEST_THREADS, ServerProcess


@pytest.mark.parametrize("native", sorted(ROLLBACK))
def test_one_session_takes_drafts_back_natively(native, tiny_dir):
    """-np 1 on an architecture whose recurrent state libllama snapshots: a wrong
    draft is taken back by llama_memory_seq_rm within the snapshots."""
    path, drafter = archmodels.build(native, tiny_dir), archmodels.build("llama", tiny_dir)
    with ServerProcess(path, "-md", drafter, ctx=4096) as srv, \
            reference_server(path, ctx=4096) as ref:
        memory = srv.get("/props")[2]["memory"]
        assert memory["draft_rollback"] == "native" and memory["rollback"] == 8
        for seed in (15, 16):
            body = complete(srv, text(90, seed), 24)
            assert body["timings"]["draft_n"] > body["timings"]["draft_n_accepted"]
            assert body == fresh(ref, text(90, seed), 24)


@pytest.mark.parametrize("swa_arch", ["gemma3", "gpt-oss"])
def test_no_swa_full_gives_the_default_text(swa_arch, tiny_dir):
    """A window cache (64 tokens here) that keeps only the window: a cut below it
    is a re-evaluation, never a reply from a cache with keys missing."""
    path = archmodels.build(swa_arch, tiny_dir)
    words = BASE.split()
    edits = [BASE, " ".join(words[:100]), " ".join(words[:100] + ["granite"] + words[101:]),
             BASE + " " + text(10, 3)]
    with ServerProcess(path, "--no-swa-full", ctx=4096) as windowed, \
            reference_server(path, ctx=4096) as ref:
        for prompt in edits:
            assert complete(windowed, prompt) == fresh(ref, prompt)


def test_a_chunked_window_past_its_first_chunk_gives_the_fresh_text(tiny_dir):
    """Llama 4's window layers attend within their own 8192-token chunk: a
    prompt past the first chunk, edited in either chunk.  The full-size window
    (the default) keeps every cell, so all before the edit is reused; a
    windowed cache (--no-swa-full) has let the first chunk's window cells go,
    and what it cannot serve is evaluated again."""
    path = archmodels.build("llama4", tiny_dir)
    words = text(4200, 1).split()             # 8,233 tokens
    edits = [(at, " ".join(words[:at] + ["granite"] + words[at + 1:])) for at in (4150, 4190)]
    with reference_server(path, ctx=16384) as ref:
        want = {at: fresh(ref, prompt) for at, prompt in edits}
        before = {at: len(tokens_of(ref, " ".join(words[:at]))) for at, _ in edits}
        assert before[4150] < 8192 < before[4190]
        for flags in ((), ("--no-swa-full",)):
            with ServerProcess(path, *flags, ctx=16384) as srv:
                for at, prompt in edits:
                    complete(srv, " ".join(words))
                    body = complete(srv, prompt)
                    assert body == want[at], (flags, at)
                    if not flags:    # all before the edit
                        assert body["timings"]["cache_n"] >= before[at] - 1


def test_a_hybrid_with_no_kv_unified_shares_one_cache_and_serves(tiny_dir):
    """--no-kv-unified's stream per session holds plain attention caches only
    (scripts/patches/0005): a hybrid's sessions share one cache instead, with a
    line saying so, rather than fail to load."""
    path = archmodels.build("qwen35", tiny_dir)
    prompts = [text(50, 20), text(60, 21)]
    with ServerProcess(path, "-np", "2", "--no-kv-unified", ctx=2048) as srv, \
            reference_server(path, ctx=2048) as ref:
        assert any("--no-kv-unified" in line and "share one cache" in line
                   for line in srv.output)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda p: complete(srv, p), prompts))
        assert got == [fresh(ref, p) for p in prompts]


@pytest.mark.parametrize("hybrid", ["qwen35", "lfm2"])
def test_a_turn_whose_reply_renders_otherwise_restarts_from_a_checkpoint(hybrid, tiny_dir):
    """Qwen3.5's template drops a reply's reasoning from the next turn's prompt, so
    the prompt diverges where the reply began: the session restores the
    checkpoint it made 4 tokens before the first prompt's end, not nothing."""
    from offgrid.engine.model import Model
    from offgrid.engine.session import ChatSession
    from offgrid.request import GenerationParams, SamplingParams
    model = Model.load(str(archmodels.build(hybrid, tiny_dir)), progress=False)
    greedy = GenerationParams(n_predict=12, sampling=SamplingParams(temperature=0.0))
    try:
        first = model.tokenize(text(100, 13), add_special=True)
        second = first + model.tokenize(" " + text(30, 14), add_special=False)
        with ChatSession(model, n_ctx=2048, n_threads=TEST_THREADS) as s, \
                ChatSession(model, n_ctx=2048, n_threads=TEST_THREADS) as ref:
            s.complete(first, greedy)
            before = s.checkpoints.restored
            got = s.complete(second, greedy)
            assert s.checkpoints.restored == before + 1
            assert got.usage.cached_tokens == len(first) - 4
            assert got.text == ref.complete(second, greedy).text
    finally:
        model.close()


def test_ctx_checkpoints_bounds_the_checkpoints_and_zero_means_none(tiny_dir):
    """-ctxcp (llama-server's flag): a prompt that parts from a hybrid's cache restarts
    from a checkpoint, or with -ctxcp 0 is evaluated whole; the text is the same."""
    path = archmodels.build("qwen35", tiny_dir)
    words = text(700, 3).split()
    first, second = " ".join(words), " ".join(words[:500] + ["granite"] + words[501:])
    with reference_server(path, ctx=4096) as ref:
        want = fresh(ref, second)
        n_before = len(tokens_of(ref, " ".join(words[:500])))
    got = {}
    for flags in ((), ("-ctxcp", "0"), ("-ctxcp", "1", "-cms", "128")):
        with ServerProcess(path, *flags, ctx=4096) as srv:
            complete(srv, first)
            body = complete(srv, second)
        assert body == want, flags
        got[flags] = body["timings"]["cache_n"]
    # 256 apart by default: the last checkpoint at or before the edit
    assert n_before - 256 < got[()] <= n_before, got
    assert got[("-ctxcp", "0")] == 0, got
    # one kept, the newest (4 tokens before the first prompt's end): past the edit,
    # so of no use to the second prompt
    assert got[("-ctxcp", "1", "-cms", "128")] == 0, got
