"""A KV cache stream per session (--no-kv-unified, scripts/patches/0005).

By default a model's -np sessions keep their cells in one cache they share:
where a session's cells lie depends on what the others held before, and a
greedy prompt's attention sums differ in their last bits from one session to
another.  With --no-kv-unified each session's three sequences (its prompt,
the scratch of chunk reuse, the sliding-window pin) get a stream of -c cells
of their own (libllama's llama_init_from_model_streams), as llama-server gives
each slot when -np is given without -kvu: one prompt then reads the same on
every session.  These tests hold that, the per-session context, and that what
the shared cache did (batching, chunk reuse, prompt states, FIM) still works.
"""

import sys
import threading
from pathlib import Path

import pytest

from offgrid import libllama
from offgrid.engine.session import ChatSession, GenerationParams, shared_decoder
from offgrid.request import SamplingParams

try:
    from .serverproc import TEST_THREADS, ServerProcess
except ImportError:
    from serverproc import TEST_THREADS, ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parent / "conformance"))
import launcher  # noqa: E402

GREEDY = dict(sampling=SamplingParams(temperature=0))
# llama-server's test_completion_with_tokens_input: parts of the sessions'
# texts at "worth living.\n\n" on SmolLM2 in a shared cache (11 of 16 rounds)
PROMPT = "I believe the meaning of life is"


def _streams(model, n, n_ctx=1024, **kw):
    decoder = shared_decoder(model, n, n_ctx=n_ctx, n_batch=256, n_threads=TEST_THREADS,
                             kv_unified=False, **kw)
    return decoder, [ChatSession(model, decoder=decoder) for _ in range(n)]


def _close(decoder, sessions):
    for s in sessions:
        s.close()
    decoder.close()


def _positions(session):
    mem = session._ctx.memory
    return mem.seq_pos_min(session._seq), mem.seq_pos_max(session._seq)


# -- the engine ------------------------------------------------------------------------

def test_each_session_has_a_stream_of_its_own_context(smollm):
    decoder, sessions = _streams(smollm, 3, n_ctx=256)
    try:
        assert decoder.streams and decoder.ctx.n_ctx == 3 * 256
        assert [s.n_ctx for s in sessions] == [256] * 3
        # each stream holds its session's whole context, whatever the others hold
        filler = smollm.tokenize("the sea and the ships " * 100, add_special=False)[:250]
        for s in sessions:
            s.evaluate(filler)
        for s in sessions:
            assert s.cached == filler and _positions(s) == (0, 249)
    finally:
        _close(decoder, sessions)


def test_a_session_count_that_does_not_divide_the_sequences_is_refused_in_python(smollm):
    with pytest.raises(ValueError):
        libllama.ContextHandle(smollm.lib, smollm.handle, 1024, 64, 64, 1, 1, n_seq_max=4,
                               seq_per_stream=3)


def test_one_prompt_on_every_session_at_once_reads_the_same(smollm):
    """Three sessions start the same greedy prompt together, three times over."""
    prompt = smollm.tokenize(PROMPT)
    decoder, sessions = _streams(smollm, 3)
    try:
        for _ in range(3):
            out = [None] * 3
            start = threading.Barrier(3)

            def run(i):
                start.wait()
                out[i] = sessions[i].complete(
                    prompt, GenerationParams(n_predict=32, cache_prompt=False, **GREEDY))
            threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            assert len({c.text for c in out}) == 1, [c.text for c in out]
        assert decoder.n_shared_steps > 0, "the sessions never decoded together"
    finally:
        _close(decoder, sessions)


@pytest.mark.parametrize("name", ["smollm", "gemma"])
def test_a_session_reads_as_a_context_of_its_own_whatever_the_others_hold(request, name):
    """Each session in turn, beside the cells of those before it: the text of a
    context of its own.  (In one shared cache its cells would lie after theirs.
    Decoded at the same moment as another session's different work, gemma's
    batched kernels alone move a logit by up to 1.5: test_batching.py.)
    gemma-3's sessions pin their cells (SEQ_PIN): each prompt token goes into
    two sequences of its stream."""
    model = request.getfixturevalue(name)
    prompt = model.tokenize(PROMPT)
    params = GenerationParams(n_predict=32, **GREEDY)
    with ChatSession(model, n_ctx=1024, n_batch=256, n_threads=TEST_THREADS) as alone:
        want = alone.complete(prompt, params).text
    decoder, sessions = _streams(model, 3)
    try:
        # in one shared cache, the next session's cells would then start past
        # the 256th, and its text part from a context's of its own (both models,
        # measured: of 1, 4, 7 .. 37 sentences held, 34 alone parted them)
        held = model.tokenize("The lighthouse keeper counted the ships. " * 34)
        sessions[0].evaluate(held)
        assert [s.complete(prompt, params).text for s in sessions[1:]] == [want, want]
    finally:
        _close(decoder, sessions)


