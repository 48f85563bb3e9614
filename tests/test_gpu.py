"""Layers on a Vulkan device: ``make lib GPU=vulkan``'s lib/vulkan on Mesa's lavapipe.

lavapipe is a Vulkan driver that runs on the CPU, so this machine (no GPU)
runs ggml-vulkan's real shaders through the real device path: buffers
allocated on the device, weights uploaded, graphs split between the CPU and
the device.  ggml-vulkan leaves a CPU-type Vulkan device out unless it is
named, so every server here gets GGML_VK_VISIBLE_DEVICES=0 (lavapipe is the
only device).  `make test-gpu` runs this file (marker ``gpu``); `make test`
leaves it out.

What is compared with the CPU, and why that way: ggml's own backend tests
(tests/test-backend-ops.cpp of the pinned source) let a device's quantized
matrix product differ from the CPU backend's by a normalized mean squared
error of 5e-4, a relative RMS error of 2.2% for each product; and the CPU
itself multiplies Q4_1 weights by activations quantized to 8 bits, where
ggml-vulkan multiplies them by float activations (GGML_VK_DISABLE_F16 and -fa
off changed nothing, measured).  Over SmolLM2's 30 layers the logits differ by
tenths of a nat: over 7 prompts x 24 greedy tokens, a chosen token's
log-probability differed by 0.27 nats at most, and the picks parted only
where the CPU's top two were 0.26 nats apart or closer.  So the device's
greedy tokens must be the CPU's, each with a log-probability within
LOGPROB_TOL of the CPU's, until the first token where they part, and that one
must be a near-tie: the CPU's second choice, at most NEAR_TIE below its
first; past it the two texts go their own ways and nothing more is compared.
Every comparison asserts it compared enough tokens to mean something.

A device out of memory: lavapipe's heap is the host's memory and Mesa has no
setting to shrink it, so the device's limit is lowered with ggml-vulkan's own
GGML_VK_FORCE_MAX_BUFFER_SIZE: an allocation past it fails as one past a real
GPU's memory does (vk::OutOfDeviceMemoryError, a null buffer, libllama's
load returns no model).
"""

import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

try:
    from .serverproc import ROOT, ServerProcess
    from .test_rpc import RpcServer, rpc_lib  # noqa: F401 (a fixture)
except ImportError:  # tests/ is on sys.path rather than a package
    from serverproc import ROOT, ServerProcess
    from test_rpc import RpcServer, rpc_lib  # noqa: F401 (a fixture)

pytestmark = pytest.mark.gpu

VULKAN = ROOT / "lib" / "vulkan"
SMOL = ROOT / "models" / "smollm2-135m-instruct-q4_1.gguf"
QWEN = ROOT / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
N_ALL = 31          # SmolLM2-135M: 30 blocks and the output layer
NEAR_TIE = 0.5      # nats between the CPU's top two where the device may pick the other
LOGPROB_TOL = 0.4   # nats between the CPU's and the device's log-probability of one token
# the compiled shaders, kept between servers and runs (each server has its own XDG cache)
SHADER_CACHE = Path(os.environ.get("OFFGRID_CACHE", Path.home() / ".cache" / "offgrid")) \
    / "mesa-shader-cache"

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small"]


def lavapipe_env(**extra):
    return dict({"GGML_VK_VISIBLE_DEVICES": "0", "MESA_SHADER_CACHE_DIR": str(SHADER_CACHE)},
                **extra)


class GpuServer(ServerProcess):
    """A server on lib/vulkan with lavapipe as Vulkan0 (``env`` adds to it)."""

    def __init__(self, model, *args, env=None, lib=VULKAN, **kw):
        super().__init__(model, "--lib", str(lib), *args, startup_timeout=600, **kw)
        self.extra_env = lavapipe_env(**(env or {}))

    def launch(self):
        argv, cwd, env = super().launch()
        env.update(self.extra_env)
        return argv, cwd, env


@pytest.fixture(scope="module", autouse=True)
def vulkan_lib():
    assert (VULKAN / "libggml-vulkan.so").is_file(), (
        "no Vulkan build in lib/vulkan: `make lib GPU=vulkan` (make test-gpu builds it)")
    SHADER_CACHE.mkdir(parents=True, exist_ok=True)


@pytest.fixture(scope="module")
def cpu():
    """The reference: the CPU build (lib/), every layer on the CPU."""
    with ServerProcess(SMOL, "--embeddings") as s:
        yield s


