"""bench/gpu.py's models: the files #51's GPU measurement runs on must be what it says.

A session lent the device machine has minutes there and no second try, so
what can be checked without it is checked here: a skeleton keeps a model's
header whole; a model written from one has the real file's size and tensor
table, and libllama loads it and generates; a shape derived from a skeleton
loads (libllama checks every tensor's shape against the hyperparameters) and
has the types libllama's own quantizer gives a Q4_K_M file; and the large
shapes are Qwen2.5-32B's and -72B's sizes.
"""

import ctypes

import pytest

try:
    from . import gguf
    from .serverproc import ROOT, ServerProcess
    from .test_bench_cli import _bench_module
except ImportError:  # tests/ is on sys.path rather than a package
    import gguf
    from serverproc import ROOT, ServerProcess
    from test_bench_cli import _bench_module

SMOL = ROOT / "models" / "smollm2-135m-instruct-q4_1.gguf"
QWEN = ROOT / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
# a small sibling of a bench model: every row a multiple of Q4_K's 256-wide
# blocks, as in Qwen2.5-32B, so no tensor falls back to another type
SMALL_SHAPE = dict(n_embd=256, n_layer=8, n_head=4, n_head_kv=2, n_ff=512)
# and one with what sets Qwen2.5-72B apart: 80 layers of grouped-query
# attention (libllama's "70B", whose attn_v is Q5_K) and a feed-forward width
# that is no whole number of 256-wide blocks (its ffn_down falls back to Q5_0
# and Q8_0)
SMALL_70B_SHAPE = dict(n_embd=256, n_layer=80, n_head=4, n_head_kv=2, n_ff=288)
LLAMA_FTYPE_MOSTLY_Q4_K_M = 15


@pytest.fixture(scope="module")
def gpu():
    return _bench_module("bench_gpu", "gpu.py")


@pytest.fixture(scope="module")
def ggml(gpu):
    return gpu.Ggml(ROOT / "lib")


def generates(model):
    with ServerProcess(model) as srv:
        status, _, out = srv.post("/completion", {"prompt": "Once upon a time", "n_predict": 8,
                                                   "temperature": 0, "ignore_eos": True})
    assert status == 200, out
    assert out["timings"]["predicted_n"] == 8, out
    return out


def test_a_model_from_a_skeleton_has_the_real_files_layout_and_generates(gpu, ggml, tmp_path):
    skel, made = tmp_path / "smol.skel.gguf", tmp_path / "smol.gguf"
    gpu.skeleton(SMOL, skel)
    real = gguf.read(SMOL)
    assert skel.stat().st_size == real.data_offset
    info = gpu.inflate(skel, made, ggml, 2)
    assert not info["tiled"]
    assert made.stat().st_size == SMOL.stat().st_size
    assert gguf.read(made).tensors == real.tensors
    with open(SMOL, "rb") as a, open(made, "rb") as b:
        assert a.read(real.data_offset) == b.read(real.data_offset)
        assert a.read(4096) != b.read(4096), "the data should be new, not the real weights"
    generates(made)


def test_a_tiled_model_has_the_same_layout(gpu, ggml, tmp_path, monkeypatch):
    skel, made = tmp_path / "smol.skel.gguf", tmp_path / "smol-tiled.gguf"
    gpu.skeleton(SMOL, skel)
    monkeypatch.setattr(gpu, "TILED_ABOVE", 0)
    assert gpu.inflate(skel, made, ggml, 2)["tiled"]
    assert made.stat().st_size == SMOL.stat().st_size
    generates(made)


def _quantize(src, dst, ftype):
    """libllama's llama_model_quantize, as llama-quantize calls it."""
    lib = ctypes.CDLL(str(ROOT / "lib" / "libllama.so"))

    class Params(ctypes.Structure):
        _fields_ = [("nthread", ctypes.c_int32), ("ftype", ctypes.c_int),
                    ("output_tensor_type", ctypes.c_int), ("token_embedding_type", ctypes.c_int),
                    ("allow_requantize", ctypes.c_bool), ("quantize_output_tensor", ctypes.c_bool),
                    ("only_copy", ctypes.c_bool), ("pure", ctypes.c_bool),
                    ("keep_split", ctypes.c_bool), ("dry_run", ctypes.c_bool),
                    ("imatrix", ctypes.c_void_p), ("kv_overrides", ctypes.c_void_p),
                    ("tt_overrides", ctypes.c_void_p), ("prune_layers", ctypes.c_void_p),
                    ("max_buf_size", ctypes.c_size_t)]
    lib.llama_model_quantize_default_params.restype = Params
    lib.llama_model_quantize.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(Params)]
    lib.llama_model_quantize.restype = ctypes.c_uint32
    params = lib.llama_model_quantize_default_params()
    params.nthread, params.ftype = 2, ftype
    assert lib.llama_model_quantize(str(src).encode(), str(dst).encode(),
                                    ctypes.byref(params)) == 0


@pytest.mark.parametrize("model,shape", [(QWEN, SMALL_SHAPE), (SMOL, SMALL_SHAPE),
                                         (QWEN, SMALL_70B_SHAPE)],
                         ids=["output-of-its-own", "tied-embeddings", "70b-and-fallbacks"])
