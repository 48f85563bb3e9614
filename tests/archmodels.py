"""Tiny models of every memory class, built by libllama itself.

tinymodels.py writes llama-architecture files tensor by tensor; that needs
each tensor's name and shape, which differ for every architecture.  Here
libllama works them out: a GGUF metadata context with an architecture's
hyperparameters goes to ``llama_model_init_from_user``, which creates every
tensor that architecture loads (shapes from the metadata, as for a real
file) and calls back for its data; ``llama_model_save_to_file`` then writes
a GGUF that offgrid loads like any other.  The recipe for each architecture's
keys is llama.cpp's own tests/test-llama-archs.cpp (read, not copied): one
superset of hyperparameters that every architecture takes what it needs
from, with per-layer head counts where a hybrid marks its recurrent layers
(0 heads).

Each model has a real vocabulary (llama.cpp's ggml-vocab-llama-spm.gguf,
32,000 tokens: the tokenizer of a real model) and the real chat template of
the family that uses the architecture (models/templates/ of the pinned
source).  Weights are seeded: norms 1, the recurrent decay ``ssm_a``
negative (as the C++ recipe has it), the rest uniform and small, but the
output projection large so that logits spread out and greedy decoding does
not flip on the rounding of a batched or cached decode; control tokens get
an output row of zeros, so a generation runs to its token limit.

    path = build("qwen35", directory)      # cached by recipe, like tinymodels

The models are tiny (2-4 layers, n_embd 64; 128 with latent attention): a
prompt of a few hundred tokens evaluates in milliseconds.
"""

import ctypes
import hashlib
import json
import os
import random
import struct
from ctypes import c_bool, c_char_p, c_int, c_int64, c_size_t, c_uint32, c_void_p
from pathlib import Path

try:
    from . import gguf, tinymodels
except ImportError:  # tests/ on sys.path
    import gguf
    import tinymodels

from offgrid import libllama

FORMAT_VERSION = 1
VOCAB = "llama-spm"