@pytest.fixture(scope="module")
def slots(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu-slots")


@pytest.fixture(scope="module")
def gpu(slots):
    """Every layer on lavapipe; two sessions, kept prompt states, slot files."""
    with GpuServer(SMOL, "-ngl", "all", "-np", "2", "--cache-ram", "64", "--embeddings",
                   "--slot-save-path", str(slots), ctx=4096) as s:
        yield s


def complete(srv, prompt, n=12, **kw):
    # lavapipe on two busy cores: a token can take seconds (ggml-vulkan spins on its
    # fence while lavapipe's threads run the shaders)
    status, _, out = srv.post("/completion", dict({
        "prompt": prompt, "n_predict": n, "temperature": 0, "n_probs": 2,
        "cache_prompt": False}, **kw), timeout=900)
    assert status == 200, out
    return out


def compare_greedy(ref, got):
    """Assert ``got``'s tokens are ``ref``'s, with log-probabilities within
    LOGPROB_TOL, up to the first where they part, which must be a near-tie of
    ``ref``'s; the count of tokens that were the same."""
    a, b = ref["completion_probabilities"], got["completion_probabilities"]
    n = 0
    for pa, pb in zip(a, b):
        if pb["id"] != pa["id"]:
            top = pa["top_logprobs"]
            assert len(top) > 1 and pb["id"] == top[1]["id"], (n, ref["content"], got["content"])
            assert top[0]["logprob"] - top[1]["logprob"] < NEAR_TIE, (n, top, pb)
            break
        assert abs(pb["logprob"] - pa["logprob"]) < LOGPROB_TOL, (n, pa, pb)
        n += 1
    return n


def compare_prompts(ref_srv, srv, prompts, min_same):
    """compare_greedy over ``prompts``; at least ``min_same`` tokens the same in all."""
    same = sum(compare_greedy(complete(ref_srv, p), complete(srv, p)) for p in prompts)
    assert same >= min_same, same


def device(props, name):
    return next(d for d in props["devices"] if d["name"] == name)


# -- what a build has -------------------------------------------------------------------

def test_list_devices_names_lavapipe():
    out = subprocess.run([sys.executable, "-m", "offgrid", "--list-devices", "--lib", str(VULKAN)],
                         cwd=str(ROOT), capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, **lavapipe_env()))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "Available devices:"
    assert lines[1].startswith("  Vulkan0: llvmpipe") and "MiB free)" in lines[1], lines


def test_without_a_driver_it_says_why_and_serves_on_the_cpu():
    # no Vulkan driver to be found: the loader sees none
    env = {"VK_ICD_FILENAMES": "/nonexistent/icd.json", "VK_DRIVER_FILES": "/nonexistent/icd.json"}
    out = subprocess.run([sys.executable, "-m", "offgrid", "--list-devices", "--lib", str(VULKAN)],
                         cwd=str(ROOT), capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, **lavapipe_env(**env)))
    assert out.returncode == 0 and "(none)" in out.stdout
    assert "found no usable device" in out.stderr and "serving on the CPU" in out.stderr
    with GpuServer(SMOL, env=env, ctx=512) as s:
        props = s.get("/props")[2]
        assert props["devices"] == [{"name": "CPU", "layers": N_ALL}]
        assert complete(s, PROMPTS[0], 4)["tokens_predicted"] == 4
        assert any("serving on the CPU" in line for line in s.output), "".join(s.output)


# -- every layer on the device ------------------------------------------------------------

def test_props_metrics_and_the_load_line_show_what_the_device_holds(gpu):
    props = gpu.get("/props")[2]
    assert device(props, "CPU")["layers"] == 0
    vk = device(props, "Vulkan0")
    assert vk["layers"] == N_ALL and vk["backend"] == "Vulkan"
    assert vk["description"].startswith("llvmpipe") and vk["total"] > 0
    assert vk["type"] in ("gpu", "igpu")
    metrics = gpu.metrics()
    assert any(k.startswith("offgrid_model_device_layers{") and 'device="Vulkan0"' in k
               and v == N_ALL for k, v in metrics.items())
    assert any(k.startswith("offgrid_model_device_total_bytes{") and 'device="Vulkan0"' in k
               and v == vk["total"] for k, v in metrics.items())
    line = next(x for x in gpu.output if x.startswith("loaded ") or " loaded " in x[:40])
    assert "Vulkan0 (llvmpipe" in line and "%d layers" % N_ALL in line, line


