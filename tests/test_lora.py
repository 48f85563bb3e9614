"""LoRA adapters (--lora, --lora-scaled, GET/POST /lora-adapters, a request's lora).

The adapters are written by the tests (tests/loras.py: rank-2 pairs of
chosen weights for the tiny plain model), and so are the models with them
merged in: the model with an adapter at scale s must give, token for token,
the greedy text of the model whose weights are W + s B A, served by a
reference server of its own.  One server with two adapters (-np 3, scales
starting at 0) serves every test; a test that changes the global scales sets
them back.
"""

import os
import subprocess
import sys
import threading

import pytest

try:
    from . import loras, tinymodels
    from .serverproc import ServerProcess
except ImportError:  # tests/ on sys.path
    import loras
    import tinymodels
    from serverproc import ServerProcess

from offgrid.engine import statecache

SHORT = "def fibonacci(n):"
# more than statecache.MIN_TOKENS tokens: kept states and slot files hold it
LONG = ("The following is a long account of a walk through the hills above the town, "
        "written down the same evening so that nothing of it would be forgotten: the "
        "path, the weather, the birds, and the people met on the way back home.")
N = 12


@pytest.fixture(scope="module")
def files(tiny_dir, tmp_path_factory):
    """The base model, adapters a (seed 1) and b (seed 2), and a folder of the
    base model with each merged in: a at 0.5, b at 1.0."""
    base = tinymodels.plain_model(tiny_dir)
    a, b = loras.adapter(tiny_dir, 1), loras.adapter(tiny_dir, 2)
    ref = tmp_path_factory.mktemp("merged")
    os.symlink(loras.merged(tiny_dir, 1, 0.5), ref / "merged-a.gguf")
    os.symlink(loras.merged(tiny_dir, 2, 1.0), ref / "merged-b.gguf")
    return {"base": base, "a": a, "b": b, "ref": ref,
            "slots": tmp_path_factory.mktemp("slots")}


@pytest.fixture(scope="module")
def srv(files):
    with ServerProcess(files["base"], "--lora-scaled", "%s:0.5" % files["a"],
                       "--lora", files["b"], "--lora-init-without-apply", "-np", "3",
                       "--slot-save-path", files["slots"]) as s:
        yield s


@pytest.fixture(scope="module")
def ref(files):
    """The base model (the default) and the merged ones (by name), no adapters."""
    with ServerProcess(files["base"], "--models-dir", files["ref"]) as s:
        yield s


def complete(s, prompt, n=N, **body):
    status, _, out = s.post("/completion", dict(prompt=prompt, n_predict=n, temperature=0,
                                                **body))
    assert status == 200, out
    return out


def text(s, prompt, n=N, **body):
    return complete(s, prompt, n, **body)["content"]


_expected = {}


def expected(ref, prompt, which, n=N):
    """The reference server's text: "base", "a" (a merged at 0.5), "b" (b at 1.0)."""
    key = (prompt, which, n)
    if key not in _expected:
        model = {"a": "merged-a", "b": "merged-b"}.get(which)
        _expected[key] = text(ref, prompt, n, **({"model": model} if model else {}))
    return _expected[key]


A = [{"id": 0, "scale": 0.5}]
B = [{"id": 1, "scale": 1.0}]
NONE = [{"id": 0, "scale": 0}]


def set_global(s, scales):
    status, _, out = s.post("/lora-adapters", scales)
    assert (status, out) == (200, {"success": True})


# -- the listing and the flags ------------------------------------------------------------

def test_lists_the_adapters_with_their_global_scales(srv, files):
    status, _, out = srv.get("/lora-adapters")
    assert status == 200
    assert out == [{"id": 0, "path": str(files["a"]), "scale": 0.0, "task_name": "",
                    "prompt_prefix": ""},
                   {"id": 1, "path": str(files["b"]), "scale": 0.0, "task_name": "",
                    "prompt_prefix": ""}]


