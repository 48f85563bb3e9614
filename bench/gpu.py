"""Issue #51's figures on a GPU machine: offgrid, llama-server and llama-bench
with every layer on the GPU, on the same model files.

A session lent the device machine (an H100, 16 cores, no network) has 15
minutes of it, and what travels there is the working tree plus 64 MiB: no
model file fits, and a CUDA build there would eat the lease.  So the work is
split in two:

    here:   python3 bench/gpu.py kit                  -> build/gpukit.tar.xz
    there:  tar xJf build/gpukit.tar.xz -C /tmp
            python3 bench/gpu.py run --kit /tmp/gpukit --out "$OUT"

The kit (``kit``) holds libllama built with ggml-cuda for CUDA_ARCHS
(``scripts/build_lib.sh --tools``, PORTABLE=1: the device's CPU is not this
one); llama-server and llama-bench built in the same tree against the same
shared libraries, so the three differ above libllama alone; and each model's
skeleton: its GGUF header, metadata and tensor table without the data.  The
CUDA runtime and cuBLAS are the device's own (its image has CUDA 13's; the
kit carries neither: cuBLAS Lt alone is 540 MB).

The models are the bench's two (gemma-3-270m and Qwen2.5-Coder-0.5B, Q4_K_M)
and the largest that fits of two derived from the code model's skeleton
(``SHAPES``: the published shapes of Qwen2.5-72B and -32B, llama-quant's
Q4_K_M choice of types; the 0.5B's vocabulary of 151,936 tokens where they pad
to 152,064).  There, ``run`` writes each as a GGUF of exactly its tensor table
with random weights (random floats quantized by ggml itself, so every block is
valid): for a timing, each tensor's shape and type is what counts, not the
numbers.  A large one repeats a few quantized rows through each tensor, so
that writing it is a copy (the 32B's 19.8 GB: 69 s on the 2-core VM's disk).

Then for each model: llama-bench pp512/tg128 (``-ngl 99``), and offgrid
(``-ngl all``) and llama-server (``-ngl all``) alternating, each measured as
``make bench`` measures (bench/scenarios.py): generation of 128 tokens and a
512-token prompt, the servers' own timings.  For the small models offgrid's
greedy text with every layer on the GPU is compared with its text on the CPU
(``-dev none``) as tests/test_gpu.py compares lavapipe's: the same tokens up
to the first where they part, which must be a near-tie of the CPU's.
Everything lands in ``$OUT`` (gpu.json, gpu.md, gpu.log) after each step, so a
run cut short by the lease still returns what it measured.
"""

import argparse
import ctypes
import glob
import hashlib
import json
import os
import random
import re
import shutil
import statistics
import struct
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
import gguf  # noqa: E402  (tests/gguf.py: standard library only)
import scenarios  # noqa: E402
import servers  # noqa: E402
from run import git_revision, llama_bench, machine, source_hash  # noqa: E402

BENCH_MODELS = {
    "qwen2.5-coder-0.5b-q4_k_m": ROOT / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "gemma-3-270m-q4_k_m": ROOT / "models" / "gemma-3-270m-q4_k_m.gguf",
}
# name -> (skeleton it is derived from, hyperparameters): each model's
# config.json (hidden_size, num_hidden_layers, num_attention_heads,
# num_key_value_heads, intermediate_size); untied output as in those models
# (Qwen2.5-72B's ffn_down rows are 29,568 wide, no whole number of Q4_K's
# blocks: derive() falls back as llama-quant does).  Largest first: by default
# ``run`` measures the first that fits the GPU, the disk and the time left.
SHAPES = {
    "qwen2.5-72b-shape-q4_k_m": ("qwen2.5-coder-0.5b-q4_k_m",
                                 dict(n_embd=8192, n_layer=80, n_head=64, n_head_kv=8,
                                      n_ff=29568)),
    "qwen2.5-32b-shape-q4_k_m": ("qwen2.5-coder-0.5b-q4_k_m",
                                 dict(n_embd=5120, n_layer=64, n_head=40, n_head_kv=8,
                                      n_ff=27648)),
}
CUDA_ARCHS = "90-real"          # the H100's and H200's
KIT = ROOT / "build" / "gpukit"
KIT_LIMIT = 56 << 20            # the device tool carries 64 MiB, the working tree included
CUDA_LIBS = ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13")

