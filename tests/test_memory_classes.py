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

import pytest

import archmodels
from memclass import BASE, CLASSES, complete, fresh, reference_server, text
from serverproc import ServerProcess


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
    with reference_server(model, ctx=4096) as s:
        yield s


@pytest.fixture(scope="module")
def server(model, drafter, tmp_path_factory):
    with ServerProcess(model, "-np", "4", "-md", drafter, "--cache-dir",
                       tmp_path_factory.mktemp("states"), ctx=4096) as s:
        yield s


def test_props_say_the_class_and_what_it_enables(server, arch):
    status, _, props = server.get("/props")
    assert status == 200
    memory = props["memory"]
    assert memory["class"] == CLASSES[arch]
    # runs move where keys can be re-rotated: not by M-RoPE's several positions
    # a token (Qwen2-VL's text model), whose kept states still serve a prefix
    assert memory["chunk_reuse"] == (CLASSES[arch] in ("dense", "swa")
                                     and memory["rope_type"] not in ("mrope", "imrope"))
    assert memory["checkpoints"] == (CLASSES[arch] in ("hybrid", "recurrent"))
    assert memory["speculation"]
    # four sessions: a state's snapshots are not used beside others' decodes
    assert memory["rollback"] == 0
    assert memory["draft_rollback"] == ("cut" if CLASSES[arch] in ("dense", "swa") else
                                        "checkpoint and replay")
    assert memory["description"].startswith(CLASSES[arch])
    assert props["default_generation_settings"]["speculative"] == memory["speculation"]
    if arch in ("qwen3moe", "gpt-oss", "qwen3next", "deepseek2", "llama4"):
        assert memory["n_expert"] > 0
    if arch == "qwen35":
        assert memory["rope_type"] == "imrope"
    if arch == "qwen2vl":
        assert memory["rope_type"] == "mrope"
    if arch == "llama4":
        assert memory["n_swa"] == 8192       # libllama's chunk


def test_drafts_taken_back_give_the_plain_text(server, reference, arch):
    body = complete(server, BASE, 24)
    assert body == fresh(reference, BASE, 24)
    # the draft model's guesses are nearly all wrong: every class takes them
    # back (cut, native rollback, or a checkpoint restored and replayed)
    drafted = body["timings"].get("draft_n", 0)
    assert drafted > 0
    assert body["timings"]["draft_n_accepted"] < drafted


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