def test_a_state_restores_into_another_sessions_stream(qwen):
    from offgrid.engine.statecache import StateCache
    states = StateCache(64 << 20)
    a = qwen.tokenize("def fibonacci(n):\n    " + "# walk the numbers with care\n    " * 12,
                      add_special=False)
    b = qwen.tokenize("class Stack:\n    " + "# plates: last in, first out\n    " * 12,
                      add_special=False)
    greedy = GenerationParams(n_predict=12, **GREEDY)
    with ChatSession(qwen, n_ctx=1024, n_batch=256, n_threads=TEST_THREADS) as ref:
        want = ref.complete(a, greedy).text
    decoder, (first, second) = _streams(qwen, 2)
    try:
        for s in (first, second):
            s.use_states(states)
        first.complete(a, greedy)
        first.complete(b, greedy)           # keeps a's state
        c = second.complete(a, greedy)
        assert c.usage.cached_tokens >= len(a) - 1
        assert c.text == want
        assert _positions(second) == (0, len(second.cached) - 1)
        assert first.cached[:len(b)] == b and _positions(first) == (0, len(first.cached) - 1)
    finally:
        _close(decoder, (first, second))


def _together(sessions, prompts, params):
    """Each session completes its prompt, all starting at once: their texts."""
    out = [None] * len(sessions)
    start = threading.Barrier(len(sessions))

    def run(i):
        start.wait()
        out[i] = sessions[i].complete(prompts[i], params).text
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sessions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def test_an_idle_stream_between_two_others_gets_fillers_and_keeps_its_cache(qwen):
    """The first and third sessions generate together while the second holds a
    prompt and waits: libllama would make each step two ubatches (streams 0
    and 2 are not one run), so the second's stream gets a filler token each
    step, cut again after it (batch.py _fill).  Its cache reads back as it was,
    byte for byte, and its next reply and the others' are the text of a
    decoder without fillers."""
    params = GenerationParams(n_predict=12, ignore_eos=True, **GREEDY)
    held = qwen.tokenize("def fibonacci(n):\n    " + "# one step at a time\n    " * 6,
                         add_special=False)
    prompts = [qwen.tokenize("import os\n\ndef list_files(path):\n", add_special=False),
               qwen.tokenize("class Queue:\n    def __init__(self):\n", add_special=False)]
    decoder, (first, idle, third) = _streams(qwen, 3)
    try:
        assert decoder.fills
        idle.evaluate(held)
        before = idle.copy_state()
        texts = _together([first, third], prompts, params)
        assert decoder.n_fillers > 0
        assert _positions(idle) == (0, len(held) - 1) and idle.cached == held
        assert idle.copy_state() == before
        texts.append(idle.complete(held, params).text)
    finally:
        _close(decoder, (first, idle, third))
    decoder, sessions = _streams(qwen, 3)
    try:
        decoder.fills = False
        sessions[1].evaluate(held)
        want = _together([sessions[0], sessions[2]], prompts, params)
        want.append(sessions[1].complete(held, params).text)
    finally:
        _close(decoder, sessions)
    assert texts == want


def test_a_dense_models_streams_get_fillers_and_a_windowed_ones_do_not(qwen, gemma):
    for model, fills in ((qwen, True), (gemma, False)):
        decoder, sessions = _streams(model, 2, n_ctx=256)
        try:
            assert decoder.fills is fills, model.name
        finally:
            _close(decoder, sessions)


def test_fillers_go_only_where_there_are_no_more_of_them_than_tokens(qwen):
    """Steps 0 3 6 of single tokens cost less as three ubatches than filled
    (batch.py _fill: 70 against 80 ms); 0 2 4 6 less filled."""
    from offgrid.engine.batch import OUT_LAST, _Part
    decoder, sessions = _streams(qwen, 7, n_ctx=256)
    try:
        members = decoder._members

        def fillers(indices, n=1):
            step = [(_Part(members[i], [1] * n, 0, (3 * i,), OUT_LAST, False), 0, n)
                    for i in indices]
            with decoder.lock:
                made = decoder._fill(step)
            assert [p.member.index for p, _, _ in step] == sorted(
                set(indices) | {f.member.index for f in made})
            return [f.member.index for f in made]
        assert fillers([0, 2, 4, 6]) == [1, 3, 5]
        assert fillers([0, 3, 6]) == []
        assert fillers([0, 3, 6], n=2) == [1, 2, 4, 5]
        assert fillers([1, 2, 3]) == []
    finally:
        _close(decoder, sessions)


# -- through the server ------------------------------------------------------------------

@pytest.fixture(scope="module")
def srv(smollm_path):
    with ServerProcess(smollm_path, "-np", "2", "--no-kv-unified", "--temp", "0",
                       ctx=1024) as s:
        yield s


