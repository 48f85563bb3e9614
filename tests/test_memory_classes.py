"""Every memory class served right: dense, MoE, SWA, hybrid and recurrent models.

Each architecture is a tiny model libllama builds itself (archmodels.py),
served by ``python3 -m offgrid`` with its default flags over HTTP, and
compared with a fresh server of the same model that caches nothing and
drafts nothing (the reference: every answer there is computed from scratch).
The server under test runs four sessions and a draft model (the tiny llama,
whose drafts are nearly always wrong), so every request drafts, takes drafts
back, batches, reuses and restores what it can.

What a user would notice is asserted: the same greedy text as the reference,
no failed request, cached tokens where the cache can serve, and /props
saying what the model's memory is and what that enables.
"""

import concurrent.futures
import os

import pytest

import archmodels
from serverproc import ServerProcess

CLASSES = {
    "llama": "dense", "qwen3moe": "dense", "gemma3": "swa", "gpt-oss": "swa",
    "lfm2": "hybrid", "granitehybrid": "hybrid", "qwen3next": "hybrid",
    "nemotron_h": "hybrid", "qwen35": "hybrid", "mamba2": "recurrent",
}
# architectures whose recurrent state libllama snapshots (llm_arch_supports_rs_rollback)
ROLLBACK = {"lfm2", "nemotron_h", "qwen35"}

WORDS = ("river stone cloud maple harbor lantern copper meadow violet thunder anchor "
         "willow ember falcon garnet orchard pebble saffron tundra velvet").split()


