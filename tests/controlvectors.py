"""Control vectors for the tiny plain model, written by gguf.py with chosen numbers,
and the same model with a vector built into its weights.

No registry ships a control vector for a test model, so the tests make them:
``direction.<layer>`` F32 vectors of n_embd (64) seeded values, as llama.cpp's
cvector-generator writes (general.architecture "controlvector", its
model_hint the model's architecture).  llama.cpp adds a layer's vector to
that layer's output after the feed-forward residual add (build_cvec, at the
end of each layer of src/models/llama.cpp); a llama model may also carry an
optional ``blk.N.ffn_down.bias`` (loaded TENSOR_NOT_REQUIRED), which
build_ffn adds to the feed-forward output just before that same residual
add.  So the model whose layer L has ffn_down.bias = s * v (``biased``)
computes what the plain model computes under the vector v at scale s, in
the same float32 numbers but for the order of two additions: its greedy
text must be the same.

    vector(d, seed, layers)           a control vector file for plain_model
    biased(d, {layer: [(seed, scale), ...]})
                                      plain_model with those vectors as biases
    bad(d, kind)                      files that must be refused at load

Files are cached by recipe in the given directory, like tinymodels.
"""

import random

try:
    from . import gguf, tinymodels
    from .loras import _cached
except ImportError:  # tests/ on sys.path
    import gguf
    import tinymodels
    from loras import _cached

FORMAT_VERSION = 1
N_EMBD = tinymodels.HPARAMS["n_embd"]
# the size of its numbers: the tiny model's residual stream is ~0.02-0.1 a value,
# so a vector of this spread moves the greedy text and leaves the prompt in charge
SPREAD = 0.02


def values(seed, layer, n=N_EMBD):
    """The direction of ``layer`` in vector(seed): seeded, exact in float32."""
    rng = random.Random("%d/%d" % (seed, layer))
    return gguf.f32_values(gguf.f32_bytes(rng.uniform(-SPREAD, SPREAD) for _ in range(n)))


def _writer(arch="llama"):
    w = gguf.Writer()
    w.add("general.architecture", gguf.string("controlvector"))
    w.add("controlvector.model_hint", gguf.string(arch))
    return w


def vector(directory, seed=1, layers=(1,)):
    """A control vector for tinymodels.plain_model: direction.L for each L of ``layers``."""
    def make(path):
        w = _writer()
        w.add("controlvector.layer_count", gguf.int32(len(layers)))
        for layer in layers:
            w.add_tensor("direction.%d" % layer, (N_EMBD,), gguf.TensorType.F32,
                         gguf.f32_bytes(values(seed, layer)))
        w.write(path)
    recipe = {"v": FORMAT_VERSION, "seed": seed, "layers": list(layers), "spread": SPREAD}
    return _cached(directory, "cvec-%d-%s" % (seed, "-".join(map(str, layers))), recipe, make)


def biased(directory, biases):
    """plain_model with blk.L.ffn_down.bias = the sum of scale * values(seed, L) for
    each layer L of ``biases`` ({L: [(seed, scale), ...]}), summed in float32 as
    llama.cpp sums control vectors (common_control_vector_load)."""
    base = tinymodels.plain_model(directory)
    recipe = {"v": FORMAT_VERSION, "base": base.name, "spread": SPREAD,
              "biases": {str(k): v for k, v in sorted(biases.items())}}

    def make(path):
        f = gguf.read(base)
        w = gguf.Writer()
        for key, value in f.metadata.items():
            w.add(key, value)
        for info in f.tensors:
            w.add_tensor(info.name, info.shape, gguf.TensorType(info.type), f.tensor_bytes(info))
        for layer, terms in sorted(biases.items()):
            bias = [0.0] * N_EMBD
            for seed, scale in terms:
                scale = gguf.f32_values(gguf.f32_bytes([scale]))[0]
                scaled = gguf.f32_values(gguf.f32_bytes(v * scale for v in values(seed, layer)))
                bias = gguf.f32_values(gguf.f32_bytes(a + b for a, b in zip(bias, scaled)))
            w.add_tensor("blk.%d.ffn_down.bias" % layer, (N_EMBD,), gguf.TensorType.F32,
                         gguf.f32_bytes(bias))
        w.write(path)
    return _cached(directory, "cvec-biased", recipe, make)


def bad(directory, kind):
    """A file libllama would take badly or llama.cpp would skip, by ``kind``:
    "n_embd" (vectors of 32 values: for another model), "f16" (a direction of type
    F16), "layer0" (a direction for layer 0), "arch" (model_hint qwen2), "empty"
    (no tensors)."""
    def make(path):
        w = _writer("qwen2" if kind == "arch" else "llama")
        if kind == "n_embd":
            w.add_tensor("direction.1", (32,), gguf.TensorType.F32, gguf.f32_bytes([0.1] * 32))
        elif kind == "f16":
            w.add_tensor("direction.1", (N_EMBD,), gguf.TensorType.F16,
                         gguf.f16_bytes([0.1] * N_EMBD))
        elif kind in ("layer0", "arch"):
            w.add_tensor("direction.%d" % (0 if kind == "layer0" else 1), (N_EMBD,),
                         gguf.TensorType.F32, gguf.f32_bytes([0.1] * N_EMBD))
        w.write(path)
    return _cached(directory, "cvec-bad-" + kind, {"v": FORMAT_VERSION, "kind": kind}, make)
