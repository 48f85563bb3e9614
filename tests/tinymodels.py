"""Tiny random-weight models that the real libllama loads and runs.

Tests need a model to talk to, but a real one is large and slow.  These are
llama-architecture models (2 layers, n_embd 64, 6.4M parameters, nearly all in
the two vocab-sized matrices; a 14.6 MB file) with random, seeded weights,
wrapped around the StarCoder tokenizer (49152 tokens) that llama.cpp ships as
models/ggml-vocab-starcoder.gguf.  Their output is gibberish, but it is real
text from a real tokenizer, greedy decoding is deterministic, and the FIM
special tokens are exactly what a test asks for.

What a test can count on when generating: control tokens (EOS, the FIM
tokens, ...) are never the greedy choice, so a generation runs to its token
limit rather than stopping on its own; and the continuation depends on the
whole prompt, not only on its last token.  Pieces can be partial UTF-8, as
with any byte-level BPE vocabulary.

    fim_model(d)                      all six FIM tokens (pre/suf/mid/pad/rep/sep)
    fim_model(d, repo_tokens=False)   pre/suf/mid/pad, but no repo or file-sep token
    plain_model(d)                    no FIM tokens at all

Each call returns the path of a .gguf file in the given directory, building it
only if a file for the same content key is not already there.  The key covers
the model's parameters, this module's format version and the vocab file's
bytes, so a changed recipe never returns a stale file.  Files are written to a
temporary name and renamed, so parallel test workers can share a directory.

How llama.cpp finds FIM tokens (src/llama-vocab.cpp, llama_vocab::impl::load):
explicit `tokenizer.ggml.fim_*_token_id` keys first, then by token text.  The
text match knows `<fim_prefix>`, `<fim_suffix>`, `<fim_middle>` and `<fim_pad>`
but not StarCoder's `<repo_name>` and `<file_sep>` (only `<|repo_name|>` and
`<|file_sep|>`), so the repo and file-sep tokens exist for libllama only when
the keys say so.  The FIM models set all six keys explicitly; the plain model
renames the four text-matched tokens so nothing is found.
"""

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Dict, List

try:
    from . import gguf
except ImportError:  # imported as a top-level module (tests/ on sys.path)
    import gguf

# Bump when the recipe changes in a way the parameters below do not capture.
FORMAT_VERSION = 1

VOCAB_NAME = "starcoder"

# Token ids of the special tokens in ggml-vocab-starcoder.gguf.
EOS = 0  # <|endoftext|>
FIM_PRE = 1  # <fim_prefix>
FIM_MID = 2  # <fim_middle>
FIM_SUF = 3  # <fim_suffix>
FIM_PAD = 4  # <fim_pad>
FIM_REP = 5  # <repo_name>
FIM_SEP = 6  # <file_sep>

_CONTROL = 3  # LLAMA_TOKEN_TYPE_CONTROL, as stored in tokenizer.ggml.token_type

_FIM_KEYS = {
    "tokenizer.ggml.fim_pre_token_id": FIM_PRE,
    "tokenizer.ggml.fim_suf_token_id": FIM_SUF,
    "tokenizer.ggml.fim_mid_token_id": FIM_MID,
    "tokenizer.ggml.fim_pad_token_id": FIM_PAD,
}
_REPO_KEYS = {
    "tokenizer.ggml.fim_rep_token_id": FIM_REP,
    "tokenizer.ggml.fim_sep_token_id": FIM_SEP,
}

# The shape of every tiny model.  head_dim = n_embd / n_head = 16, which is
# also the rope dimension count (llama.cpp's llama arch insists they match).
HPARAMS = {
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_head_kv": 2,  # grouped-query attention, as most real models have
    "n_ff": 128,
    "n_ctx_train": 4096,
    "rms_eps": 1e-5,
    "rope_freq_base": 10000.0,
    "seed": 1234,
    # Standard deviations of the random weights.  Layer and embedding weights
    # are small so the residual stream stays near unit scale and earlier tokens
    # still move the prediction.  The output projection is large so the logits
    # spread out (std ~ 0.5 * sqrt(n_embd) = 4): the best token then wins by a
    # clear margin and greedy decoding does not flip on rounding differences
    # between batch sizes or a cached versus recomputed prompt.
    "std_embd": 0.02,
    "std_layer": 0.02,
    "std_output": 0.5,
}


