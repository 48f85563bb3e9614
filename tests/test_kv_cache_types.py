"""-ctk / -ctv: a KV cache of quantized keys and values, as llama-server's flags.

q8_0 keeps a key or a value in 34 bytes per 32 (f16: 64): on a long context
on the CPU, about half the cache's memory.  What is checked here, on the
default model with a q8_0 cache: a prompt served from the cache, from a kept
state (another prompt in between) and from a slot file goes on with the same
greedy text as the first time; keys moved by a context shift (libllama
dequantizes, rotates and quantizes them again) let a reply run on; a slot
file of one cache type is refused by a server of another with a 400 and the
server goes on; the memory the server reports is the smaller cache's; and
what libllama would refuse with a null context is a clear error first.
(Greedy text on q8_0 and q4_0 caches was the same as llama-server's, same
flags and source, by hand: docs/cli.md.)
"""

import os
import types

import pytest

from offgrid.flags import parse_args
from offgrid.engine.memory import kv_bytes_of, per_layer
from offgrid.engine.model import Model
from offgrid.engine.session import check_cache_types
from offgrid.errors import ContextError
import archmodels
from serverproc import ROOT, ServerProcess

Q8 = ("-ctk", "q8_0", "-ctv", "q8_0")
CODE = (ROOT / "offgrid" / "engine" / "lookup.py").read_text("utf-8")[:1200]
OTHER = (ROOT / "offgrid" / "engine" / "copydraft.py").read_text("utf-8")[:1200]


def greedy(server, prompt, n=12, **kw):
    status, _, out = server.post("/completion", dict(
        {"prompt": prompt, "n_predict": n, "temperature": 0}, **kw))
    assert status == 200, out
    return out


@pytest.fixture(scope="module")
def slots(tmp_path_factory):
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def q8(qwen_path, slots):
    with ServerProcess(qwen_path, *Q8, "-np", "1", "--cache-ram", "64",
                       "--slot-save-path", slots, ctx=1024) as s:
        yield s


def test_a_prompt_from_the_cache_a_kept_state_or_a_slot_file_goes_on_the_same(q8):
    first = greedy(q8, CODE)
    again = greedy(q8, CODE)
    assert again["content"] == first["content"]
    assert again["timings"]["cache_n"] >= first["timings"]["prompt_n"] - 1
    status, _, saved = q8.post("/slots/0?action=save", {"filename": "code.bin"})
    assert status == 200 and saved["n_saved"] > 300, saved
    greedy(q8, OTHER)                   # the session now holds another prompt
    kept = greedy(q8, CODE)             # restored from the state kept in RAM
    assert kept["timings"]["cache_n"] > 300, kept["timings"]
    assert kept["content"] == first["content"]
    greedy(q8, OTHER)
    status, _, restored = q8.post("/slots/0?action=restore", {"filename": "code.bin"})
    assert status == 200 and restored["n_restored"] == saved["n_saved"], restored
    from_file = greedy(q8, CODE)
    assert from_file["timings"]["cache_n"] > 300, from_file["timings"]
    assert from_file["content"] == first["content"]


def test_a_context_shift_moves_quantized_keys_and_the_reply_runs_on(qwen_path):
    with ServerProcess(qwen_path, *Q8, "--context-shift", ctx=256) as s:
        out = greedy(s, "Count: 1, 2, 3, 4, 5,", n=260, ignore_eos=True)
    assert out["tokens_predicted"] == 260, out["timings"]
    assert out["truncated"] is True


def test_a_slot_file_of_another_cache_type_is_a_400_and_the_server_goes_on(q8, qwen_path,
                                                                          slots):
    greedy(q8, CODE)
    status, _, saved = q8.post("/slots/0?action=save", {"filename": "q8.bin"})
    assert status == 200, saved
    with ServerProcess(qwen_path, "--slot-save-path", slots, ctx=1024) as f16:
        status, _, out = f16.post("/slots/0?action=restore", {"filename": "q8.bin"})
        assert status == 400, out
        assert out["error"]["type"] == "invalid_request_error"
        assert greedy(f16, CODE, n=4)["tokens_predicted"] == 4
        _, _, ps16 = f16.get("/api/ps")
    _, _, ps8 = q8.get("/api/ps")
    # /api/ps: the model's file and its KV cache; q8_0's is 34/64 of f16's
    file_size = os.path.getsize(qwen_path)
    kv16 = ps16["models"][0]["size"] - file_size
    kv8 = ps8["models"][0]["size"] - file_size
    assert kv16 > 0 and abs(kv8 - kv16 * 34 / 64) <= 1, (kv8, kv16)