def test_a_post_sets_the_global_scales_and_leaves_out_means_zero(srv):
    try:
        set_global(srv, [{"id": 1, "scale": 0.25}, {"id": 7, "scale": 3}])
        assert [a["scale"] for a in srv.get("/lora-adapters")[2]] == [0.0, 0.25]
        set_global(srv, [{"id": 0, "scale": 0.5}])
        assert [a["scale"] for a in srv.get("/lora-adapters")[2]] == [0.5, 0.0]
    finally:
        set_global(srv, [])


def test_both_forms_of_lora_scaled_parse(files):
    from offgrid.flags import parse_args
    args = parse_args(["-m", str(files["base"]), "--lora", "%s,%s" % (files["a"], files["b"]),
                       "--lora-scaled", str(files["a"]), "0.25",
                       "--lora-scaled", "%s:-1.5" % files["b"]])
    assert args.lora_specs == [(str(files["a"]), 1.0), (str(files["b"]), 1.0),
                               (str(files["a"]), 0.25), (str(files["b"]), -1.5)]


# -- what an adapter does to the text -------------------------------------------------------

def test_an_adapter_gives_the_text_of_its_weights_merged(srv, ref):
    out = complete(srv, SHORT, lora=A)
    assert out["content"] == expected(ref, SHORT, "a")
    # the scales it ran with, every adapter's, as llama-server's generation_settings
    assert out["generation_settings"]["lora"] == [{"id": 0, "scale": 0.5},
                                                  {"id": 1, "scale": 0.0}]
    assert text(srv, SHORT, lora=B) == expected(ref, SHORT, "b")
    # the adapters change the text at all (else the test above proves nothing)
    assert expected(ref, SHORT, "a") != expected(ref, SHORT, "base")
    assert expected(ref, SHORT, "b") != expected(ref, SHORT, "base")


def embedding(s, text, **body):
    status, _, out = s.post("/v1/embeddings", dict(input=text, **body))
    assert status == 200, out
    return out["data"][0]["embedding"]


def test_an_embedding_runs_with_the_global_adapters_as_llama_servers_does(srv, ref):
    # llama-server's embedding task has no "lora" of its own: its slot runs with
    # the global scales.  LoRA adds s B (A x) to W x where the merged model has
    # (W + s B A) x: the same numbers, rounded otherwise, so near, not equal
    def distance(u, v):
        return max(abs(x - y) for x, y in zip(u, v))
    base, merged = embedding(ref, LONG), embedding(ref, LONG, model="merged-a")
    assert distance(base, merged) > 1e-2        # the adapter moves the vector
    assert distance(embedding(srv, LONG), base) < 1e-5      # global scales 0
    set_global(srv, A)
    try:
        assert distance(embedding(srv, LONG), merged) < 1e-3
    finally:
        set_global(srv, NONE)
    assert distance(embedding(srv, LONG), base) < 1e-5      # and back


def test_scale_zero_gives_the_base_text(srv, ref):
    assert text(srv, SHORT, lora=NONE) == expected(ref, SHORT, "base")
    assert text(srv, SHORT) == expected(ref, SHORT, "base")     # the global scales: 0


