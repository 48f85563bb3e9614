"""The GGUF writer and the tiny models the rest of the suite runs against.

If these fail, every black-box test that needs a model fails with it, so they
pin the two things those tests rely on: files libllama accepts, and exactly
the FIM tokens each factory promises.
"""

import pytest

from offgrid.request import SamplingParams
from offgrid.engine.session import ChatSession, GenerationParams

try:
    from .serverproc import TEST_THREADS
except ImportError:
    from serverproc import TEST_THREADS

try:
    from . import gguf, tinymodels
except ImportError:  # tests/ is on sys.path rather than a package
    import gguf
    import tinymodels

V = gguf.ValueType


# --------------------------------------------------------------------------
# The writer and reader
# --------------------------------------------------------------------------

# One value of every type, with floats that float32 represents exactly.
EVERY_TYPE = {
    "t.u8": gguf.Value(V.UINT8, 255),
    "t.i8": gguf.Value(V.INT8, -128),
    "t.u16": gguf.Value(V.UINT16, 65535),
    "t.i16": gguf.Value(V.INT16, -32768),
    "t.u32": gguf.uint32(4096),
    "t.i32": gguf.int32(-7),
    "t.f32": gguf.float32(-2.25),
    "t.bool": gguf.boolean(True),
    "t.str": gguf.string("naïve <fim_prefix> \u2581tok"),
    "t.u64": gguf.Value(V.UINT64, 2 ** 63 + 5),
    "t.i64": gguf.Value(V.INT64, -(2 ** 40)),
    "t.f64": gguf.Value(V.FLOAT64, 1e-300),
    "t.strings": gguf.array_of(V.STRING, ["a", "", "Ġ Ġ", "\U0001f600"]),
    "t.ints": gguf.array_of(V.INT32, [3, -1, 0, 2 ** 31 - 1]),
    "t.floats": gguf.array_of(V.FLOAT32, [0.5, -0.0, 1e10]),
    "t.bools": gguf.array_of(V.BOOL, [True, False]),
    "t.empty": gguf.array_of(V.UINT32, []),
}


def test_metadata_of_every_type_reads_back_as_written(tmp_path):
    w = gguf.Writer()
    for key, value in EVERY_TYPE.items():
        w.add(key, value)
    w.write(tmp_path / "m.gguf")

    f = gguf.read(tmp_path / "m.gguf")

    assert f.version == 3
    assert list(f.metadata) == list(EVERY_TYPE)  # order kept
    assert f.metadata == EVERY_TYPE
    assert f.tensors == []


def test_tensors_read_back_at_aligned_offsets_with_their_data(tmp_path):
    # Sizes that are not multiples of 32 bytes, so padding must be inserted.
    a = [0.25 * i for i in range(3 * 5)]
    b = [1.0, -0.5, 65504.0]
    w = gguf.Writer()
    w.add("general.architecture", gguf.string("test"))
    w.add_tensor("a", (3, 5), gguf.TensorType.F32, gguf.f32_bytes(a))
    w.add_tensor("b", (3,), gguf.TensorType.F16, gguf.f16_bytes(b))
    w.write(tmp_path / "t.gguf")

    f = gguf.read(tmp_path / "t.gguf")

    assert f.tensors == [
        gguf.TensorInfo("a", (3, 5), gguf.TensorType.F32, 0),
        gguf.TensorInfo("b", (3,), gguf.TensorType.F16, 64),  # 60 bytes padded to 64
    ]
    assert f.data_offset % 32 == 0
    assert f.tensor_bytes(f.tensor("a")) == gguf.f32_bytes(a)
    assert f.tensor_bytes(f.tensor("b")) == gguf.f16_bytes(b)
    size = (tmp_path / "t.gguf").stat().st_size
    assert size == f.data_offset + 64 + 32  # the last tensor is padded too


