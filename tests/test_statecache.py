"""Prompt states kept beside the sessions (engine/statecache.py), on the real library.

Two prompts taking turns on one session: each turn's prompt overwrites the
other's cache, so without kept states every turn evaluates its whole prompt.
With them, the session keeps its state before losing it and restores the
one a prompt shares most with.  A restore must leave the session's token
bookkeeping exactly the KV cache's: every test here checks the greedy text
against a session that evaluated the prompt from nothing.
"""

import pytest

from offgrid.engine.session import ChatSession, GenerationParams, shared_decoder
from offgrid.engine.statecache import StateCache
from offgrid.request import SamplingParams

try:
    from .serverproc import TEST_THREADS
except ImportError:
    from serverproc import TEST_THREADS

GREEDY = dict(n_predict=12, sampling=SamplingParams(temperature=0))


def tokens(model, text):
    return model.tokenize(text, add_special=False)


def conversations(model):
    a = tokens(model, "def fibonacci(n):\n    " + "# walk the numbers with care\n    " * 12)
    b = tokens(model, "class Stack:\n    " + "# plates: last in, first out\n    " * 12)
    return a, b


def turn(model, prompt, k):
    return prompt + tokens(model, "\n# turn %d\n" % k)


def positions(session):
    mem = session._ctx.memory
    return mem.seq_pos_min(session._seq), mem.seq_pos_max(session._seq)


@pytest.fixture
def reference(qwen):
    """A session without kept states: every prompt evaluated from nothing."""
    with ChatSession(qwen, n_ctx=1024, n_batch=256, n_threads=TEST_THREADS) as s:
        def run(prompt, **kw):
            s.reset()
            return s.complete(prompt, GenerationParams(**dict(GREEDY, **kw)))
        yield run


def test_alternating_prompts_restore_their_states_with_the_same_greedy_text(qwen, reference):
    states = StateCache(256 << 20)
    a, b = conversations(qwen)
    with ChatSession(qwen, n_ctx=1024, n_batch=256, n_threads=TEST_THREADS) as s:
        s.use_states(states)
        for k in range(3):
            for prompt in (a, b):
                p = turn(qwen, prompt, k)
                c = s.complete(p, GenerationParams(**GREEDY))
                if k > 0:
                    # all but the turn's last line came from the kept state
                    assert c.usage.cached_tokens >= len(prompt), (k, c.usage)
                else:
                    assert c.usage.cached_tokens == 0
                assert c.text == reference(p).text
                assert positions(s) == (0, len(s.cached) - 1)
        st = states.stats()
        assert st["hits"] == 4 and st["saves"] >= 4
    # each turn's state replaced the one before it behind the same prompt (and
    # was written into its memory): one state a conversation, not one a turn
    assert len(states._states) == 2 and st["reclaims"] >= 2, st


def test_what_a_state_replaces():
    from offgrid.engine.statecache import TAIL_REPLACED, replaces
    old = list(range(1000))
    assert replaces(old + [5, 6], old)                  # contains it
    assert replaces(old[:-20] + [7] * 30, old)          # all but a short tail
    assert not replaces(old[:-(TAIL_REPLACED + 1)] + [7], old)     # too long a tail
    assert not replaces([9] + old, old)                 # another prompt
    short = list(range(40))
    assert not replaces(short[:30] + [7], short)        # more than an eighth of it
    assert replaces(short[:36] + [7], short)


def test_conversations_that_go_on_write_over_their_older_states(qwen, reference):
    """Each conversation's turn is its last prompt, the answer and a new line, as a
    chat client sends it: the state kept when the other takes the session is
    written into the buffer of the one it replaces, and restores right."""
    states = StateCache(256 << 20)
    a, b = conversations(qwen)
    with ChatSession(qwen, n_ctx=1024, n_batch=256, n_threads=TEST_THREADS) as s:
        s.use_states(states)
        for k in range(3):
            for name in ("a", "b"):
                prompt = (a if name == "a" else b) + tokens(qwen, "\n# %s, turn %d\n" % (name, k))
                c = s.complete(prompt, GenerationParams(**GREEDY))
                assert c.text == reference(prompt).text, (name, k)
                if k > 0:
                    assert c.usage.cached_tokens >= len(prompt) - 12, (name, k, c.usage)
                prompt = prompt + c.tokens
                if name == "a":
                    a = prompt
                else:
                    b = prompt
        st = states.stats()
    # from the second round on, each save replaces that conversation's own older state
    assert st["reclaims"] >= 3, st
    kept = [x.tokens for x in states._states.values()]
    assert len(kept) == 2, [len(t) for t in kept]