# --------------------------------------------------------------------------
# Locating llama.cpp's files
# --------------------------------------------------------------------------

def llama_cpp_source() -> Path:
    """The pinned llama.cpp source tree: $OFFGRID_LLAMA_SRC, else the link the
    build script leaves at <cache>/llama.cpp, where <cache> is $OFFGRID_CACHE
    or ~/.cache/offgrid."""
    explicit = os.environ.get("OFFGRID_LLAMA_SRC")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("OFFGRID_CACHE") or os.path.join("~", ".cache", "offgrid")
    return Path(cache).expanduser() / "llama.cpp"


def vocab_path(name: str = VOCAB_NAME) -> Path:
    """One of the vocab-only GGUF files llama.cpp keeps for its tokenizer tests."""
    return llama_cpp_source() / "models" / ("ggml-vocab-%s.gguf" % name)


# --------------------------------------------------------------------------
# Public factories
# --------------------------------------------------------------------------

def fim_model(directory: gguf.PathLike, repo_tokens: bool = True) -> Path:
    """A tiny model whose vocab has FIM prefix/suffix/middle/pad tokens, and,
    with repo_tokens, the repo-name and file-separator tokens too."""
    variant = "fim" if repo_tokens else "fim-norepo"
    keys = dict(_FIM_KEYS, **_REPO_KEYS) if repo_tokens else dict(_FIM_KEYS)
    return _cached(Path(directory), variant, fim_keys=keys, renames={})


def plain_model(directory: gguf.PathLike) -> Path:
    """A tiny model with the same tokenizer but no FIM tokens, for the
    "model does not support infill" paths."""
    # New names must not match llama.cpp's auto-detection list, contain
    # "unused" (which marks a token unused) or collide with existing tokens.
    renames = {
        FIM_PRE: "<reserved_special_1>",
        FIM_MID: "<reserved_special_2>",
        FIM_SUF: "<reserved_special_3>",
        FIM_PAD: "<reserved_special_4>",
    }
    return _cached(Path(directory), "plain", fim_keys={}, renames=renames)


# --------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------

