"""LoRA adapters for the tiny plain model, written by gguf.py with chosen weights,
and the same model with an adapter merged in.

No registry ships an adapter, so the tests make them: a rank-2 pair for two
F32 weights of tinymodels.plain_model (an attention query and a feed-forward
down projection), seeded, large enough to change the greedy text.  The model
with an adapter at scale s must answer exactly as the model whose weights are
W + s B A (``merged``), written here from the same numbers: libllama adds
s * B (A x) to W x (llm_graph_context::build_lora_mm; with no alpha the scale
is s itself).

    adapter(d, seed)                  an adapter for plain_model
    merged(d, seed, scale)            plain_model with that adapter merged at scale
    wrong_shape(d), wrong_arch(d), embd_rank_mismatch(d)
                                      adapters for another model, which the
                                      server must refuse at load, saying why

Files are cached by recipe in the given directory, like tinymodels.
"""

import hashlib
import json
import os
import random
from pathlib import Path

try:
    from . import gguf, tinymodels
except ImportError:  # tests/ on sys.path
    import gguf
    import tinymodels

FORMAT_VERSION = 1
RANK = 2
# weight -> (n_in, n_out) in ggml order: blk.N.attn_q (n_embd, n_embd),
# ffn_down (n_ff, n_embd)
TARGETS = {"blk.0.attn_q.weight": (64, 64), "blk.1.ffn_down.weight": (128, 64)}


def _pairs(seed, targets=TARGETS, rank=RANK):
    rng = random.Random(seed)
    out = {}
    for name, (n_in, n_out) in sorted(targets.items()):
        a = [rng.uniform(-1.0, 1.0) for _ in range(rank * n_in)]
        b = [rng.uniform(-1.0, 1.0) for _ in range(n_out * rank)]
        out[name] = (a, b, n_in, n_out)
    return out


def _cached(directory, stem, recipe, make):
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ("%s-%s.gguf" % (stem, key))
    if not path.exists():
        tmp = path.with_name("%s.tmp-%d" % (path.name, os.getpid()))
        try:
            make(tmp)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
    return path


def _write_adapter(path, pairs, arch="llama", rank=RANK):
    w = gguf.adapter_writer(arch)
    for name, (a, b, n_in, n_out) in sorted(pairs.items()):
        gguf.add_lora_pair(w, name, a, b, n_in, n_out, rank)
    w.write(path)


def adapter(directory, seed=1):
    """An adapter for tinymodels.plain_model (rank 2, on TARGETS)."""
    recipe = {"v": FORMAT_VERSION, "seed": seed, "targets": TARGETS, "rank": RANK}
    return _cached(directory, "lora-%d" % seed, recipe,
                   lambda p: _write_adapter(p, _pairs(seed)))


def merged(directory, seed, scale):
    """plain_model with adapter(seed) merged in at ``scale``."""
    base = tinymodels.plain_model(directory)
    recipe = {"v": FORMAT_VERSION, "seed": seed, "targets": TARGETS, "rank": RANK,
              "scale": scale, "base": base.name}

    def make(path):
        f = gguf.read(base)
        new = {}
        for name, (a, b, n_in, n_out) in _pairs(seed).items():
            w = gguf.f32_values(f.tensor_bytes(f.tensor(name)))
            new[name] = gguf.f32_bytes(gguf.merged_weight(w, a, b, n_in, n_out, RANK, scale))
        gguf.rewrite(base, path, new)
    return _cached(directory, "merged-%d-%g" % (seed, scale), recipe, make)


def wrong_shape(directory):
    """An adapter of the right architecture whose pairs fit a model of another
    width (n_embd 32): libllama refuses it ("incorrect shape")."""
    targets = {"blk.0.attn_q.weight": (32, 32)}
    return _cached(directory, "lora-wrong-shape", {"v": FORMAT_VERSION, "t": targets},
                   lambda p: _write_adapter(p, _pairs(3, targets)))


def wrong_arch(directory):
    """The adapter of ``adapter`` labelled for another architecture (qwen2)."""
    return _cached(directory, "lora-wrong-arch", {"v": FORMAT_VERSION},
                   lambda p: _write_adapter(p, _pairs(1), arch="qwen2"))


def embd_rank_mismatch(directory):
    """A token_embd pair of ranks 2 (A) and 3 (B): it passes libllama's own shape
    checks and aborts the process at the first decode (ggml_mul_mat asserts),
    so offgrid must refuse it first."""
    n_vocab, n_embd = 49152, 64

    def make(path):
        w = gguf.adapter_writer("llama")
        w.add_tensor("token_embd.weight.lora_a", (2, n_vocab), gguf.TensorType.F32,
                     gguf.f32_bytes([0.01] * (2 * n_vocab)))
        w.add_tensor("token_embd.weight.lora_b", (3, n_embd), gguf.TensorType.F32,
                     gguf.f32_bytes([0.01] * (3 * n_embd)))
        w.write(path)
    return _cached(directory, "lora-embd-rank", {"v": FORMAT_VERSION}, make)


def for_model(model_path, out_path, seed=1, target="blk.0.attn_q.weight"):
    """A rank-2 adapter of small seeded weights on ``target`` of any model file
    (its architecture and that tensor's shape read from its header), written to
    ``out_path``: what the docs' example serves beside Qwen2.5-Coder."""
    from offgrid.engine.adapters import read_header
    meta, tensors = read_header(str(model_path))
    n_in, n_out = tensors[target][1][:2]
    rng = random.Random(seed)
    w = gguf.adapter_writer(meta["general.architecture"])
    gguf.add_lora_pair(w, target, [rng.uniform(-0.05, 0.05) for _ in range(RANK * n_in)],
                       [rng.uniform(-0.05, 0.05) for _ in range(n_out * RANK)], n_in, n_out,
                       RANK)
    w.write(out_path)
    return Path(out_path)