def test_requests_with_different_adapters_at_once_each_get_their_solo_text(srv, ref):
    cases = [("a", A), ("b", B), ("base", NONE)]
    want = {w: expected(ref, LONG, w, 24) for w, _ in cases}
    got = {}
    go = threading.Barrier(len(cases))

    def run(which, lora):
        go.wait()
        got[which] = text(srv, LONG, 24, lora=lora, cache_prompt=False)
    threads = [threading.Thread(target=run, args=c) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == want


# -- caches key on the adapter set ----------------------------------------------------------

def test_a_global_scale_change_is_not_served_from_the_old_cache(srv, ref):
    """llama-server reuses the slot's cache computed at the old scale here."""
    try:
        set_global(srv, [{"id": 0, "scale": 0.5}])
        assert text(srv, LONG, id_slot=0) == expected(ref, LONG, "a")
        again = complete(srv, LONG, id_slot=0)
        assert again["content"] == expected(ref, LONG, "a")
        assert again["timings"]["cache_n"] > 0          # the cache served the repeat
        set_global(srv, [{"id": 0, "scale": 0}])
        assert text(srv, LONG, id_slot=0) == expected(ref, LONG, "base")
    finally:
        set_global(srv, [])


def test_a_kept_state_serves_only_its_adapter_set(srv, ref):
    """Switching adapters on one session keeps its cache as a state of the old set;
    the same prompt under each set gets that set's text."""
    for lora, which in [(A, "a"), (NONE, "base"), (A, "a"), (NONE, "base")]:
        assert text(srv, LONG, id_slot=1, lora=lora) == expected(ref, LONG, which)


def test_a_slot_file_keeps_its_adapter_set(srv, ref):
    assert text(srv, LONG, id_slot=2, lora=A) == expected(ref, LONG, "a")
    status, _, out = srv.post("/slots/2?action=save", {"filename": "with-a.bin"})
    assert status == 200, out
    for lora, which in [(NONE, "base"), (A, "a")]:
        status, _, out = srv.post("/slots/2?action=restore", {"filename": "with-a.bin"})
        assert status == 200, out
        got = complete(srv, LONG, id_slot=2, lora=lora)
        assert got["content"] == expected(ref, LONG, which)
        if which == "a":
            assert got["timings"]["cache_n"] > 0        # the restored cache served it


def test_a_state_of_one_adapter_set_serves_no_other():
    states = statecache.StateCache(1 << 20)
    tokens = list(range(100, 100 + 2 * statecache.MIN_TOKENS))
    key = ((0, 0.5),)
    assert states.put(tokens, bytearray(64), adapters=key)
    assert states.best(tokens + [1], 0, True, 0)[0] is None
    assert states.best(tokens + [1], 0, True, 0, adapters=((0, 1.0),))[0] is None
    found, n = states.best(tokens + [1], 0, True, 0, adapters=key)
    assert found is not None and n == len(tokens)
    assert states.wants(tokens) and not states.wants(tokens, key)


# -- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("lora, message", [
    ("x", "'lora' must be an array of objects with 'id' and 'scale' fields"),
    ([0], "'lora' must be an array of objects with 'id' and 'scale' fields"),
    ([{"id": "0", "scale": 1}], "an adapter's 'id' must be an integer"),
    ([{"id": 0, "scale": "1"}], "an adapter's 'scale' must be a number"),
])
def test_a_bad_lora_field_is_a_400(srv, lora, message):
    status, _, out = srv.post("/completion", {"prompt": SHORT, "n_predict": 1, "lora": lora})
    assert status == 400 and message in out["error"]["message"]


def test_a_post_that_is_not_an_array_is_a_400(srv):
    status, _, out = srv.post("/lora-adapters", {"id": 0, "scale": 1})
    assert status == 400
    assert out["error"]["message"] == "Request body must be an array"
    assert [a["scale"] for a in srv.get("/lora-adapters")[2]] == [0.0, 0.0]


def test_ollama_show_names_the_adapters(srv, files):
    name = os.path.basename(str(files["base"]))
    status, _, out = srv.post("/api/show", {"model": name})
    assert status == 200
    assert "ADAPTER %s\n" % files["a"] in out["modelfile"]
    assert "ADAPTER %s\n" % files["b"] in out["modelfile"]