def text(n, seed):
    """n words, a different sequence for each seed (prompts a few hundred tokens long)."""
    return " ".join(WORDS[(i * 7 + seed * 3 + i // 5) % len(WORDS)] for i in range(n))


BASE = text(180, 1)


@pytest.fixture(scope="module")
def arch_dir(tiny_dir):
    return tiny_dir


@pytest.fixture(scope="module", params=sorted(CLASSES))
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def model(arch, arch_dir):
    return archmodels.build(arch, arch_dir)


@pytest.fixture(scope="module")
def drafter(arch, arch_dir):
    # a dense model of the same vocabulary whose guesses are nearly always wrong
    return archmodels.build("qwen3moe" if arch == "llama" else "llama", arch_dir)


@pytest.fixture(scope="module")
def reference(model):
    with ServerProcess(model, "--spec-type", "none", "-cram", "0", "--no-cache-disk",
                       ctx=4096) as s:
        yield s


@pytest.fixture(scope="module")
def server(model, drafter, tmp_path_factory):
    with ServerProcess(model, "-np", "4", "-md", drafter, "--cache-dir",
                       tmp_path_factory.mktemp("states"), ctx=4096) as s:
        yield s


def complete(srv, prompt, n=16, **extra):
    status, _, body = srv.post("/completion", dict(
        {"prompt": prompt, "n_predict": n, "temperature": 0, "return_tokens": True}, **extra))
    assert status == 200, body
    return body


# A random model's top two logits can lie within rounding of each other, and a
# prompt evaluated in other batches (cached, batched beside another session)
# may then pick the other one: a flip is accepted only at such a near tie,
# reported by the reference itself (its top two log-probabilities).
NEAR_TIE = 1e-3


class Fresh:
    """The reference's answer to a prompt, compared token by token."""

    def __init__(self, reference, prompt, n=16):
        self.body = complete(reference, prompt, n, cache_prompt=False, n_probs=2)

    def __eq__(self, got):
        if isinstance(got, str):
            return got == self.body["content"]
        mine, theirs = self.body["tokens"], got["tokens"]
        if mine == theirs:
            return True
        i = next(i for i, (a, b) in enumerate(zip(mine + [None], theirs + [None])) if a != b)
        if i >= len(mine) or i >= len(theirs):
            return False
        top = self.body["completion_probabilities"][i]["top_logprobs"]
        return len(top) == 2 and top[1]["id"] == theirs[i] \
            and top[0]["logprob"] - top[1]["logprob"] < NEAR_TIE

    def __repr__(self):
        return repr(self.body["content"])


def fresh(reference, prompt, n=16):
    return Fresh(reference, prompt, n)


def test_props_say_the_class_and_what_it_enables(server, arch):
    status, _, props = server.get("/props")
    assert status == 200
    memory = props["memory"]
    assert memory["class"] == CLASSES[arch]
    assert memory["chunk_reuse"] == (CLASSES[arch] in ("dense", "swa"))
    assert memory["checkpoints"] == (CLASSES[arch] in ("hybrid", "recurrent"))
    assert memory["speculation"]
    # four sessions: a state's snapshots are not used beside others' decodes
    assert memory["rollback"] == 0
    assert memory["draft_rollback"] == ("cut" if CLASSES[arch] in ("dense", "swa") else
                                        "checkpoint and replay")
    assert memory["description"].startswith(CLASSES[arch])
    assert props["default_generation_settings"]["speculative"] == memory["speculation"]
    if arch in ("qwen3moe", "gpt-oss", "qwen3next"):
        assert memory["n_expert"] > 0
    if arch == "qwen35":
        assert memory["rope_type"] == "imrope"


def test_drafts_taken_back_give_the_plain_text(server, reference, arch):
    body = complete(server, BASE, 24)
    assert body == fresh(reference, BASE, 24)
    # the draft model's guesses are nearly all wrong: every class takes them
    # back (cut, native rollback, or a checkpoint restored and replayed)
    drafted = body["timings"].get("draft_n", 0)
    assert drafted > 0
    assert body["timings"]["draft_n_accepted"] < drafted


@pytest.mark.parametrize("native", sorted(ROLLBACK))
def test_one_session_takes_drafts_back_natively(native, arch_dir):
    """-np 1 on an architecture whose recurrent state libllama snapshots: a wrong
    draft is taken back by llama_memory_seq_rm within the snapshots."""
    path, drafter = archmodels.build(native, arch_dir), archmodels.build("llama", arch_dir)
    with ServerProcess(path, "-md", drafter, ctx=4096) as srv, \
            ServerProcess(path, "--spec-type", "none", "-cram", "0", "--no-cache-disk",
                          ctx=4096) as ref:
        memory = srv.get("/props")[2]["memory"]
        assert memory["draft_rollback"] == "native" and memory["rollback"] == 8
        for seed in (15, 16):
            body = complete(srv, text(90, seed), 24)
            assert body["timings"]["draft_n"] > body["timings"]["draft_n_accepted"]
            assert body == fresh(ref, text(90, seed), 24)


@pytest.mark.parametrize("edit", ["middle", "extended", "shortened"])
def test_an_edited_prompt_gives_the_fresh_text(server, reference, edit):
    words = BASE.split()
    complete(server, BASE)          # the cache now holds BASE and its answer
    if edit == "middle":
        prompt = " ".join(words[:90] + ["granite"] + words[91:])
    elif edit == "extended":
        prompt = BASE + " " + text(20, 2)
    else:
        prompt = " ".join(words[:150])
    body = complete(server, prompt)
    assert body == fresh(reference, prompt)
    if edit == "extended":
        assert body["timings"]["cache_n"] > 0


def test_a_chat_second_turn_reads_the_first_from_the_cache(server, reference):
    first = [{"role": "system", "content": text(60, 3)},
             {"role": "user", "content": text(30, 4)}]
    status, _, one = server.post("/v1/chat/completions", {
        "messages": first, "max_tokens": 12, "temperature": 0})
    assert status == 200, one
    reply = one["choices"][0]["message"]["content"]
    second = first + [{"role": "assistant", "content": reply},
                      {"role": "user", "content": text(12, 5)}]
    status, _, two = server.post("/v1/chat/completions", {
        "messages": second, "max_tokens": 12, "temperature": 0})
    assert status == 200, two
    cached = two["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    # at least the first turn's prompt, less the few tokens before its end
    # where the checkpoint is (checkpoints.NEAR_END)
    assert cached >= one["usage"]["prompt_tokens"] - 4
    status, _, ref = reference.post("/v1/chat/completions", {
        "messages": second, "max_tokens": 12, "temperature": 0, "cache_prompt": False})
    assert two["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]


def test_four_sessions_batched_give_each_its_text_alone(server, reference):
    prompts = [text(40 + 10 * i, 10 + i) for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: complete(server, p, 20), prompts))
    assert got == [fresh(reference, p, 20) for p in prompts]


def tokens_of(srv, text_):
    status, _, body = srv.post("/tokenize", {"content": text_, "add_special": True})
    assert status == 200, body
    return body["tokens"]


def answered(srv, prompt, n=16):
    """``prompt`` (text or tokens) and its greedy answer: a prompt going on from
    them continues the state after it exactly (which holds all but the answer's
    last token: sampled, never decoded)."""
    body = complete(srv, prompt, n, return_tokens=True)
    ids = tokens_of(srv, prompt) if isinstance(prompt, str) else list(prompt)
    return ids + body["tokens"]


def test_a_kept_state_restored_goes_on_as_the_live_one(model, reference, arch, tmp_path):
    """-np 1 and two conversations taking turns: the first's state is kept in RAM
    when the second takes the session, and restored when it comes back (with
    its checkpoints, for a prompt that diverges inside it); after a restart,
    from --cache-dir; and from a slot file."""
    a, b = text(120, 6), text(120, 7)
    states, slots = tmp_path / "states", tmp_path / "slots"
    with ServerProcess(model, "--cache-dir", states, "--slot-save-path", slots,
                       ctx=4096) as srv:
        n_a = len(tokens_of(srv, a))
        held = answered(srv, a)
        complete(srv, b)
        a1 = held + tokens_of(srv, " " + text(8, 9))[1:]     # a chat's next turn
        again = complete(srv, a1)
        assert again["timings"]["cache_n"] == len(held) - 1  # restored, not re-evaluated
        assert again == fresh(reference, a1)
        if CLASSES[arch] in ("hybrid", "recurrent"):
            # a prompt that diverges inside the kept state: its checkpoints go with it
            complete(srv, b)
            a2 = a + " " + text(15, 8)
            again = complete(srv, a2)
            assert again["timings"]["cache_n"] >= n_a - 4
            assert again == fresh(reference, a2)
        held = answered(srv, a1)
        status, _, saved = srv.post("/slots/0?action=save", {"filename": "a.bin"})
        assert status == 200, saved
        complete(srv, b)
        status, _, restored = srv.post("/slots/0?action=restore", {"filename": "a.bin"})
        assert status == 200, restored
        assert restored["n_restored"] == len(held) - 1
        a3 = held + tokens_of(srv, " " + text(10, 9))[1:]
        body = complete(srv, a3)
        assert body["timings"]["cache_n"] == len(held) - 1
        assert body == fresh(reference, a3)
        held = answered(srv, a3)
    with ServerProcess(model, "--cache-dir", states, ctx=4096) as srv:
        a4 = held + tokens_of(srv, " " + text(12, 11))[1:]
        body = complete(srv, a4)
        assert body["timings"]["cache_n"] == len(held) - 1      # read back from disk
        assert body == fresh(reference, a4)


@pytest.mark.parametrize("swa_arch", ["gemma3", "gpt-oss"])
def test_no_swa_full_gives_the_default_text(swa_arch, arch_dir):
    """A window cache (64 tokens here) that keeps only the window: a cut below it
    is a re-evaluation, never a reply from a cache with keys missing."""
    path = archmodels.build(swa_arch, arch_dir)
    words = BASE.split()
    edits = [BASE, " ".join(words[:100]), " ".join(words[:100] + ["granite"] + words[101:]),
             BASE + " " + text(10, 3)]
    with ServerProcess(path, "--no-swa-full", ctx=4096) as windowed, \
            ServerProcess(path, "--spec-type", "none", "-cram", "0", "--no-cache-disk",
                          ctx=4096) as ref:
        for prompt in edits:
            assert complete(windowed, prompt) == fresh(ref, prompt)


def test_two_models_alike_but_for_their_weights_never_share_a_state(arch_dir, tmp_path):
    """Same size, same first MiB (metadata, tensor index), other weights: a state
    the first wrote to --cache-dir is never restored into the second."""
    first = archmodels.build("llama", arch_dir)
    second = tmp_path / "second.gguf"
    data = bytearray(first.read_bytes())
    for i in range(len(data) - 4096, len(data) - 64, 97):    # tensor data, near the end
        data[i] ^= 0x5A
    second.write_bytes(bytes(data))
    assert os.path.getsize(second) == os.path.getsize(first)
    states = tmp_path / "states"
    prompt = text(100, 12)
    with ServerProcess(first, "--cache-dir", states, ctx=4096) as srv:
        complete(srv, prompt)
    with ServerProcess(first, "--cache-dir", states, ctx=4096) as srv:
        assert complete(srv, prompt)["timings"]["cache_n"] > 0      # its own state, back
    with ServerProcess(second, "--cache-dir", states, ctx=4096) as srv:
        assert complete(srv, prompt)["timings"]["cache_n"] == 0


def test_a_hybrid_with_no_kv_unified_shares_one_cache_and_serves(arch_dir):
    """--no-kv-unified's stream per session holds plain attention caches only
    (scripts/patches/0005): a hybrid's sessions share one cache instead, with a
    line saying so, rather than fail to load."""
    path = archmodels.build("qwen35", arch_dir)
    prompts = [text(50, 20), text(60, 21)]
    with ServerProcess(path, "-np", "2", "--no-kv-unified", ctx=2048) as srv, \
            ServerProcess(path, "--spec-type", "none", "-cram", "0", "--no-cache-disk",
                          ctx=2048) as ref:
        assert any("--no-kv-unified" in line and "share one cache" in line
                   for line in srv.output)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda p: complete(srv, p), prompts))
        assert got == [fresh(ref, p) for p in prompts]


@pytest.mark.parametrize("hybrid", ["qwen35", "lfm2"])
def test_a_turn_whose_reply_renders_otherwise_restarts_from_a_checkpoint(hybrid, arch_dir):
    """Qwen3.5's template drops a reply's reasoning from the next turn's prompt, so
    the prompt diverges where the reply began: the session restores the
    checkpoint it made 4 tokens before the first prompt's end, not nothing."""
    from offgrid.engine.model import Model
    from offgrid.engine.session import ChatSession
    from offgrid.request import GenerationParams, SamplingParams
    model = Model.load(str(archmodels.build(hybrid, arch_dir)), progress=False)
    greedy = GenerationParams(n_predict=12, sampling=SamplingParams(temperature=0.0))
    try:
        first = model.tokenize(text(100, 13), add_special=True)
        second = first + model.tokenize(" " + text(30, 14), add_special=False)
        with ChatSession(model, n_ctx=2048) as s, ChatSession(model, n_ctx=2048) as ref:
            s.complete(first, greedy)
            before = s.checkpoints.restored
            got = s.complete(second, greedy)
            assert s.checkpoints.restored == before + 1
            assert got.usage.cached_tokens == len(first) - 4
            assert got.text == ref.complete(second, greedy).text
    finally:
        model.close()