# name -> what differs (``arch``: the architecture, where the name is another):
# the family's template, layer count, MoE, SWA window,
# and the spread of the layer weights (std_layer): too small and a random model
# hardly looks past its last token, too large and it repeats one token; each
# value was chosen so that changing one word early, midway or late in a
# 20-word prompt changes the greedy continuation (measured, not derived)
ARCHS = {
    "llama": dict(template="meta-llama-Llama-3.2-3B-Instruct.jinja", std_layer=0.3),
    "qwen3moe": dict(template="Qwen-Qwen3-0.6B.jinja", moe=True),
    "gemma3": dict(template="google-gemma-2-2b-it.jinja", swa=64, n_layer=2),
    # Gemma 4's small kind: per-layer embeddings, which libllama may read from the file
    # as it needs them (-lzm)
    "gemma4": dict(template="google-gemma-4-31B-it.jinja", vocab="gemma-4", swa=64, n_layer=2,
                   captured=True,
                   swa_pattern=[True, False],
                   u32={"embedding_length_per_layer_input": 8, "attention.key_length": 32,
                        "attention.value_length": 32, "attention.key_length_swa": 32,
                        "attention.value_length_swa": 32}),
    "gpt-oss": dict(template="openai-gpt-oss-120b.jinja", moe=True, swa=64, std_layer=1.2),
    "lfm2": dict(template="LFM2.5-Instruct.jinja"),
    "granitehybrid": dict(template="ibm-granite-granite-4.0.jinja", std_layer=0.3),
    "qwen3next": dict(template="Qwen-Qwen3-0.6B.jinja", moe=True),
    "nemotron_h": dict(template="NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja", n_layer=3,
                       std_layer=0.3),
    "qwen35": dict(template="Qwen3.5-4B.jinja"),
    "mamba2": dict(template="Qwen-Qwen2.5-7B-Instruct.jinja"),
    # Qwen2-VL's text model: M-RoPE, its rotary dimensions in sections for time,
    # rows and columns (16 pairs of a 32-wide head: Qwen2-VL's 16/24/24 of 64,
    # scaled); built with vocab="qwen2" (tests/mrope.py)
    "qwen2vl": dict(template="Qwen-Qwen2.5-7B-Instruct.jinja", sections=[4, 6, 6, 0],
                    std_layer=0.4),
    # Qwen3-VL's: interleaved M-RoPE, and its first layer takes a deepstack slice
    # of an image's embedding (n_embd_inp = 2 n_embd)
    "qwen3vl": dict(template="Qwen-Qwen2.5-7B-Instruct.jinja", sections=[4, 6, 6, 0],
                    std_layer=0.4, deepstack=1),
    # Qwen3.5's MoE (Qwen3.5-35B-A3B): hybrid, snapshots of its recurrent state
    "qwen35moe": dict(template="Qwen3.5-4B.jinja", moe=True),
    # multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash, Kimi-K2): a
    # cache row is a compressed latent and a rotary part, not per-head keys
    # and values; the sizes are those of llama.cpp's test-llama-archs
    "deepseek2": dict(template="deepseek-ai-DeepSeek-V3.1.jinja", moe=True, mla=True,
                      n_embd=128, n_head=1, n_ff=192),
    # Llama 4: chunked attention (libllama's 8192-token chunks: a window layer
    # sees its own chunk only), every fourth layer without rotary positions; a
    # context past the first chunk
    "llama4": dict(template="meta-llama-Llama-3.2-3B-Instruct.jinja", moe=True, n_layer=4,
                   n_ctx_train=16384),
    # hybrids whose state libllama keeps no snapshots of: Falcon-H1 (attention
    # and Mamba2 side by side in every layer), Jamba (Mamba-1 layers between
    # attention ones); their families' templates are not in the pinned source,
    # so a ChatML one
    "falcon-h1": dict(template="Qwen-Qwen2.5-7B-Instruct.jinja"),
    "jamba": dict(template="Qwen-Qwen2.5-7B-Instruct.jinja"),
    # an encoder (bge-small, all-MiniLM, nomic-embed's kin): every token sees every
    # other, no memory, embeddings only; the real BERT vocabulary and bge's
    # pooling (the first token's state), no classifier head
    "bert": dict(vocab="bert-bge", u32={"pooling_type": 2}, bool={"attention.causal": False},
                 drop=["cls."]),
    # EmbeddingGemma: bidirectional attention, mean pooling, then two dense
    # projections of the pooled vector (up and back down); written here, as
    # libllama's saver leaves the projections out
    "gemma-embedding": dict(vocab="gemma-4", captured=True, bool={"attention.causal": False},
                            u32={"pooling_type": 1, "dense_2_feat_in": 64,
                                 "dense_2_feat_out": 192, "dense_3_feat_in": 192,
                                 "dense_3_feat_out": 64}),
    # the same with its classifier head and the rank pooling: a reranker
    # (bge-reranker's kind)
    "bert-rank": dict(arch="bert", vocab="bert-bge", u32={"pooling_type": 4},
                      bool={"attention.causal": False}),
    # a decoder reranker (Qwen3-Reranker's kind): its classifier reads the last
    # token, softmax over "yes" and "no"; the score is "yes"
    "qwen3-rank": dict(arch="qwen3", vocab="qwen2", template="Qwen-Qwen3-0.6B.jinja",
                       u32={"pooling_type": 4}, labels=["yes", "no"]),
    # an encoder-decoder (T5): not served; libllama's saver does not take it, so
    # this writes the file
    "t5": dict(captured=True, u32={"decoder_start_token_id": 0,
                                   "attention.relative_buckets_count": 8}),
    # recurrent, not a Mamba: RWKV-6's time mixing
    "rwkv6": dict(template="llama-cpp-rwkv-world.jinja",
                  u32={"time_mix_extra_dim": 64, "time_decay_extra_dim": 128,
                       "wkv.head_size": 32}),
}

# architectures that mark a recurrent layer by its 0 attention heads
LAYER_HEADS = {"nemotron_h", "granitehybrid", "lfm2", "jamba"}