def test_a_greedy_prompt_sent_several_ways_at_once_reads_the_same(srv):
    """llama-server's test_completion_with_tokens_input, in two rounds: the single
    completion leaves the first session's cache warm, the lists run on both
    (64 tokens each, as that test's server's --n-predict).  Two are enough: on
    one shared cache (no --no-kv-unified) the first round reads the same and the
    second parts (measured: at the 53rd character, in all three lists); a third
    and fourth round start from the caches the second left, as it did."""
    status, _, body = srv.post("/tokenize", {"content": PROMPT, "add_special": True})
    assert status == 200
    tokens = body["tokens"]
    for _ in range(2):
        status, _, body = srv.post("/completion", {"prompt": tokens, "n_predict": 64})
        assert status == 200 and body["content"]
        for prompt in ([tokens, tokens], [tokens, PROMPT], [tokens, {"prompt_string": PROMPT}]):
            status, _, body = srv.post("/completion", {"prompt": prompt, "n_predict": 64})
            assert status == 200 and len(body) == 2
            assert body[0]["content"] == body[1]["content"], prompt


def test_each_slot_says_its_own_context_and_refuses_a_prompt_past_it(srv):
    status, _, props = srv.get("/props")
    assert status == 200 and props["default_generation_settings"]["n_ctx"] == 1024
    status, _, slots = srv.get("/slots")
    assert status == 200 and [s["n_ctx"] for s in slots] == [1024, 1024]
    status, _, body = srv.post("/completion", {"prompt": "sea ships " * 700, "n_predict": 4})
    assert status == 400, body
    assert body["error"]["type"] == "exceed_context_size_error"
    assert body["error"]["n_ctx"] == 1024 and body["error"]["n_prompt_tokens"] > 1024


def test_two_streams_generating_at_once_share_decode_steps(srv):
    def steps():
        m = srv.metrics()
        return sum(v for k, v in m.items() if k.startswith("offgrid_batched_steps_total"))
    before = steps()
    status, _, body = srv.post("/completion", {"prompt": "Once upon a time", "n_cmpl": 2,
                                               "n_predict": 16, "ignore_eos": True})
    assert status == 200 and len({b["content"] for b in body}) == 1
    assert steps() - before >= 12


def test_a_kept_prompt_state_comes_back_in_another_sessions_stream(srv):
    """--cache-ram (on by default): a conversation that lost its session to
    another is restored into the other session's stream."""
    a = ("You review Python code.\n" + "def add(x, y):\n    return x + y\n" * 25
         + "Q: add(1, 2)?\nA:")
    b = "You translate to French.\n" + "The cat sleeps on the warm mat.\n" * 25 + "Q: the dog?\nA:"
    bodies = []
    for prompt, slot in ((a, 0), (b, 0), (a, 1)):
        status, _, body = srv.post("/completion", {"prompt": prompt, "n_predict": 8,
                                                   "id_slot": slot, "cache_prompt": True})
        assert status == 200, body
        bodies.append(body)
    first, _, again = bodies
    # all but the last prompt token came from the state (whose decode alone may
    # pick another token at a near-tie than the whole prompt's did: the text is
    # checked against a fresh session in test_a_state_restores_into_another_sessions_stream)
    assert again["tokens_cached"] >= first["tokens_evaluated"] - 1, again
    assert again["timings"]["prompt_n"] <= 1 and again["content"], again["timings"]


def test_infill_reuses_a_moved_suffix_in_a_stream(fim_model_path):
    prefix = "import os\n\n\ndef walk(root):\n" * 8
    suffix = "\n    return files\n\n\ndef main():\n    print(walk('.'))\n" * 6
    with ServerProcess(fim_model_path, "-np", "2", "--no-kv-unified", "--temp", "0",
                       "--cache-reuse", "16") as s:
        first = {"input_prefix": prefix, "input_suffix": suffix,
                 "prompt": "    files = os.listdir(", "n_predict": 6, "id_slot": 1}
        status, _, body = s.post("/infill", first)
        assert status == 200, body
        status, _, body = s.post("/infill", dict(first, prompt="    files = os.listdir(root"))
        assert status == 200, body
        # the prefix and the moved suffix came from the cache: a few typed tokens evaluated
        assert body["tokens_cached"] > 0.9 * (body["tokens_evaluated"]) - 8, body
        assert body["timings"]["prompt_n"] <= 8, body["timings"]


# -- the conformance launcher ------------------------------------------------------------

@pytest.mark.parametrize("argv, unified", [
    (["-np", "2"], False),                  # an explicit -np: a stream per slot
    (["-np", "2", "-kvu"], True),
    (["--parallel=2", "--kv-unified"], True),
    (["-np", "2", "-kvu", "-no-kvu"], False),
    ([], True),                             # -np auto: 4 slots in one cache
    (["-np", "-1", "--no-kv-unified"], True),
])
def test_the_launcher_runs_offgrid_with_llama_servers_kv_cache(argv, unified):
    flags, dropped, _, _ = launcher.offgrid_flags(["-m", "x.gguf", "-c", "1024"] + argv)
    assert not dropped
    assert ("--no-kv-unified" not in flags) == unified
    # llama-server splits -c among the slots of a split cache: offgrid's -c is a session's
    n_par = 2 if "2" in " ".join(argv) else 1
    assert flags[flags.index("-c") + 1] == str(1024 // (1 if unified else n_par))