def test_a_derived_shape_loads_with_the_types_llama_quantize_gives(gpu, ggml, tmp_path, model,
                                                                   shape):
    base = tmp_path / "base.skel.gguf"
    gpu.skeleton(model, base)
    meta, tensors = gpu.derive(base, shape)
    n = shape["n_layer"]
    assert len([t for t in tensors if t[0].startswith("blk.")]) == n * len(
        [t for t in gguf.read(model).tensors if t.name.startswith("blk.0.")])
    # the same shape in F32, written and then quantized by libllama itself
    f32_skel, f32 = tmp_path / "f32.skel.gguf", tmp_path / "f32.gguf"
    gpu.write_skeleton(f32_skel, meta, [(name, shape, gpu.F32) for name, shape, _ in tensors],
                       ggml)
    gpu.inflate(f32_skel, f32, ggml, 2)
    quantized = tmp_path / "q4_k_m.gguf"
    _quantize(f32, quantized, LLAMA_FTYPE_MOSTLY_Q4_K_M)
    want = {t.name: (t.shape, t.type) for t in gguf.read(quantized).tensors}
    assert {name: (shape, ttype) for name, shape, ttype in tensors} == want
    # and the derived Q4_K_M file itself loads and generates
    skel, made = tmp_path / "derived.skel.gguf", tmp_path / "derived.gguf"
    gpu.write_skeleton(skel, meta, tensors, ggml)
    gpu.inflate(skel, made, ggml, 2)
    assert made.stat().st_size == quantized.stat().st_size
    generates(made)


# name -> (parameters in billions, tensor bytes in GiB, file in GB).  llama-bench
# prints a Qwen2.5-32B-Instruct Q4_K_M file as "qwen2 32B Q4_K - Medium |
# 18.48 GiB | 32.76 B"; Qwen2.5-72B-Instruct-Q4_K_M.gguf is 47.4 GB as
# published (bartowski/Qwen2.5-72B-Instruct-GGUF), of a model of 72.7 B
# parameters.  The derived ones have 151,936 tokens where those have 152,064
# (0.004% of the parameters, 1.4 MB of the 72B's file).
LARGE = {"qwen2.5-32b-shape-q4_k_m": (32.76, 18.48, 19.9),
         "qwen2.5-72b-shape-q4_k_m": (72.70, 44.15, 47.4)}


@pytest.mark.parametrize("name", sorted(LARGE))
def test_the_large_shapes_are_the_real_q4_k_m_files_size(gpu, ggml, tmp_path, name):
    base = tmp_path / "qwen.skel.gguf"
    gpu.skeleton(QWEN, base)
    source, shape = gpu.SHAPES[name]
    assert source == "qwen2.5-coder-0.5b-q4_k_m"
    meta, tensors = gpu.derive(base, shape)
    params = sum(gguf.TensorInfo(n, s, t, 0).n_elements for n, s, t in tensors)
    size = sum(ggml.nbytes(gguf.TensorInfo(n, s, t, 0)) for n, s, t in tensors)
    want_params, want_gib, want_gb = LARGE[name]
    assert round(params / 1e9, 2) == want_params, params
    assert round(size / (1 << 30), 2) == want_gib, size
    skel = tmp_path / "large.skel.gguf"
    gpu.write_skeleton(skel, meta, tensors, ggml)
    file_bytes, kv = gpu.model_size(skel, ggml)
    assert round(file_bytes / 1e9, 1) == want_gb, file_bytes
    # the bench's 4096 tokens of F16 keys and values in every layer
    assert kv == 2 * 2 * 4096 * shape["n_layer"] * shape["n_head_kv"] * (
        shape["n_embd"] // shape["n_head"])


def test_a_model_is_measured_where_the_gpu_the_disk_and_the_time_left_hold_it(gpu):
    """run's choice (the largest shape first): the free memory --list-devices
    gives, and what does not fit the GPU, the disk or the time left, said."""
    listing = ("Available devices:\n  CUDA0: NVIDIA H100 80GB HBM3 (81079 MiB, 80521 MiB free)\n"
               "  CUDA1: NVIDIA H100 80GB HBM3 (81079 MiB, 1000 MiB free)\n")
    assert gpu.free_mib(listing, "CUDA0") == 81521
    assert gpu.free_mib("Available devices:\n  (none)\n", "CUDA0") == 0
    gib = 1 << 30
    assert gpu.room_for(44 * gib, 1 * gib, 80 * gib, 60e9, 400) is None
    assert "free on the GPU" in gpu.room_for(44 * gib, 1 * gib, 46 * gib, 60e9, 400)
    assert "where models are written" in gpu.room_for(44 * gib, 1 * gib, 80 * gib, 40e9, 400)
    assert "of the budget" in gpu.room_for(44 * gib, 1 * gib, 80 * gib, 60e9, 200)


def test_the_kit_and_run_commands_parse(gpu):
    args = gpu.parse_args(["run", "--kit", "k", "--out", "o", "--models",
                           "gemma-3-270m-q4_k_m,qwen2.5-32b-shape-q4_k_m"])
    assert args.models == ["gemma-3-270m-q4_k_m", "qwen2.5-32b-shape-q4_k_m"]
    assert gpu.parse_args(["kit"]).cuda_archs == gpu.CUDA_ARCHS
    with pytest.raises(SystemExit):
        gpu.parse_args(["run", "--kit", "k", "--out", "o", "--models", "nope"])


def test_figures_are_medians_against_both_references(gpu):
    r = {"llama_bench": {"prompt": 1000.0, "generation": 100.0},
         "samples": {"offgrid": {"prompt": [900.0, 990.0, 950.0], "generation": [98.0, 99.0]},
                     "llama_server": {"prompt": [1000.0], "generation": [100.0, 96.0, 97.0]}}}
    f = gpu.figures(r)
    assert f["prompt"]["vs_llama_server"] == pytest.approx(0.95)
    assert f["prompt"]["vs_llama_bench"] == pytest.approx(0.95)
    assert f["generation"]["vs_llama_server"] == pytest.approx(98.5 / 97.0)
    assert f["generation"]["vs_llama_bench"] == pytest.approx(0.985)