N_CTX_TRAIN = 4096
N_EMBD = 64
N_HEAD = 2
N_FF = 128
SEED = 4321
STD_LAYER = 0.15
STD_EMBD = 0.1
STD_OUTPUT = 0.5

# gguf_type (ggml's gguf.h)
_U32, _F32, _BOOL = 4, 6, 7
# ggml_type
_GGML_F32, _GGML_F16 = 0, 1


def build(arch, directory, vocab=None, template=None):
    """The path of a tiny ``arch`` model in ``directory``, built once per recipe;
    with another of the pinned source's vocabularies (``ggml-vocab-NAME.gguf``)
    and template (a file name in models/templates) where given."""
    spec = ARCHS[arch]
    src = tinymodels.llama_cpp_source()
    vocab = src / "models" / ("ggml-vocab-%s.gguf" % (vocab or spec.get("vocab", VOCAB)))
    template = template or spec.get("template")
    template = (src / "models" / "templates" / template).read_text() if template else ""
    recipe = {"format": FORMAT_VERSION, "arch": arch, "spec": spec, "n_embd": N_EMBD,
              "seed": SEED, "std": [STD_LAYER, STD_EMBD, STD_OUTPUT],
              "vocab": hashlib.sha256(vocab.read_bytes()).hexdigest(),
              "template": hashlib.sha256(template.encode()).hexdigest(),
              "lib": _lib_version()}
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    directory = Path(directory)
    path = directory / ("arch-%s-%s.gguf" % (arch, key))
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("%s.tmp-%d" % (path.name, os.getpid()))
    try:
        _Builder(arch, spec, vocab, template).save(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _lib_version():
    lib = libllama.load()
    return lib.llama_version().decode() if hasattr(lib, "llama_version") else ""


class _Ggml:
    """The few ggml-base and libllama calls the builder makes (test-only ctypes;
    offgrid itself binds none of them)."""

    def __init__(self):
        lib = libllama.load()
        folder = Path(lib.path).parent if getattr(lib, "path", None) else \
            Path(__file__).resolve().parent.parent / "lib"
        base = ctypes.CDLL(str(folder / "libggml-base.so"))
        llama = ctypes.CDLL(str(folder / "libllama.so"))
        self.base, self.llama = base, llama

        class InitParams(ctypes.Structure):
            _fields_ = [("no_alloc", c_bool), ("ctx", c_void_p)]
        self.InitParams = InitParams
        sig = {
            "gguf_init_empty": (c_void_p, []),
            "gguf_init_from_file": (c_void_p, [c_char_p, InitParams]),
            "gguf_free": (None, [c_void_p]),
            "gguf_set_kv": (None, [c_void_p, c_void_p]),
            "gguf_get_n_kv": (c_int64, [c_void_p]),
            "gguf_get_key": (c_char_p, [c_void_p, c_int64]),
            "gguf_remove_key": (c_int64, [c_void_p, c_char_p]),
            "gguf_set_val_u32": (None, [c_void_p, c_char_p, c_uint32]),
            "gguf_set_val_f32": (None, [c_void_p, c_char_p, ctypes.c_float]),
            "gguf_set_val_bool": (None, [c_void_p, c_char_p, c_bool]),
            "gguf_set_val_str": (None, [c_void_p, c_char_p, c_char_p]),
            "gguf_set_arr_data": (None, [c_void_p, c_char_p, c_int, c_void_p, c_size_t]),
            "gguf_set_arr_str": (None, [c_void_p, c_char_p, ctypes.POINTER(c_char_p), c_size_t]),
            "ggml_get_name": (c_char_p, [c_void_p]),
            "ggml_nelements": (c_int64, [c_void_p]),
            "ggml_nbytes": (c_size_t, [c_void_p]),
            "ggml_backend_tensor_set": (None, [c_void_p, c_void_p, c_size_t, c_size_t]),
            "ggml_n_dims": (c_int, [c_void_p]),
            "gguf_write_to_file": (c_bool, [c_void_p, c_char_p, c_bool]),
        }
        for name, (res, args) in sig.items():
            fn = getattr(base, name)
            fn.restype, fn.argtypes = res, args
        self.set_cb = ctypes.CFUNCTYPE(None, c_void_p, c_void_p)
        llama.llama_model_init_from_user.restype = c_void_p
        llama.llama_model_init_from_user.argtypes = [c_void_p, self.set_cb, c_void_p,
                                                     libllama.llama_model_params]
        llama.llama_model_save_to_file.restype = None
        llama.llama_model_save_to_file.argtypes = [c_void_p, c_char_p]
        llama.llama_model_free.restype = None
        llama.llama_model_free.argtypes = [c_void_p]
        llama.llama_model_default_params.restype = libllama.llama_model_params
        llama.llama_model_default_params.argtypes = []


class _Builder:
    def __init__(self, arch, spec, vocab, template):
        self.g = _Ggml()
        self.arch, self.spec = spec.get("arch", arch), spec
        self.n_embd = spec.get("n_embd", N_EMBD)
        # (name, shape, type, data) of every tensor, where this writes the file
        self.captured = [] if spec.get("captured") else None
        self.vocab, self.template = vocab, template
        meta = gguf.read(vocab).metadata
        self.control = [i for i, t in enumerate(meta["tokenizer.ggml.token_type"].value)
                        if t == 3]
        self.n_vocab = len(meta["tokenizer.ggml.tokens"].value)
        rng = random.Random(SEED)
        # one pool of uniform numbers in [-1, 1), tiled from a per-tensor
        # offset: a prime length, so no two rows of a matrix are the same
        n = 1000003
        unit = [2.0 * rng.random() - 1.0 for _ in range(n)]
        # uniform on [-a, a] has standard deviation a / sqrt(3)
        self.std_layer = spec.get("std_layer", STD_LAYER)
        self.pools = {std: struct.pack("<%df" % n, *[v * std * 3 ** 0.5 for v in unit])
                      for std in (self.std_layer, STD_EMBD, STD_OUTPUT)}
        self.pool_n = n

    # -- metadata ----------------------------------------------------------
    def _metadata(self):
        g, a, spec = self.g.base, self.arch, self.spec
        ctx = g.gguf_init_empty()
        src = g.gguf_init_from_file(str(self.vocab).encode(), self.g.InitParams(True, None))
        g.gguf_set_kv(ctx, src)
        g.gguf_free(src)
        # the vocab file's model keys (llama.*) would be read as this model's
        keys = [g.gguf_get_key(ctx, i) for i in range(g.gguf_get_n_kv(ctx))]
        for k in keys:
            if not k.startswith(b"tokenizer."):
                g.gguf_remove_key(ctx, k)
        n_layer = spec.get("n_layer", 2)
        moe = spec.get("moe", False)
        n_embd, n_head, n_ff = self.n_embd, spec.get("n_head", N_HEAD), spec.get("n_ff", N_FF)
        head_dim = n_embd // n_head

        def u32(k, v):
            g.gguf_set_val_u32(ctx, (k % a).encode(), v)

        def f32(k, v):
            g.gguf_set_val_f32(ctx, (k % a).encode(), v)

        def arr(k, values):
            data = (ctypes.c_uint32 * len(values))(*values)
            g.gguf_set_arr_data(ctx, (k % a).encode(), _U32, data, len(values))

        g.gguf_set_val_str(ctx, b"general.architecture", a.encode())
        g.gguf_set_val_str(ctx, b"general.name", ("offgrid-tiny-" + a).encode())
        if self.template:
            g.gguf_set_val_str(ctx, b"tokenizer.chat_template", self.template.encode())
        u32("%s.vocab_size", self.n_vocab)
        u32("%s.context_length", spec.get("n_ctx_train", N_CTX_TRAIN))
        u32("%s.embedding_length", n_embd)
        u32("%s.features_length", n_embd)
        u32("%s.block_count", n_layer)
        u32("%s.leading_dense_block_count", 1)
        if a == "nemotron_h":
            arr("%s.feed_forward_length", [0 if i <= 1 else n_ff for i in range(n_layer)])
        else:
            u32("%s.feed_forward_length", n_ff)
        g.gguf_set_val_bool(ctx, ("%s.use_parallel_residual" % a).encode(), False)
        f32("%s.logit_scale", 1.0)
        u32("%s.full_attention_interval", 2)
        if a in LAYER_HEADS:
            # layer 1 is recurrent (no attention heads); the others attend
            heads = [0 if i == 1 else n_head for i in range(n_layer)]
            arr("%s.attention.head_count", heads)
            arr("%s.attention.head_count_kv", heads)
        else:
            u32("%s.attention.head_count", n_head)
            u32("%s.attention.head_count_kv", n_head)
        if spec.get("mla"):
            # multi-head latent attention (DeepSeek-V2 and its kin): a cache row is
            # the compressed latent (512) and the rotary part (64)
            u32("%s.attention.key_length", 576)
            u32("%s.attention.value_length", 512)
            u32("%s.rope.dimension_count", 64)
            u32("%s.attention.key_length_mla", 192)
            u32("%s.attention.value_length_mla", 128)
            u32("%s.attention.q_lora_rank", 512)
            u32("%s.attention.kv_lora_rank", 512)
        for k, v in spec.get("u32", {}).items():
            u32("%s." + k, v)
        for k, v in spec.get("bool", {}).items():
            g.gguf_set_val_bool(ctx, ("%s.%s" % (a, k)).encode(), v)
        if spec.get("labels"):
            # a classifier's outputs (n_cls_out): a reranker's "yes" and "no"
            labels = (c_char_p * len(spec["labels"]))(*[x.encode() for x in spec["labels"]])
            g.gguf_set_arr_str(ctx, ("%s.classifier.output_labels" % a).encode(), labels,
                               len(spec["labels"]))
        f32("%s.attention.clamp_kqv", 1.0)
        f32("%s.attention.layer_norm_epsilon", 1e-5)
        f32("%s.attention.layer_norm_rms_epsilon", 1e-5)
        f32("%s.attention.group_norm_epsilon", 1e-5)
        u32("%s.attention.group_norm_groups", 8)
        u32("%s.attention.sliding_window", spec.get("swa", 128))
        if spec.get("swa_pattern"):
            # Gemma 4 reads which layers are windowed as an array of bools
            pattern = spec["swa_pattern"]
            data = (c_bool * len(pattern))(*pattern)
            g.gguf_set_arr_data(ctx, ("%s.attention.sliding_window_pattern" % a).encode(),
                                _BOOL, data, len(pattern))
        else:
            u32("%s.attention.sliding_window_pattern", 2)
        f32("%s.rope.freq_base", 10000.0)
        arr("%s.rope.dimension_sections", spec.get("sections", [head_dim // 4] * 4))
        if spec.get("deepstack"):
            u32("%s.n_deepstack_layers", spec["deepstack"])
        if moe:
            u32("%s.expert_feed_forward_length", n_ff)
            u32("%s.expert_shared_feed_forward_length", n_ff // 2)
            u32("%s.interleave_moe_layer_step", 2)
            u32("%s.expert_count", 4)
            u32("%s.expert_used_count", 2)
            u32("%s.expert_shared_count", 1)
            u32("%s.expert_gating_func", 2)
        inner = 256 if a in ("qwen3next", "qwen35", "qwen35moe") else 2 * n_embd
        u32("%s.ssm.inner_size", inner)
        u32("%s.ssm.conv_kernel", 4)
        u32("%s.ssm.state_size", 128)
        u32("%s.ssm.time_step_rank", n_head)
        u32("%s.ssm.group_count", 2)
        u32("%s.shortconv.l_cache", 3)
        f32("%s.residual_scale", 1.0)
        f32("%s.embedding_scale", 1.0)
        f32("%s.attention.scale", 1.0 / head_dim ** 0.5)
        return ctx

    # -- weights -----------------------------------------------------------
    def _fill(self, tensor, _ud):
        g = self.g.base
        name = g.ggml_get_name(tensor).decode()
        n = g.ggml_nelements(tensor)
        ggml_type = ctypes.c_int.from_address(tensor).value
        if "norm" in name and name.endswith(".weight"):
            values = struct.pack("<f", 1.0) * n
        else:
            std = {"output.weight": STD_OUTPUT, "token_embd.weight": STD_EMBD}.get(
                name, self.std_layer)
            values = self._tile(name, n, self.pools[std])
            if "ssm_a" in name:
                values = struct.pack("<%df" % n, *[-abs(v) for v in
                                                   struct.unpack("<%df" % n, values)])
            if name == "output.weight":
                rows = bytearray(values)
                zero = bytes(4 * self.n_embd)
                for t in self.control:
                    rows[t * 4 * self.n_embd:(t + 1) * 4 * self.n_embd] = zero
                values = bytes(rows)
        if ggml_type == _GGML_F16:
            floats = struct.unpack("<%df" % n, values)
            values = struct.pack("<%de" % n, *floats)
        elif ggml_type != _GGML_F32:
            raise RuntimeError("tensor %s of ggml type %d" % (name, ggml_type))
        buf = ctypes.create_string_buffer(values, len(values))
        g.ggml_backend_tensor_set(tensor, buf, 0, len(values))
        if self.captured is not None:
            # ggml_tensor: an enum, a buffer pointer, then int64 ne[4]
            ne = (ctypes.c_int64 * 4).from_address(tensor + 16)
            self.captured.append((name, tuple(ne[:g.ggml_n_dims(tensor)]),
                                  gguf.TensorType.F16 if ggml_type == _GGML_F16
                                  else gguf.TensorType.F32, values))

    def _tile(self, name, n, pool):
        """n float32s of ``pool``, from an offset that the tensor's name picks."""
        off = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % self.pool_n
        need = 4 * n
        reps = (4 * off + need) // len(pool) + 1
        return (pool * reps)[4 * off:4 * off + need]

    def save(self, path):
        g, llama = self.g.base, self.g.llama
        meta = self._metadata()
        cb = self.g.set_cb(self._fill)
        params = llama.llama_model_default_params()
        params.progress_callback = libllama.llama_progress_callback()
        model = llama.llama_model_init_from_user(meta, cb, None, params)
        try:
            if not model:
                raise RuntimeError("libllama could not make a %s model from the recipe"
                                   % self.arch)
            if self.captured is None:
                llama.llama_model_save_to_file(model, str(path).encode())
            else:
                self._write_captured(meta, path)
        finally:
            if model:
                llama.llama_model_free(model)
            g.gguf_free(meta)
        self._mend(path)

    def _write_captured(self, meta, path):
        """The file written here, for an architecture libllama's saver does not
        take (llama_model_saver_supports_arch: T5, Gemma 3n): the metadata as
        gguf writes it, the tensors as libllama asked for them."""
        if not self.g.base.gguf_write_to_file(meta, str(path).encode(), True):
            raise RuntimeError("gguf could not write %s" % path)
        w = gguf.Writer()
        for key, value in gguf.read(path).metadata.items():
            w.add(key, value)
        for name, shape, ttype, data in self.captured:
            w.add_tensor(name, shape, ttype, data)
        w.write(path)

    def _mend(self, path):
        """What libllama's saver leaves out: the token embeddings of a model with
        no output matrix (llama-model-saver.cpp writes tok_embd only beside an
        output of another name: an encoder has none); and the tensors the spec
        drops (``drop``: name prefixes, e.g. BERT's classifier head)."""
        f = gguf.read(path)
        names = {t.name for t in f.tensors}
        drop = tuple(self.spec.get("drop", ()))
        dropped = [n for n in names if drop and n.startswith(drop)]
        if "token_embd.weight" in names and not dropped:
            return
        w = gguf.Writer()
        for key, value in f.metadata.items():
            w.add(key, value)
        if "token_embd.weight" not in names:
            n = self.n_embd * self.n_vocab
            w.add_tensor("token_embd.weight", (self.n_embd, self.n_vocab), gguf.TensorType.F32,
                         self._tile("token_embd.weight", n, self.pools[STD_EMBD]))
        for t in f.tensors:
            if t.name not in dropped:
                w.add_tensor(t.name, t.shape, gguf.TensorType(t.type), f.tensor_bytes(t))
        w.write(path)