# ggml_type ids (ggml.h)
F32, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 0, 6, 7, 8, 12, 13, 14
QK_K = 256
GEN_TOKENS, PROMPT_TOKENS = 128, 512     # llama-bench's tg128 and pp512 (bench/run.py)
SCALE = 0.05                    # the random weights: uniform, this standard deviation
# a model is measured where this much of the GPU's memory, and a fiftieth of
# its size, are left beside its weights and KV cache (compute buffers, the
# server's own CUDA context; llama-server's --fit leaves 1 GiB), and where
# a minute and this many seconds a GB of it are left of the budget (a guess for
# the 72B's 47 GB: written in ~50 s, loaded five times at ~5 GB/s, 128 tokens
# generated some 25 times at ~40 tok/s; a run cut short keeps its finished
# rounds)
DEVICE_MARGIN = 1 << 30
SECONDS_PER_GB = 4
TILED_ABOVE = 2_000_000_000     # elements: a larger model repeats a few rows per tensor
TILE_ROWS = 61                  # quantized rows repeated: the rest of the file is copies
NO_CEILING = ["--worker-max-rss", "0"]     # offgrid's flags for no worker memory ceiling
NEAR_TIE = 0.5                  # nats, as tests/test_gpu.py
LOGPROB_TOL = 0.4


def log(msg):
    line = "[gpu %s] %s" % (time.strftime("%H:%M:%S"), msg)
    print(line, flush=True)
    if LOG_FILE[0] is not None:
        LOG_FILE[0].write(line + "\n")
        LOG_FILE[0].flush()


LOG_FILE = [None]


# -- GGUF skeletons --------------------------------------------------------------

def skeleton(model, dest):
    """Copy ``model``'s header, metadata and tensor table (everything before the
    data section) to ``dest``."""
    info = gguf.read(model)
    with open(model, "rb") as src, open(dest, "wb") as out:
        out.write(src.read(info.data_offset))