def test_a_conversation_s_state_replaces_the_older_one_it_contains(qwen):
    states = StateCache(256 << 20)
    a, b = conversations(qwen)
    with ChatSession(qwen, n_ctx=1024, n_batch=256, n_threads=TEST_THREADS) as s:
        s.use_states(states)
        for k in range(3):
            a = a + tokens(qwen, "\n# turn %d of a\n" % k)
            s.evaluate(a)
            b = b + tokens(qwen, "\n# turn %d of b\n" % k)
            s.evaluate(b)
        # one state per conversation: its latest (b's is in the session)
        kept = [st.tokens for st in states._states.values()]
        assert len(kept) == 2 and a in kept
        assert states.stats()["hits"] == 4


def test_a_state_restores_into_another_session_of_the_shared_context(qwen, reference):
    states = StateCache(256 << 20)
    a, b = conversations(qwen)
    decoder = shared_decoder(qwen, 2, n_ctx=1024, n_batch=256, n_threads=TEST_THREADS)
    first, second = (ChatSession(qwen, decoder=decoder) for _ in range(2))
    try:
        for s in (first, second):
            s.use_states(states)
        first.complete(turn(qwen, a, 0), GenerationParams(**GREEDY))
        first.complete(turn(qwen, b, 0), GenerationParams(**GREEDY))    # keeps a's state
        p = turn(qwen, a, 1)
        c = second.complete(p, GenerationParams(**GREEDY))
        assert c.usage.cached_tokens >= len(a)
        assert c.text == reference(p).text
        # the first session's cache is untouched by the restore into the second
        again = turn(qwen, b, 0)
        c = first.complete(again, GenerationParams(**GREEDY))
        assert c.usage.cached_tokens == len(again) - 1
        assert c.text == reference(again).text
        assert positions(first) == (0, len(first.cached) - 1)
        assert positions(second) == (0, len(second.cached) - 1)
    finally:
        first.close()
        second.close()
        decoder.close()


def test_a_small_bound_keeps_fewer_states(qwen):
    a, b = conversations(qwen)
    c = tokens(qwen, "SELECT name FROM users WHERE " + "id > 10 AND " * 40)
    with ChatSession(qwen, n_ctx=1024, n_batch=256, n_threads=TEST_THREADS) as s:
        one = s._ctx  # noqa: F841
        s.evaluate(a)
        size = len(s._ctx.seq_state(s._seq))
        # room for one state of this size, not two
        states = StateCache(int(size * 1.6))
        s.use_states(states)
        for prompt in (b, c, a):
            s.evaluate(prompt)
        st = states.stats()
        assert st["states"] == 1 and st["bytes"] <= states.limit
        assert st["evictions"] >= 1


def test_a_zero_bound_keeps_nothing(qwen):
    a, b = conversations(qwen)
    with ChatSession(qwen, n_ctx=1024, n_batch=256, n_threads=TEST_THREADS) as s:
        s.use_states(StateCache(0))
        assert s.states is None
        s.evaluate(a)
        s.evaluate(b)
        assert s.evaluate(a) == 0


def test_bytes_per_token_of_a_state(qwen):
    """Qwen2.5-Coder-0.5B: 24 layers, 2 KV heads of 64, f16 keys and values: 12 KiB a
    token, and a few bytes of each cell's position and sequence."""
    a, _ = conversations(qwen)
    with ChatSession(qwen, n_ctx=1024, n_batch=256, n_threads=TEST_THREADS) as s:
        s.evaluate(a)
        per_token = len(s._ctx.seq_state(s._seq)) / len(a)
    assert 24 * 2 * 64 * 2 * 2 <= per_token < 24 * 2 * 64 * 2 * 2 + 64


def test_chunk_reuse_works_on_a_restored_state(fim_model):
    """An editor's FIM prompt comes back after another file's, with a line typed:
    the state is restored, then its suffix moved as chunk reuse does."""
    prefix = tokens(fim_model, "import os\n\n\ndef walk(root):\n" * 8)
    suffix = tokens(fim_model, "\n    return files\n\n\ndef main():\n    print(walk('.'))\n" * 6)
    other = tokens(fim_model, "fn main() {\n    println!(\"hello\");\n}\n" * 20)
    line, typed = tokens(fim_model, "    files = os.listdir("), \
        tokens(fim_model, "    files = os.listdir(root")
    first = prefix + line + suffix + [fim_model.fim_mid]
    second = prefix + typed + suffix + [fim_model.fim_mid]
    greedy = GenerationParams(n_predict=8, sampling=SamplingParams(temperature=0),
                              cache_reuse=16)
    with ChatSession(fim_model, n_ctx=2048, n_batch=64, n_threads=TEST_THREADS) as ref:
        want = ref.complete(second, greedy).text
    with ChatSession(fim_model, n_ctx=2048, n_batch=64, n_threads=TEST_THREADS) as s:
        s.use_states(StateCache(64 << 20))
        s.complete(first, greedy)
        s.complete(other + [fim_model.fim_mid], greedy)
        c = s.complete(second, greedy)
        assert c.usage.cached_tokens > len(prefix) + 0.9 * len(suffix)
        assert c.text == want
        assert positions(s) == (0, len(s.cached) - 1)