def test_greedy_text_is_the_cpus(gpu, cpu):
    compare_prompts(cpu, gpu, PROMPTS + ["def add(a, b):\n    return"], 20)


def test_two_requests_batched_on_the_device_give_their_solo_text(gpu):
    solo = [complete(gpu, p, 6)["content"] for p in PROMPTS[:2]]
    out = [None, None]

    def run(i):
        out[i] = complete(gpu, PROMPTS[i], 6)["content"]
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    assert out == solo


def test_speculation_on_the_device_keeps_the_text(cpu):
    # the prompt-lookup drafts of tests/test_speculation.py's server test: the
    # default (copy drafts of edits) drafted nothing for this prompt here
    block = "def add_%d(a, b):\n    return a + b\n\n"
    prompt = "".join(block % i for i in range(8))
    with GpuServer(SMOL, "-ngl", "all", "--spec-type", "ngram-simple",
                   "--spec-draft-n-max", "6", ctx=1024) as gpu:
        # no n_probs: a request that asks for token probabilities is not drafted for
        spec = complete(gpu, prompt, 16, n_probs=0)
        plain = complete(gpu, prompt, 16, n_probs=0, **{"speculative.n_max": 0})
        assert spec["timings"].get("draft_n", 0) > 0, spec["timings"]
        assert "draft_n" not in plain["timings"]
        assert spec["content"] == plain["content"]
        with_probs = complete(gpu, prompt, 16, **{"speculative.n_max": 0})
        assert with_probs["content"] == plain["content"]
        assert compare_greedy(complete(cpu, prompt, 16), with_probs) >= 8


def test_a_kept_prompt_state_comes_back_from_the_device(gpu):
    a = "A long story about a dragon and a knight. " * 12
    b = "def main():\n    print('hello')\n" * 8
    first = complete(gpu, a, 8, cache_prompt=True, id_slot=0)
    complete(gpu, b, 8, cache_prompt=True, id_slot=0)       # a's cells go to --cache-ram
    again = complete(gpu, a, 8, cache_prompt=True, id_slot=0)
    assert again["timings"]["cache_n"] >= first["timings"]["prompt_n"] - 1, again["timings"]
    assert again["content"] == first["content"]


def test_a_slot_saved_from_the_device_restores(gpu, slots):
    prompt = "What is the capital of France? " + "Answer in one word, please. " * 6
    first = complete(gpu, prompt, 8, cache_prompt=True, id_slot=1)
    status, _, saved = gpu.post("/slots/1?action=save", {"filename": "france.bin"})
    assert status == 200 and saved["n_saved"] > 0, saved
    assert saved["n_written"] == os.path.getsize(os.path.join(str(slots), "france.bin"))
    complete(gpu, "def main():\n    pass\n" * 5, 4, cache_prompt=True, id_slot=0)
    status, _, restored = gpu.post("/slots/0?action=restore", {"filename": "france.bin"})
    assert status == 200 and restored["n_restored"] == saved["n_saved"], restored
    again = complete(gpu, prompt, 8, cache_prompt=True, id_slot=0)
    assert again["timings"]["prompt_n"] == 1
    assert again["content"] == first["content"]


def test_embeddings_on_the_device_are_the_cpus(gpu, cpu):
    texts = ["the cat sat on the mat", "def f(x): return x * 2"]
    got = []
    for srv in (cpu, gpu):
        status, _, body = srv.post("/v1/embeddings", {"input": texts})
        assert status == 200, body
        got.append([d["embedding"] for d in body["data"]])
    for u, v in zip(*got):
        dot = sum(x * y for x, y in zip(u, v))
        cos = dot / math.sqrt(sum(x * x for x in u) * sum(y * y for y in v))
        # the CPU's 8-bit activations again (see the top): 0.9983 measured
        assert cos > 0.995, cos


def test_a_grammar_holds_on_the_device(gpu):
    out = complete(gpu, "Is the sky blue? Answer:", 4,
                   grammar='root ::= " yes" | " no"')
    assert out["content"] in (" yes", " no"), out["content"]
    status, _, body = gpu.post("/completion", {
        "prompt": "A person as JSON:", "n_predict": 48, "temperature": 0,
        "json_schema": {"type": "object", "properties": {"age": {"type": "integer"}},
                        "required": ["age"], "additionalProperties": False}})
    assert status == 200, body
    import json
    assert isinstance(json.loads(body["content"])["age"], int), body["content"]


# -- some layers on the device -------------------------------------------------------------