class Ggml:
    """The ggml-base calls a model's data needs: sizes and quantization."""

    def __init__(self, lib_dir):
        base = ctypes.CDLL(str(Path(lib_dir) / "libggml-base.so"))
        base.ggml_row_size.restype = ctypes.c_size_t
        base.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
        base.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
        base.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
        base.ggml_quantize_chunk.restype = ctypes.c_size_t
        base.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                             ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                             ctypes.c_void_p]
        self.base = base

    def nbytes(self, t):
        rows = t.n_elements // t.shape[0]
        return rows * self.base.ggml_row_size(t.type, t.shape[0])

    def quantize(self, ggml_type, floats, n_per_row, threads):
        """``floats`` (f32 bytes, whole rows of n_per_row) as ``ggml_type``, its
        rows split among ``threads`` (ggml_quantize_chunk releases the GIL)."""
        if self.base.ggml_quantize_requires_imatrix(ggml_type):
            raise ValueError("ggml type %d needs an importance matrix" % ggml_type)
        nrows = len(floats) // 4 // n_per_row
        row = self.base.ggml_row_size(ggml_type, n_per_row)
        src = ctypes.create_string_buffer(floats, len(floats))
        dst = ctypes.create_string_buffer(nrows * row)
        step = max(1, -(-nrows // threads))

        def part(first):
            n = min(step, nrows - first)
            self.base.ggml_quantize_chunk(ggml_type, src, dst, first * n_per_row, n,
                                          n_per_row, None)
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(part, range(0, nrows, step)))
        return dst.raw


def derive(skel, shape):
    """The metadata and tensor table of a larger sibling of skeleton ``skel``
    (a llama-like dense model: qwen2, llama), with ``shape``'s hyperparameters:
    each tensor of layer 0 repeated for every layer, every dimension mapped
    from the skeleton's value to the shape's, and the types llama-quant gives
    a Q4_K_M file (src/llama-quant.cpp of the pinned source: attn_v and
    ffn_down Q6_K in the layers its use_more_bits picks, the output Q6_K, and
    so the token embeddings where the output is theirs, every other matrix
    Q4_K, vectors F32; a "70B" model's other attn_v Q5_K; a matrix whose rows
    are no whole number of 256-wide blocks the 32-wide type its fallback
    names)."""
    f = gguf.read(skel)
    arch = f.metadata["general.architecture"].value
    m = {k: v for k, v in f.metadata.items()}

    def hp(key):
        return m["%s.%s" % (arch, key)].value
    head_dim = hp("embedding_length") // hp("attention.head_count")
    new_head_dim = shape["n_embd"] // shape["n_head"]
    vocab = len(m["tokenizer.ggml.tokens"].value)
    dims = {hp("embedding_length"): shape["n_embd"],
            hp("feed_forward_length"): shape["n_ff"],
            hp("attention.head_count_kv") * head_dim: shape["n_head_kv"] * new_head_dim,
            vocab: vocab}
    if len(dims) != 4:
        raise ValueError("%s: two of its dimensions are equal; cannot tell them apart" % skel)
    for key, value in (("embedding_length", shape["n_embd"]), ("block_count", shape["n_layer"]),
                       ("feed_forward_length", shape["n_ff"]),
                       ("attention.head_count", shape["n_head"]),
                       ("attention.head_count_kv", shape["n_head_kv"])):
        m["%s.%s" % (arch, key)] = gguf.uint32(value)
    for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        if "%s.%s" % (arch, key) in m:
            m["%s.%s" % (arch, key)] = gguf.uint32(new_head_dim)
    m["general.name"] = gguf.string("offgrid bench: random weights, %d x %d, %d layers"
                                    % (shape["n_embd"], shape["n_ff"], shape["n_layer"]))
    m["general.file_type"] = gguf.uint32(15)        # LLAMA_FTYPE_MOSTLY_Q4_K_M
    n = shape["n_layer"]
    tied = not any(t.name == "output.weight" for t in f.tensors)

    def more_bits(i):
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

    # llama-model's type table: 80 layers of grouped-query attention is its "70B"
    # (models/qwen2.cpp, models/llama.cpp), whose attn_v llama-quant gives Q5_K
    seventy_b = n == 80 and shape["n_head_kv"] < shape["n_head"]

    def ttype(name, shape_new, layer):
        if len(shape_new) == 1:
            return F32
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            t = Q6_K
        elif name.endswith(("attn_v.weight", "ffn_down.weight")) and more_bits(layer):
            t = Q6_K
        elif name.endswith("attn_v.weight") and seventy_b:
            t = Q5_K
        else:
            t = Q4_K
        # tensor_type_fallback: rows that are no whole number of 256-wide blocks
        # (Qwen2.5-72B's ffn_down, 29,568 wide) take a 32-wide type
        if shape_new[0] % QK_K:
            t = {Q4_K: Q5_0, Q5_K: Q5_1, Q6_K: Q8_0}[t]
            if shape_new[0] % 32:
                raise ValueError("%s: %d wide, no quantized type fits" % (name, shape_new[0]))
        return t

    # layer by layer, as a converted file lays them out, where the skeleton's
    # layer 0 stood among the other tensors
    tensors, layer0, at = [], [], None
    for t in f.tensors:
        if t.name.startswith("blk.") and not t.name.startswith("blk.0."):
            continue
        try:
            shape_new = tuple(dims[d] for d in t.shape)
        except KeyError:
            raise ValueError("%s: dimension of %s not among %s" % (skel, t.name, sorted(dims)))
        if t.name.startswith("blk.0."):
            at = len(tensors) if at is None else at
            layer0.append((t.name[len("blk.0."):], shape_new))
        else:
            tensors.append((t.name, shape_new, ttype(t.name, shape_new, 0)))
    blocks = [("blk.%d.%s" % (i, rest), shape_new, ttype(rest, shape_new, i))
              for i in range(n) for rest, shape_new in layer0]
    return m, tensors[:at] + blocks + tensors[at:]


def write_skeleton(dest, metadata, tensors, ggml):
    """A GGUF header, metadata and tensor table for ``tensors`` (name, shape,
    type), offsets laid out as a full file's, and no data."""
    align = gguf.DEFAULT_ALIGNMENT
    with open(dest, "wb") as out:
        out.write(gguf.MAGIC)
        out.write(struct.pack("<IQQ", gguf.VERSION, len(tensors), len(metadata)))
        for key, value in metadata.items():
            out.write(gguf._pack_kv(key, value))
        offset = 0
        for name, shape, ttype in tensors:
            out.write(gguf._pack_string(name))
            out.write(struct.pack("<I%dQ" % len(shape), len(shape), *shape))
            out.write(struct.pack("<IQ", ttype, offset))
            info = gguf.TensorInfo(name, shape, ttype, 0)
            offset += gguf.pad(ggml.nbytes(info), align)
        out.write(b"\0" * (gguf.pad(out.tell(), align) - out.tell()))


class Weights:
    """Random data for any tensor of a skeleton: norms 1, everything else
    uniform with standard deviation SCALE, quantized to the tensor's type."""

    POOL = 1000003      # floats, prime: tiled from a per-tensor offset

    def __init__(self, ggml, threads, seed=51):
        rng = random.Random(seed)
        a = SCALE * 3 ** 0.5
        self.pool = struct.pack("<%df" % self.POOL,
                                *[a * (2 * rng.random() - 1) for _ in range(self.POOL)])
        self.ggml, self.threads = ggml, threads

    def floats(self, name, n):
        off = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % self.POOL
        reps = (off + n) // self.POOL + 1
        if reps == 1:
            return self.pool[4 * off:4 * (off + n)]
        return (self.pool * reps)[4 * off:4 * (off + n)]

    def write(self, out, t, tiled):
        """Write tensor ``t``'s data to ``out``; ``tiled``: TILE_ROWS quantized
        rows repeated through it."""
        ne0 = t.shape[0]
        rows = t.n_elements // ne0
        if len(t.shape) == 1 and "norm" in t.name:
            data = struct.pack("<f", 1.0) * ne0
            if t.type != F32:
                data = self.ggml.quantize(t.type, data, ne0, 1)
            out.write(data)
            return
        if not tiled or rows <= TILE_ROWS:
            out.write(self.ggml.quantize(t.type, self.floats(t.name, t.n_elements), ne0,
                                         self.threads))
            return
        block = self.ggml.quantize(t.type, self.floats(t.name, TILE_ROWS * ne0), ne0,
                                   self.threads)
        left = rows * (len(block) // TILE_ROWS)
        # whole blocks, up to 64 MiB at a time
        chunk = block * max(1, min(-(-left // len(block)), (64 << 20) // len(block)))
        while left:
            piece = chunk[:left]
            out.write(piece)
            left -= len(piece)


def inflate(skel, dest, ggml, threads):
    """A model file with ``skel``'s header and tensor table and random data."""
    f = gguf.read(skel)
    total = sum(t.n_elements for t in f.tensors)
    tiled = total > TILED_ABOVE
    weights = Weights(ggml, threads)
    tmp = Path(str(dest) + ".tmp")
    with open(skel, "rb") as src, open(tmp, "wb") as out:
        out.write(src.read(f.data_offset))
        for t in sorted(f.tensors, key=lambda t: t.offset):
            out.seek(f.data_offset + t.offset)
            weights.write(out, t, tiled)
            if out.tell() != f.data_offset + t.offset + ggml.nbytes(t):
                raise RuntimeError("%s: wrote %d bytes of %s, want %d"
                                   % (dest, out.tell() - f.data_offset - t.offset, t.name,
                                      ggml.nbytes(t)))
    os.replace(tmp, dest)
    return {"parameters": total, "bytes": Path(dest).stat().st_size, "tiled": tiled}


# -- the kit (here) --------------------------------------------------------------

def make_kit(args):
    env = dict(os.environ, GPU=args.gpu, PORTABLE="1" if args.portable else "0")
    if args.gpu == "cuda":
        env["CUDA_ARCHS"] = args.cuda_archs
    if KIT.exists():
        shutil.rmtree(KIT)
    lib = KIT / "lib"
    log("libllama, llama-server and llama-bench (scripts/build_lib.sh --tools; a first "
        "CUDA build takes most of an hour on 2 cores)")
    subprocess.run(["bash", "scripts/build_lib.sh", "--tools", str(lib)], cwd=str(ROOT),
                   env=env, check=True)
    for name in CUDA_LIBS:          # the device's own
        for p in lib.glob(name + "*"):
            p.unlink()
    ggml = Ggml(lib)
    (KIT / "models").mkdir()
    for name, path in BENCH_MODELS.items():
        if not path.exists():       # as `make model` fetches it, sha256-checked
            subprocess.run([sys.executable, "scripts/fetch_model.py",
                            str(path.relative_to(ROOT))], cwd=str(ROOT), check=True)
        skeleton(path, KIT / "models" / (name + ".skel.gguf"))
    for name, (base, shape) in SHAPES.items():
        meta, tensors = derive(KIT / "models" / (base + ".skel.gguf"), shape)
        write_skeleton(KIT / "models" / (name + ".skel.gguf"), meta, tensors, ggml)
    manifest = {"revision": git_revision(), "offgrid_source": source_hash(), "gpu": args.gpu,
                "portable": args.portable,
                "cuda_archs": args.cuda_archs if args.gpu == "cuda" else None,
                "made": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    (KIT / "kit.json").write_text(json.dumps(manifest, indent=1))
    tarball = KIT.with_suffix(".tar.xz")
    subprocess.run(["tar", "-cf", str(tarball), "-I", "xz -T0 -6", "-C", str(KIT.parent),
                    KIT.name], check=True)
    size = tarball.stat().st_size
    log("%s: %.1f MiB" % (tarball.relative_to(ROOT), size / (1 << 20)))
    if size > KIT_LIMIT:
        raise SystemExit("the kit is over %d MiB: it would not travel with the tree"
                         % (KIT_LIMIT >> 20))


# -- the run (there) -------------------------------------------------------------

def cuda_library_path():
    """Folders holding the CUDA runtime and cuBLAS on this machine: those on
    LD_LIBRARY_PATH, ldconfig's, then CUDA's usual places and the NVIDIA wheels
    of any Python here."""
    found = {}
    for folder in os.environ.get("LD_LIBRARY_PATH", "").split(":"):
        for name in CUDA_LIBS:
            if folder and name not in found and (Path(folder) / name).exists():
                found[name] = folder
    try:
        for line in subprocess.check_output(["ldconfig", "-p"], text=True).splitlines():
            name, _, path = line.strip().partition(" => ")
            name = name.split(" ")[0]
            if name in CUDA_LIBS:
                found.setdefault(name, str(Path(path).parent))
    except (OSError, subprocess.CalledProcessError):
        pass
    patterns = ["/usr/local/cuda*/lib64", "/usr/local/cuda*/targets/*/lib",
                "/usr/lib/x86_64-linux-gnu", "/opt/*/.venv/lib/python3*/site-packages/nvidia/*/lib",
                "/usr/local/lib/python3*/dist-packages/nvidia/*/lib",
                "/usr/lib/python3/dist-packages/nvidia/*/lib"]
    for pattern in patterns:
        for folder in sorted(glob.glob(pattern)):
            for name in CUDA_LIBS:
                if name not in found and (Path(folder) / name).exists():
                    found[name] = folder
    missing = [n for n in CUDA_LIBS if n not in found]
    if missing:
        raise SystemExit("this machine has no %s (searched ldconfig and %s)"
                         % (", ".join(missing), ", ".join(patterns)))
    return list(dict.fromkeys(found[n] for n in CUDA_LIBS))


def facts(kit_lib):
    out = {"machine": dict(machine(), date=time.strftime("%Y-%m-%d %H:%M %Z"),
                           load=round(os.getloadavg()[0], 2))}
    try:
        out["nvidia_smi"] = subprocess.check_output(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
             "--format=csv,noheader"], text=True, timeout=30).strip()
    except (OSError, subprocess.SubprocessError) as e:
        out["nvidia_smi"] = "unavailable: %s" % e
    listed = subprocess.run(
        [sys.executable, "-m", "offgrid", "--lib", str(kit_lib), "--list-devices"],
        cwd=str(ROOT), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    out["devices"] = listed.stdout.strip()
    return out


def load_line(server):
    return next((ln for ln in server.log_text().splitlines() if "offgrid: loaded" in ln), "")


def measure(server, reps):
    scenarios.warm_up(server.port)
    g = scenarios.generation(server.port, reps, n_predict=GEN_TOKENS)
    p = scenarios.prompt(server.port, reps, n_tokens=PROMPT_TOKENS)
    return {"generation": g["server_tps"], "generation_client": g["client_tps"],
            "prompt": p["server_tps"], "prompt_client": p["client_tps"]}


def greedy_check(model, threads, offgrid_flags):
    """offgrid's greedy text with every layer on the GPU against its text on the
    CPU (tests/test_gpu.py's rule): per prompt, the tokens that were the same,
    and where they parted whether the CPU had it as a near-tie."""
    prompts = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time"]

    def texts(flags):
        cfg = servers.Config(str(model), threads=threads, extra=tuple(offgrid_flags) + flags)
        with servers.offgrid(cfg) as s:
            return [servers.post(s.port, "/completion", {
                "prompt": p, "n_predict": 32, "temperature": 0, "n_probs": 2,
                "cache_prompt": False})[0]["completion_probabilities"] for p in prompts]
    cpu, gpu = texts(("-dev", "none")), texts(("-ngl", "all"))
    out = []
    for a, b in zip(cpu, gpu):
        same, parted = 0, None
        for pa, pb in zip(a, b):
            if pa["id"] != pb["id"]:
                top = pa["top_logprobs"]
                parted = {"near_tie": len(top) > 1 and pb["id"] == top[1]["id"]
                          and top[0]["logprob"] - top[1]["logprob"] < NEAR_TIE,
                          "gap": top[0]["logprob"] - top[1]["logprob"] if len(top) > 1 else None}
                break
            if abs(pa["logprob"] - pb["logprob"]) >= LOGPROB_TOL:
                parted = {"logprob_off": pb["logprob"] - pa["logprob"]}
                break
            same += 1
        out.append({"same": same, "of": len(a), "parted": parted})
    return out


def run(args):
    t0 = time.monotonic()
    kit = Path(args.kit).resolve()
    kit_lib = kit / "lib"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    LOG_FILE[0] = open(out_dir / "gpu.log", "a")
    if (kit_lib / "libggml-cuda.so").exists():
        paths = cuda_library_path()
        os.environ["LD_LIBRARY_PATH"] = ":".join(
            paths + [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p])
        log("CUDA runtime and cuBLAS from %s" % ", ".join(paths))
    threads = args.threads or max(1, (os.cpu_count() or 2) // 2)
    result = {"kit": json.loads((kit / "kit.json").read_text()), "threads": threads,
              "offgrid_source": source_hash(),
              "facts": facts(kit_lib), "models": {}}
    log("devices:\n%s" % result["facts"]["devices"])
    log("nvidia-smi: %s" % result["facts"]["nvidia_smi"])
    save(out_dir, result)
    # a kit whose GPU is not there would measure the CPU: stop instead
    device = {"cuda": "CUDA0", "vulkan": "Vulkan0"}[result["kit"]["gpu"]]
    if "  %s:" % device not in result["facts"]["devices"]:
        raise SystemExit("offgrid --list-devices names no %s with this kit:\n%s"
                         % (device, result["facts"]["devices"]))
    ggml = Ggml(kit_lib)
    # offgrid's flags beyond -ngl: its worker's default memory ceiling
    # (RLIMIT_DATA) has never met NVIDIA's driver; if offgrid cannot start
    # under it, the run says so and goes on without one
    offgrid_flags = ["--lib", str(kit_lib)]
    names = args.models or list(BENCH_MODELS) + list(SHAPES)
    sizes = {n: model_size(kit / "models" / (n + ".skel.gguf"), ggml) for n in names}
    work = Path(args.work) if args.work else work_folder(max(b for b, _ in sizes.values()))
    work.mkdir(parents=True, exist_ok=True)
    log("models written in %s (%.0f GB free)" % (work, shutil.disk_usage(str(work)).free / 1e9))
    device_free = free_mib(result["facts"]["devices"], device) << 20
    large_done = False
    for name in names:
        left = args.budget - (time.monotonic() - t0)
        if name in SHAPES and large_done and not args.models:
            why = "a larger shape was measured"
        else:
            why = room_for(*sizes[name], device_free, shutil.disk_usage(str(work)).free, left)
        if why:
            log("%s: skipped: %s" % (name, why))
            result["models"][name] = {"skipped": why}
            save(out_dir, result)
            continue
        r = result["models"][name] = {}
        path = work / (name + ".gguf")
        try:
            measure_model(name, path, kit, ggml, device, threads, offgrid_flags, args, r,
                          lambda: save(out_dir, result))
            large_done = large_done or name in SHAPES
        except Exception as e:      # the next model may still run: say what broke
            r["error"] = traceback.format_exc()[-4000:]
            log("%s: %s: %s" % (name, type(e).__name__, e))
        finally:
            save(out_dir, result)
            if path.exists():
                path.unlink()
    log("done in %.0f s" % (time.monotonic() - t0))


def free_mib(listing, device):
    """The free memory --list-devices gives ``device``'s kind of GPU, all of them
    together ("  CUDA0: NVIDIA H100 80GB HBM3 (81079 MiB, 80521 MiB free)")."""
    kind = device.rstrip("0123456789")
    return sum(int(m.group(1)) for m in re.finditer(
        r"^  %s\d+: .*, (\d+) MiB free\)$" % kind, listing, re.M))


def model_size(skel, ggml):
    """(bytes of the file written from ``skel``, bytes of its KV cache for the
    bench's 4096 tokens in F16)."""
    f = gguf.read(skel)
    size = f.data_offset + sum(gguf.pad(ggml.nbytes(t), gguf.DEFAULT_ALIGNMENT)
                               for t in f.tensors)
    arch = f.metadata["general.architecture"].value

    def hp(key):
        return f.metadata["%s.%s" % (arch, key)].value
    kv = (2 * 2 * 4096 * hp("block_count") * hp("attention.head_count_kv")
          * hp("embedding_length") // hp("attention.head_count"))
    return size, kv


def room_for(size, kv, device_free, disk_free, seconds_left):
    """Why a model of ``size`` bytes and ``kv`` bytes of KV cache cannot be
    measured here, or None: with DEVICE_MARGIN and a fiftieth of the size they
    must fit the GPU's free memory, the file the disk, and SECONDS_PER_GB of it
    what is left of the budget."""
    need_s = 60 + SECONDS_PER_GB * size / 1e9
    if size + kv + DEVICE_MARGIN + size // 50 > device_free:
        return "%.1f GiB of weights and KV cache, %.1f GiB free on the GPU" % (
            (size + kv) / (1 << 30), device_free / (1 << 30))
    if size + (1 << 30) > disk_free:
        return "a %.1f GB file, %.1f GB free where models are written" % (
            size / 1e9, disk_free / 1e9)
    if need_s > seconds_left:
        return "%.0f s left of the budget, wants %.0f" % (seconds_left, need_s)
    return None


def work_folder(largest):
    """Where the models are written: /dev/shm where it holds the ``largest``
    file with 8 GB to spare (memory: a 47 GB file is written at memory speed,
    not a disk's), else gpu-models in the roomiest of /tmp, build/, /var/tmp
    and ~ (a machine's /tmp may be a small tmpfs)."""
    try:
        if shutil.disk_usage("/dev/shm").free > largest + 8e9:
            return Path("/dev/shm/gpu-models")
    except OSError:
        pass
    return roomiest(["/tmp", str(ROOT / "build"), "/var/tmp", os.path.expanduser("~")])


def roomiest(folders):
    """A folder for the models under the one of ``folders`` with the most free space."""
    free = {}
    for f in folders:
        try:
            free[f] = shutil.disk_usage(f).free
        except OSError:
            continue
    return Path(max(free, key=free.get)) / "gpu-models"


def measure_model(name, path, kit, ggml, device, threads, offgrid_flags, args, r, checkpoint):
    """One model: write it, llama-bench, both servers alternating, the greedy check."""
    kit_lib = kit / "lib"
    t = time.monotonic()
    r["file"] = inflate(kit / "models" / (name + ".skel.gguf"), path, ggml, os.cpu_count() or 2)
    r["file"]["write_s"] = round(time.monotonic() - t, 1)
    log("%s: %.2f GB, %.1f B parameters, written in %.1f s" % (
        name, r["file"]["bytes"] / 1e9, r["file"]["parameters"] / 1e9, r["file"]["write_s"]))
    lb = llama_bench(kit_lib, path, threads, args.reps, ["-ngl", "99"])
    r["llama_bench"] = {"prompt": lb["pp%d" % PROMPT_TOKENS]["tok_s"],
                        "generation": lb["tg%d" % GEN_TOKENS]["tok_s"], "runs": lb}
    log("%s: llama-bench %s" % (name, r["llama_bench"]))
    checkpoint()
    samples = r["samples"] = {"offgrid": {}, "llama_server": {}}
    for rnd in range(args.rounds):
        for server in ["offgrid", "llama_server"][::1 if rnd % 2 == 0 else -1]:
            got = measure_server(server, path, threads, kit_lib, offgrid_flags, args, r)
            if server == "offgrid" and "%s (" % device not in r["load_line"]:
                raise SystemExit("offgrid put no layer on %s: %s" % (device, r["load_line"]))
            for k, v in got.items():
                samples[server].setdefault(k, []).extend(v)
            log("%s round %d %s: generation %s, prompt %s" % (
                name, rnd + 1, server, ["%.0f" % x for x in got["generation"]],
                ["%.0f" % x for x in got["prompt"]]))
        r["figures"] = figures(r)
        checkpoint()
    if name in BENCH_MODELS:
        r["greedy_vs_cpu"] = greedy_check(path, threads, offgrid_flags)
        log("%s: greedy on the GPU against the CPU: %s" % (name, r["greedy_vs_cpu"]))


def measure_server(server, path, threads, kit_lib, offgrid_flags, args, r):
    """One server's samples (measure()), and its peak RSS, front and worker
    together, in r["peak_rss_mib"].  An offgrid whose worker is killed at its
    memory ceiling (its default, never yet met on an NVIDIA GPU) is measured
    again without one (--worker-max-rss 0, from then on), the kill recorded."""
    srv = start_server(server, path, threads, kit_lib, offgrid_flags, r)
    try:
        got = measure(srv, args.reps)
        if server == "offgrid":
            r["load_line"] = load_line(srv)
        r.setdefault("peak_rss_mib", {}).setdefault(server, []).append(round(srv.peak_rss_mb()))
        return got
    except Exception as e:
        kill = next((ln for ln in srv.log_text().splitlines() if "over --worker-max-rss" in ln),
                    None)
        if server != "offgrid" or kill is None or offgrid_flags[-2:] == NO_CEILING:
            raise
        r["offgrid_ceiling_kill"] = kill
        log("offgrid's worker was killed at its memory ceiling (%s: %s); again with "
            "--worker-max-rss 0:\n%s" % (type(e).__name__, e, kill))
        offgrid_flags += NO_CEILING
    finally:
        srv.__exit__(None, None, None)
    return measure_server(server, path, threads, kit_lib, offgrid_flags, args, r)


def start_server(server, path, threads, kit_lib, offgrid_flags, r):
    """A started offgrid (``offgrid_flags``, -ngl all) or llama-server (-ngl all);
    offgrid that exits while starting is started once more without its memory
    ceiling (--worker-max-rss 0), which then holds for the rest of the run."""
    if server == "llama_server":
        cfg = servers.Config(str(path), threads=threads, extra=("-ngl", "all"))
        return servers.llama_server(cfg, {"llama_server": kit_lib}).start()
    cfg = servers.Config(str(path), threads=threads, extra=tuple(offgrid_flags) + ("-ngl", "all"))
    try:
        return servers.offgrid(cfg).start()
    except RuntimeError as e:
        if offgrid_flags[-2:] == NO_CEILING:
            raise
        r["offgrid_failed_start"] = str(e)[-4000:]
        log("offgrid did not start; again with --worker-max-rss 0:\n%s" % e)
        offgrid_flags += NO_CEILING
        return start_server(server, path, threads, kit_lib, offgrid_flags, r)


def figures(r):
    med = {srv: {k: statistics.median(v) for k, v in s.items() if v}
           for srv, s in r["samples"].items()}
    fig = {}
    for what in ("prompt", "generation"):
        og, ls = med["offgrid"].get(what), med["llama_server"].get(what)
        lb = r["llama_bench"].get(what)
        fig[what] = {"offgrid": og, "llama_server": ls, "llama_bench": lb,
                     "vs_llama_server": og / ls if og and ls else None,
                     "vs_llama_bench": og / lb if og and lb else None}
    return fig


def markdown(result):
    f = result["facts"]
    lines = ["- Device: %s; host %s, %s cores; threads %s; kit %s (%s, CUDA_ARCHS %s); %s"
             % (f.get("nvidia_smi"), f["machine"]["cpu"], f["machine"]["nproc"],
                result["threads"], result["kit"].get("revision"), result["kit"].get("gpu"),
                result["kit"].get("cuda_archs"), f["machine"]["date"]),
             "",
             "| model | what | llama-bench | llama-server | offgrid | offgrid / llama-server "
             "| offgrid / llama-bench |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in result["models"].items():
        if "figures" not in r:
            why = r.get("skipped") or ("error: %s" % r["error"].strip().splitlines()[-1]
                                       if r.get("error") else "not finished")
            lines.append("| %s | %s | | | | | |" % (name, why.replace("|", "/")))
            continue
        for what, label in (("prompt", "pp%d tok/s" % PROMPT_TOKENS),
                            ("generation", "tg%d tok/s" % GEN_TOKENS)):
            x = r["figures"][what]
            lines.append("| %s | %s | %s | %s | %s | %s | %s |" % (
                name, label, _num(x["llama_bench"]), _num(x["llama_server"]),
                _num(x["offgrid"]), _num(x["vs_llama_server"], 2),
                _num(x["vs_llama_bench"], 2)))
    notes = []
    for name, r in result["models"].items():
        if r.get("offgrid_failed_start"):
            notes.append("- %s: offgrid did not start with its default memory ceiling; "
                         "measured with --worker-max-rss 0 (gpu.json has its log)" % name)
        if r.get("offgrid_ceiling_kill"):
            notes.append("- %s: offgrid's worker was killed at its default memory ceiling "
                         "(`%s`); measured again with --worker-max-rss 0"
                         % (name, r["offgrid_ceiling_kill"].strip()))
        if r.get("load_line"):
            notes.append("- %s: `%s`" % (name, r["load_line"]))
        if r.get("peak_rss_mib"):
            notes.append("- %s: peak RSS, MiB (front and worker together for offgrid): %s"
                         % (name, "; ".join("%s %s" % (k, ", ".join(map(str, v)))
                                            for k, v in sorted(r["peak_rss_mib"].items()))))
        if r.get("greedy_vs_cpu"):
            notes.append("- %s, greedy text with every layer on the GPU against the CPU's "
                         "(tokens the same, of 32, per prompt): %s" % (name, ", ".join(
                             "%d%s" % (g["same"], _parted(g["parted"]))
                             for g in r["greedy_vs_cpu"])))
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def _parted(parted):
    if not parted:
        return ""
    if "logprob_off" in parted:
        return " (then a log-probability %.2f nats off)" % parted["logprob_off"]
    return " (then a near-tie, %.2f nats)" % parted["gap"] if parted["near_tie"] \
        else " (then NOT a near-tie: %s)" % (parted["gap"],)


def _num(x, digits=None):
    if x is None:
        return ""
    if digits is None:
        digits = 0 if x >= 100 else 1
    return "%.*f" % (digits, x)


def save(out_dir, result):
    (out_dir / "gpu.json").write_text(json.dumps(result, indent=1))
    (out_dir / "gpu.md").write_text(markdown(result))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kit", help="build build/gpukit.tar.xz here")
    k.add_argument("--gpu", default="cuda", choices=("cuda", "vulkan"))
    k.add_argument("--cuda-archs", default=CUDA_ARCHS)
    k.add_argument("--native", dest="portable", action="store_false",
                   help="this CPU's build, not the portable one (a kit for this machine)")
    r = sub.add_parser("run", help="measure on this machine's GPU with a kit")
    r.add_argument("--kit", required=True, help="the unpacked kit (gpukit/)")
    r.add_argument("--out", required=True, help="folder for gpu.json, gpu.md, gpu.log")
    r.add_argument("--work", help="where the models are written (default: /dev/shm where it "
                   "has room, else gpu-models in the roomiest of /tmp, build/, /var/tmp and ~)")
    r.add_argument("--models", type=lambda s: s.split(","),
                   help="comma-separated, of: %s" % ", ".join(list(BENCH_MODELS) + list(SHAPES)))
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--reps", type=int, default=5)
    r.add_argument("--threads", type=int, default=None)
    r.add_argument("--budget", type=float, default=500,
                   help="seconds; a model that would not finish in what is left is skipped")
    args = p.parse_args(argv)
    if args.cmd == "run" and args.models:
        for m in args.models:
            if m not in BENCH_MODELS and m not in SHAPES:
                p.error("unknown model %r" % m)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.cmd == "kit":
        make_kit(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