def test_general_alignment_sets_the_padding(tmp_path):
    w = gguf.Writer()
    w.add("general.alignment", gguf.uint32(256))
    w.add_tensor("x", (4,), gguf.TensorType.F32, gguf.f32_bytes([1, 2, 3, 4]))
    w.add_tensor("y", (4,), gguf.TensorType.F32, gguf.f32_bytes([5, 6, 7, 8]))
    w.write(tmp_path / "a.gguf")

    f = gguf.read(tmp_path / "a.gguf")

    assert f.alignment == 256
    assert f.data_offset % 256 == 0
    assert [t.offset for t in f.tensors] == [0, 256]
    assert f.tensor_bytes(f.tensor("y")) == gguf.f32_bytes([5, 6, 7, 8])


def test_tensor_data_of_the_wrong_size_is_refused():
    w = gguf.Writer()
    with pytest.raises(ValueError):
        w.add_tensor("x", (4, 2), gguf.TensorType.F16, gguf.f16_bytes([0.0] * 4))


def test_a_vocab_file_rewrites_byte_for_byte(llama_src, tmp_path):
    vocab = tinymodels.vocab_path()
    w = gguf.Writer()
    for key, value in gguf.read(vocab).metadata.items():
        w.add(key, value)
    w.write(tmp_path / "copy.gguf")

    assert (tmp_path / "copy.gguf").read_bytes() == vocab.read_bytes()


# --------------------------------------------------------------------------
# The tiny models
# --------------------------------------------------------------------------

def test_a_model_is_built_once_and_then_reused(tiny_dir):
    first = tinymodels.fim_model(tiny_dir)
    mtime = first.stat().st_mtime_ns

    again = tinymodels.fim_model(tiny_dir)

    assert again == first
    assert again.stat().st_mtime_ns == mtime


def test_each_variant_has_its_own_file(fim_model_path, fim_norepo_model_path, plain_model_path):
    assert len({fim_model_path, fim_norepo_model_path, plain_model_path}) == 3


def test_the_same_recipe_builds_the_same_bytes(plain_model_path, tmp_path):
    assert tinymodels.plain_model(tmp_path).read_bytes() == plain_model_path.read_bytes()


def test_model_files_carry_the_starcoder_tokenizer(fim_model_path):
    vocab = gguf.read(tinymodels.vocab_path()).metadata
    meta = gguf.read(fim_model_path).metadata

    assert meta["general.architecture"].value == "llama"
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        assert meta[key] == vocab[key]


def _fim_ids(m):
    return (m.fim_pre, m.fim_suf, m.fim_mid, m.fim_pad, m.fim_rep, m.fim_sep)


def test_fim_model_has_all_six_fim_tokens(fim_model):
    assert _fim_ids(fim_model) == (1, 3, 2, 4, 5, 6)
    assert fim_model.n_vocab == 49152
    assert fim_model.n_ctx_train == 4096


def test_fim_model_without_repo_tokens_lacks_only_rep_and_sep(fim_norepo_model):
    assert _fim_ids(fim_norepo_model) == (1, 3, 2, 4, None, None)


def test_plain_model_has_no_fim_tokens(plain_model):
    assert _fim_ids(plain_model) == (None,) * 6
    # The old token text is now ordinary text, not a special token.
    assert plain_model.tokenize("<fim_prefix>", add_special=False, parse_special=True) != [1]


def _greedy(m, prompt, n, n_batch):
    """Greedy continuation of ``prompt``, evaluated in chunks of ``n_batch`` tokens."""
    params = GenerationParams(n_predict=n, sampling=SamplingParams(temperature=0))
    with ChatSession(m, n_ctx=256, n_batch=n_batch, n_threads=TEST_THREADS) as session:
        return session.complete(prompt, params).tokens


def test_greedy_decoding_is_deterministic_and_runs_without_stopping(fim_model):
    m = fim_model
    prompt = m.tokenize("<fim_prefix>def add(a, b):\n    <fim_suffix>\n    return c\n<fim_middle>",
                        add_special=False, parse_special=True)
    batched = _greedy(m, prompt, 12, n_batch=64)
    stepwise = _greedy(m, prompt, 12, n_batch=1)

    assert batched == stepwise
    assert len(batched) == 12  # no end-of-generation token chosen
    assert len(set(batched)) > 1  # not stuck repeating one token