def test_partial_offload_holds_the_last_layers_and_gives_the_cpus_text(cpu):
    with GpuServer(SMOL, "-ngl", "10", ctx=1024) as s:
        props = s.get("/props")[2]
        assert device(props, "CPU")["layers"] == N_ALL - 10
        assert device(props, "Vulkan0")["layers"] == 10
        compare_prompts(cpu, s, PROMPTS[:2], 8)
    with GpuServer(SMOL, "-dev", "none", ctx=512) as s:
        assert s.get("/props")[2]["devices"] == [{"name": "CPU", "layers": N_ALL}]


def buffer_mib(output, name):
    """libllama's "<name> model buffer size = N MiB" load line (-v), as N."""
    import re
    for line in output:
        m = re.search(r"\b%s model buffer size = +([0-9.]+) MiB" % re.escape(name), line)
        if m:
            return float(m.group(1))
    return 0.0


def test_tensor_overrides_keep_their_weights_in_host_memory_with_the_cpus_text(cpu):
    """-ot (llama-server's; --cpu-moe is one for experts): every layer on the device,
    the feed-forward weights of each kept in host memory, as libllama's load lines
    say; the text is the CPU's."""
    with GpuServer(SMOL, "-ngl", "all", "-v", ctx=1024) as whole:
        on_device = buffer_mib(whole.output, "Vulkan0")
    with GpuServer(SMOL, "-ngl", "all", "-v", "-ot", r"\.ffn_(up|down|gate)\.=CPU",
                   ctx=1024) as s:
        assert device(s.get("/props")[2], "Vulkan0")["layers"] == N_ALL
        left = buffer_mib(s.output, "Vulkan0")
        host = buffer_mib(s.output, "CPU_Mapped") or buffer_mib(s.output, "CPU")
        compare_prompts(cpu, s, PROMPTS[:2], 8)
    # SmolLM2-135M: the feed-forward weights are about two thirds of its layers'
    assert 0 < left < 0.6 * on_device and host > 0.4 * on_device, (left, host, on_device)


# -- an rpc-server beside the local device ------------------------------------------------

def test_an_rpc_server_beside_the_local_device_comes_first_and_both_hold_layers(
        cpu, rpc_lib, request):
    rpc = RpcServer(rpc_lib)
    request.addfinalizer(rpc.kill)
    rpc.start()
    with GpuServer(SMOL, "--rpc", rpc.endpoint, "-ngl", "all", "-ts", "1,1", ctx=1024) as s:
        props = s.get("/props")[2]
        names = [d["name"] for d in props["devices"]]
        assert names[0] == "CPU" and names[1].startswith("RPC") and names[2] == "Vulkan0", names
        assert props["devices"][0]["layers"] == 0
        assert all(d["layers"] > 0 for d in props["devices"][1:])
        assert props["devices"][1]["endpoint"] == rpc.endpoint
        compare_prompts(cpu, s, PROMPTS[:2], 8)


# -- out of device memory -----------------------------------------------------------------

def test_a_model_past_the_devices_memory_is_an_error_for_it_alone(tmp_path):
    folder = tmp_path / "shelf"
    folder.mkdir()
    for m in (SMOL, QWEN):
        (folder / m.name).symlink_to(m)
    # 160 MB: SmolLM2's weights (about 100 MB) fit; Qwen2.5-0.5B's (about 400 MB) do not
    with GpuServer(SMOL, "--models-dir", str(folder), "-ngl", "all",
                   env={"GGML_VK_FORCE_MAX_BUFFER_SIZE": str(160 * 10 ** 6)}, ctx=512) as s:
        status, _, body = s.post("/completion", {"model": QWEN.stem, "prompt": "Hi",
                                                 "n_predict": 2})
        assert status >= 500 and status != 502, (status, body)
        message = body["error"]["message"]
        assert "Vulkan0" in message and "-ngl" in message, message
        # the server and its other model go on
        assert s.get("/health")[0] == 200
        assert complete(s, "Hi", 2)["tokens_predicted"] == 2
        assert device(s.get("/props")[2], "Vulkan0")["layers"] == N_ALL
        # the same model fits with its layers on the CPU (-ngl 0 in the folder's preset
        # is a later step; here: the model named again still fails the same way)
        status, _, body = s.post("/completion", {"model": QWEN.stem, "prompt": "Hi",
                                                 "n_predict": 2})
        assert status >= 500 and "Vulkan0" in body["error"]["message"]