@pytest.mark.parametrize("make, why", [
    (loras.wrong_shape, "tensor blk.0.attn_q.weight: lora_a [32, 2] and lora_b [2, 32] "
                        "do not fit the model's [64, 64]"),
    (loras.wrong_arch, "it is for architecture 'qwen2', the model is 'llama'"),
    # libllama's own checks pass this one, and ggml aborts at the first decode
    (loras.embd_rank_mismatch, "tensor token_embd.weight: lora_a [2, 49152] and lora_b "
                               "[3, 64] are of different ranks"),
])
def test_an_adapter_for_another_model_is_refused_at_load(files, tiny_dir, make, why):
    bad = make(tiny_dir)
    p = subprocess.run([sys.executable, "-m", "offgrid", "-m", str(files["base"]), "--port",
                        "0", "-t", "1", "--lora", str(bad)],
                       capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert "LoRA adapter %s cannot be used with this model: %s" % (bad.name, why) in out
    assert "SIGABRT" not in out and "Aborted" not in out


def _three_dimensional(path):
    w = loras.gguf.adapter_writer("llama")
    w.add_tensor("blk.0.attn_q.weight.lora_a", (64, 2, 2), loras.gguf.TensorType.F32,
                 loras.gguf.f32_bytes([0.0] * 256))
    w.add_tensor("blk.0.attn_q.weight.lora_b", (2, 64), loras.gguf.TensorType.F32,
                 loras.gguf.f32_bytes([0.0] * 128))
    w.write(path)


def _truncated(path, tiny_dir):
    path.write_bytes(loras.adapter(tiny_dir, 1).read_bytes()[:100])


@pytest.mark.parametrize("case, why", [
    ("model", "it is not an adapter (general.type is '', not 'adapter')"),
    ("truncated", "the GGUF file ends inside its header"),
    ("3d", "tensor blk.0.attn_q.weight.lora_a has 3 dimensions, a pair 2"),
])
def test_the_check_says_what_is_wrong_before_libllama_sees_the_file(files, tiny_dir, tmp_path,
                                                                    case, why):
    from offgrid.engine.adapters import check
    from offgrid.errors import ModelLoadError
    path = tmp_path / "bad.gguf"
    if case == "model":
        path = files["base"]
    elif case == "truncated":
        _truncated(path, tiny_dir)
    else:
        _three_dimensional(path)
    with pytest.raises(ModelLoadError) as e:
        check(str(path), str(files["base"]), "llama")
    assert why in str(e.value)


def test_only_the_base_models_states_go_to_disk(tmp_path):
    from offgrid.engine.statedisk import StateDisk
    ident = {"format": 1, "model": {"file": "test"}, "build": "b", "context": {"n_ctx": 64}}
    disk = StateDisk(str(tmp_path), ident, 1 << 20)
    states = statecache.StateCache(1 << 20, disk)
    base = list(range(100, 100 + 2 * statecache.MIN_TOKENS))
    adapted = list(range(500, 500 + 2 * statecache.MIN_TOKENS))
    assert states.put(base, bytearray(b"b" * 64))
    assert states.put(adapted, bytearray(b"a" * 64), adapters=((0, 0.5),))
    assert states.to_disk() == 1
    assert [tokens for _, tokens, _ in disk.index()] == [base]


def test_rerank_runs_with_the_global_adapters(smollm_path, tmp_path):
    # as embeddings: llama-server's rerank task runs with its server's adapters
    adapter = loras.for_model(smollm_path, tmp_path / "smollm-lora.gguf", seed=3,
                              target="blk.0.attn_q.weight")
    docs = ["A machine is a physical system.", "Machine learning learns from data."]

    def scores(s):
        status, _, body = s.post("/rerank", {"query": "Machine learning is", "documents": docs})
        assert status == 200, body
        return [r["relevance_score"] for r in sorted(body["results"], key=lambda r: r["index"])]

    with ServerProcess(smollm_path, "--reranking", "--lora-scaled", "%s:0" % adapter,
                       threads=1, ctx=512) as s:
        base = scores(s)
        set_global(s, [{"id": 0, "scale": 8.0}])
        moved = scores(s)
        set_global(s, NONE)
        assert scores(s) == base
    assert max(abs(a - b) for a, b in zip(base, moved)) > 1e-3