def test_the_sizes_of_each_type():
    meta = {"general.architecture": "llama", "llama.block_count": "2",
            "llama.embedding_length": "256", "llama.attention.head_count": "4",
            "llama.attention.head_count_kv": "2"}
    f16 = kv_bytes_of(meta, 100)
    assert f16 == 2 * 2 * (64 + 64) * 2 * 100
    assert kv_bytes_of(meta, 100, "q8_0", "q8_0") == f16 * 34 // 64
    assert kv_bytes_of(meta, 100, "q4_0", "f32") == 2 * 2 * (64 * 18 // 32 + 64 * 4) * 100


def fake_model(**meta):
    meta = dict({"general.architecture": "x"}, **meta)
    return types.SimpleNamespace(name="m.gguf", meta=meta, kv_meta=meta)


def test_what_libllama_would_refuse_is_a_clear_error_first():
    heads_of_80 = fake_model(**{"x.embedding_length": "2560", "x.attention.head_count": "32"})
    with pytest.raises(ContextError, match="do not divide"):
        check_cache_types(heads_of_80, "q8_0", "f16", True)
    check_cache_types(heads_of_80, "q8_0", "f16", False)    # without flash attention: any
    with pytest.raises(ContextError, match="needs flash attention"):
        check_cache_types(fake_model(), "f16", "q8_0", False)
    latent = fake_model(**{"x.attention.kv_lora_rank": "512"})
    with pytest.raises(ContextError, match="same type"):
        check_cache_types(latent, "q8_0", "f16", True)
    check_cache_types(latent, "q8_0", "q8_0", True)


def test_per_layer_head_counts_and_sliding_window_head_sizes_are_read():
    # Jamba's, Nemotron-H's head counts: one per layer, none in a recurrent one
    hybrid = {"general.architecture": "x", "x.block_count": "3", "x.embedding_length": "256",
              "x.attention.head_count": [4, 0, 4], "x.attention.head_count_kv": [2, 0, 2]}
    assert kv_bytes_of(hybrid, 100) == 2 * (2 * (64 + 64) * 2) * 100
    check_cache_types(fake_model(**hybrid), "q8_0", "q8_0", True)
    with pytest.raises(ContextError, match="heads of 50"):
        check_cache_types(fake_model(**dict(hybrid, **{"x.embedding_length": "200"})),
                          "q8_0", "f16", True)
    # Gemma 4's sliding-window layers have heads of their own size: each is checked
    swa = fake_model(**{"x.embedding_length": "256", "x.attention.head_count": "4",
                        "x.attention.key_length_swa": "48"})
    check_cache_types(swa, "f16", "q8_0", True)
    with pytest.raises(ContextError, match="heads of 48"):
        check_cache_types(swa, "q8_0", "f16", True)


def test_a_per_layer_head_count_libllama_leaves_out_is_read_from_the_file(tiny_dir):
    # libllama's metadata has no arrays: the KV cache's size would count every layer,
    # the recurrent one too, at one head each
    model = Model.load(str(archmodels.build("nemotron_h", tiny_dir)), progress=False)
    try:
        assert "nemotron_h.attention.head_count_kv" not in model.meta
        n_layer = int(model.meta["nemotron_h.block_count"])
        heads = per_layer(model.kv_meta, "nemotron_h.attention.head_count_kv", n_layer)
        k_len = int(model.meta["nemotron_h.attention.key_length"])
        v_len = int(model.meta["nemotron_h.attention.value_length"])
        size = kv_bytes_of(model.kv_meta, 100)
    finally:
        model.close()
    assert heads == [0 if i == 1 else archmodels.N_HEAD for i in range(n_layer)]
    assert size == sum(heads) * (k_len + v_len) * 2 * 100


def test_an_override_of_a_per_layer_array_is_refused(tiny_dir):
    from offgrid.engine.model import _check_kv_overrides
    from offgrid.errors import ModelLoadError
    path = archmodels.build("nemotron_h", tiny_dir)
    with pytest.raises(ModelLoadError, match="is an array"):
        _check_kv_overrides(path, [("nemotron_h.attention.head_count", "int", 2)])
    _check_kv_overrides(path, [("nemotron_h.block_count", "int", 3)])


def test_the_flags_are_llama_servers(capsys):
    args = parse_args(["-m", "x.gguf", "-ctk", "q8_0", "--cache-type-v", "q4_0"])
    assert (args.cache_type_k, args.cache_type_v) == ("q8_0", "q4_0")
    with pytest.raises(SystemExit):
        parse_args(["-m", "x.gguf", "-ctv", "q8_0", "-fa", "off"])
    assert "needs flash attention" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["-m", "x.gguf", "-ctk", "q3_k"])