def test_a_sliding_window_model_restores_a_conversation_that_goes_on(gemma):
    """gemma-3's window cache keeps only a state's last window, so a state helps
    a prompt that goes on from its end (the next turn of a conversation)."""
    a = tokens(gemma, "<start_of_turn>user\n" + "Tell me about the sea and the ships. " * 40)
    b = tokens(gemma, "<start_of_turn>user\n" + "Write a poem about mountains and snow. " * 40)
    greedy = GenerationParams(n_predict=8, sampling=SamplingParams(temperature=0))
    with ChatSession(gemma, n_ctx=2048, n_batch=256, n_threads=TEST_THREADS) as s, \
            ChatSession(gemma, n_ctx=2048, n_batch=256, n_threads=TEST_THREADS) as ref:
        s.use_states(StateCache(256 << 20))
        ca = s.complete(a, greedy)
        s.complete(b, greedy)
        follow = a + ca.tokens + tokens(gemma, " And the fish?")
        c = s.complete(follow, greedy)
        assert c.usage.cached_tokens >= len(a)
        assert c.text == ref.complete(follow, greedy).text


# -- through the server ---------------------------------------------------------------

try:
    from .serverproc import ServerProcess
except ImportError:
    from serverproc import ServerProcess

QWEN_PATH = "models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def chat_turns(k):
    """Two conversations' prompts at turn k: each turn goes on from the last."""
    a = "You review Python code.\n" + "def add(x, y):\n    return x + y\n" * 25
    b = "You translate to French.\n" + "The cat sleeps on the warm mat.\n" * 25
    for i in range(k + 1):
        a += "\nQ%d: what does add(%d, %d) return?\nA:" % (i, i, i + 1)
        b += "\nQ%d: translate 'the %d dogs'.\nA:" % (i, i)
    return a, b


def alternate(server, turns=2):
    """The /completion bodies of two conversations taking turns on one session."""
    out = []
    for k in range(turns):
        for prompt in chat_turns(k):
            status, _, body = server.post("/completion", {
                "prompt": prompt, "n_predict": 8, "temperature": 0, "cache_prompt": True})
            assert status == 200, body
            out.append(body)
    return out


def test_two_conversations_taking_turns_on_one_session_keep_their_prompts():
    with ServerProcess(QWEN_PATH, "-np", "1", "--cache-ram", "0") as plain:
        without = alternate(plain)
    with ServerProcess(QWEN_PATH, "-np", "1", "--cache-ram", "256", "--no-cache-disk") as s:
        got = alternate(s)
        m = s.metrics()
    # turn 0: nothing cached; turn 1 of each: all but its new question from a state
    for body in got[:2] + without:
        assert body["timings"]["cache_n"] < 8, body["timings"]
    for body in got[2:]:
        t = body["timings"]
        assert t["prompt_n"] < 30 and t["cache_n"] > 200, t
    assert [b["content"] for b in got] == [b["content"] for b in without]
    assert [v for k, v in m.items() if k.startswith("offgrid_state_cache_hits_total")] == [2]


def test_a_restored_state_copies_back_byte_for_byte(qwen):
    """A restore puts back exactly the cells it was given (so a restored prompt differs
    from one evaluated afresh only as any cached prefix does: by the batch its keys
    were computed in)."""
    a, b = conversations(qwen)
    decoder = shared_decoder(qwen, 2, n_ctx=1024, n_batch=256, n_threads=TEST_THREADS)
    first, second = (ChatSession(qwen, decoder=decoder) for _ in range(2))
    try:
        first.evaluate(a)
        second.evaluate(b)
        saved = first.copy_state()
        first.evaluate(b)               # the session holds something else meanwhile
        # into the other session and back: the cells (each naming its sequence)
        assert second.load_state(list(a), saved)
        assert second.cached == a and positions(second) == (0, len(a) - 1)
        assert first.load_state(list(a), second.copy_state())
        assert first.cached == a and positions(first) == (0, len(a) - 1)
        assert first.copy_state() == saved
    finally:
        first.close()
        second.close()
        decoder.close()