def _cached(directory: Path, variant: str, fim_keys: Dict[str, int], renames: Dict[int, str]) -> Path:
    vocab = vocab_path()
    recipe = {
        "format": FORMAT_VERSION,
        "variant": variant,
        "hparams": HPARAMS,
        "fim_keys": fim_keys,
        "renames": {str(k): v for k, v in renames.items()},
        "vocab_sha256": hashlib.sha256(vocab.read_bytes()).hexdigest(),
    }
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    path = directory / ("tiny-%s-%s.gguf" % (variant, key))
    if path.exists():
        return path

    directory.mkdir(parents=True, exist_ok=True)
    writer = _build(variant, vocab, fim_keys, renames)
    tmp = path.with_name("%s.tmp-%d" % (path.name, os.getpid()))
    try:
        writer.write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _build(variant: str, vocab: Path, fim_keys: Dict[str, int], renames: Dict[int, str]) -> gguf.Writer:
    hp = HPARAMS
    tokenizer = {k: v for k, v in gguf.read(vocab).metadata.items() if k.startswith("tokenizer.")}
    tokens: List[str] = list(tokenizer["tokenizer.ggml.tokens"].value)
    token_types: List[int] = tokenizer["tokenizer.ggml.token_type"].value
    for token_id, text in renames.items():
        assert text not in tokens, text
        tokens[token_id] = text
    tokenizer["tokenizer.ggml.tokens"] = gguf.array_of(gguf.ValueType.STRING, tokens)
    n_vocab = len(tokens)

    w = gguf.Writer()
    w.add("general.architecture", gguf.string("llama"))
    w.add("general.name", gguf.string("offgrid-tiny-%s" % variant))
    w.add("general.file_type", gguf.uint32(1))  # LLAMA_FTYPE_MOSTLY_F16
    w.add("llama.vocab_size", gguf.uint32(n_vocab))
    w.add("llama.context_length", gguf.uint32(hp["n_ctx_train"]))
    w.add("llama.embedding_length", gguf.uint32(hp["n_embd"]))
    w.add("llama.block_count", gguf.uint32(hp["n_layer"]))
    w.add("llama.feed_forward_length", gguf.uint32(hp["n_ff"]))
    w.add("llama.attention.head_count", gguf.uint32(hp["n_head"]))
    w.add("llama.attention.head_count_kv", gguf.uint32(hp["n_head_kv"]))
    w.add("llama.attention.layer_norm_rms_epsilon", gguf.float32(hp["rms_eps"]))
    w.add("llama.rope.freq_base", gguf.float32(hp["rope_freq_base"]))
    w.add("llama.rope.dimension_count", gguf.uint32(hp["n_embd"] // hp["n_head"]))
    for k, v in tokenizer.items():
        w.add(k, v)
    for k, token_id in fim_keys.items():
        w.add(k, gguf.uint32(token_id))

    _add_weights(w, n_vocab, token_types)
    return w


def _add_weights(w: gguf.Writer, n_vocab: int, token_types: List[int]) -> None:
    """Random weights for the llama arch (names and ggml-order shapes as in
    llama.cpp's src/models/llama.cpp).  The two vocab-sized matrices are F16
    to halve the file; the rest is F32, small enough not to matter."""
    hp = HPARAMS
    rng = random.Random(hp["seed"])
    n_embd, n_ff = hp["n_embd"], hp["n_ff"]
    head_dim = n_embd // hp["n_head"]
    n_embd_kv = head_dim * hp["n_head_kv"]

    def matrix(n_in: int, n_out: int, std: float) -> List[float]:
        # Uniform rather than gaussian: a quarter of the cost per number from
        # random.Random, and nothing here depends on the distribution's shape.
        # Uniform on [-a, a] has standard deviation a / sqrt(3).
        a = std * 3 ** 0.5
        r = rng.random
        return [(2.0 * r() - 1.0) * a for _ in range(n_in * n_out)]

    def ones(n: int) -> bytes:
        return gguf.f32_bytes([1.0] * n)

    F16, F32 = gguf.TensorType.F16, gguf.TensorType.F32
    w.add_tensor("token_embd.weight", (n_embd, n_vocab), F16,
                 gguf.f16_bytes(matrix(n_embd, n_vocab, hp["std_embd"])))
    for i in range(hp["n_layer"]):
        blk = "blk.%d." % i
        w.add_tensor(blk + "attn_norm.weight", (n_embd,), F32, ones(n_embd))
        for name, n_out in (("attn_q", n_embd), ("attn_k", n_embd_kv), ("attn_v", n_embd_kv)):
            w.add_tensor(blk + name + ".weight", (n_embd, n_out), F32,
                         gguf.f32_bytes(matrix(n_embd, n_out, hp["std_layer"])))
        w.add_tensor(blk + "attn_output.weight", (n_embd, n_embd), F32,
                     gguf.f32_bytes(matrix(n_embd, n_embd, hp["std_layer"])))
        w.add_tensor(blk + "ffn_norm.weight", (n_embd,), F32, ones(n_embd))
        w.add_tensor(blk + "ffn_gate.weight", (n_embd, n_ff), F32,
                     gguf.f32_bytes(matrix(n_embd, n_ff, hp["std_layer"])))
        w.add_tensor(blk + "ffn_down.weight", (n_ff, n_embd), F32,
                     gguf.f32_bytes(matrix(n_ff, n_embd, hp["std_layer"])))
        w.add_tensor(blk + "ffn_up.weight", (n_embd, n_ff), F32,
                     gguf.f32_bytes(matrix(n_embd, n_ff, hp["std_layer"])))
    w.add_tensor("output_norm.weight", (n_embd,), F32, ones(n_embd))

    # A separate output matrix rather than tied embeddings: tied weights make a
    # random model mostly repeat its last input token.  Control tokens (EOS,
    # the FIM tokens, ...) get all-zero rows, so their logit is 0 while the
    # best ordinary token scores far above it: greedy decoding never stops or
    # emits markup on its own, and a generation runs to its token limit.
    output = matrix(n_embd, n_vocab, hp["std_output"])
    for token_id, token_type in enumerate(token_types):
        if token_type == _CONTROL:
            output[token_id * n_embd:(token_id + 1) * n_embd] = [0.0] * n_embd
    w.add_tensor("output.weight", (n_embd, n_vocab), F16, gguf.f16_bytes(output))

