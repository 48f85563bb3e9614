"""Control vectors (--control-vector, --control-vector-scaled, --control-vector-layer-range,
and the preset keys of the same names).

The vectors are written by the tests (tests/controlvectors.py: seeded
``direction.1`` vectors for the tiny plain model), and so are the models that
carry the same numbers as a bias of layer 1's feed-forward output, which
llama.cpp adds just before the residual add that the control vector follows:
the model under a vector v at scale s must give, token for token, the greedy
text of the model whose blk.1.ffn_down.bias is s v, served without a vector.

Two servers serve most tests: ``srv`` takes the flags (``-m`` with
``--control-vector``), ``ref`` serves the plain model, the biased references
(a folder) and, through a preset, the plain model's file again under other
vectors (links to it, one per section: a model is one per path).
"""

import os
import subprocess
import sys

import pytest

try:
    from . import controlvectors, tinymodels
    from .serverproc import ROOT, ServerProcess
except ImportError:  # tests/ on sys.path
    import controlvectors
    import tinymodels
    from serverproc import ROOT, ServerProcess

SHORT = "def fibonacci(n):"
# more than statecache.MIN_TOKENS tokens: slot files and states on disk hold it
LONG = ("The following is a long account of a walk through the hills above the town, "
        "written down the same evening so that nothing of it would be forgotten: the "
        "path, the weather, the birds, and the people met on the way back home.")
N = 12


@pytest.fixture(scope="module")
def files(tiny_dir, tmp_path_factory):
    """The plain model, vectors one (seed 1) and two (seed 2) for layer 1, and a
    folder of references: the plain model with layer 1 biased by one at 1.0, and by
    one at 0.5 plus two at -1.5."""
    base = tinymodels.plain_model(tiny_dir)
    refs = tmp_path_factory.mktemp("cvec-refs")
    os.symlink(controlvectors.biased(tiny_dir, {1: [(1, 1.0)]}), refs / "ref-one.gguf")
    os.symlink(controlvectors.biased(tiny_dir, {1: [(1, 0.5), (2, -1.5)]}),
               refs / "ref-sum.gguf")
    return {"base": base, "one": controlvectors.vector(tiny_dir, 1),
            "two": controlvectors.vector(tiny_dir, 2), "refs": refs,
            "slots": tmp_path_factory.mktemp("cvec-slots")}


@pytest.fixture(scope="module")
def srv(files):
    with ServerProcess(files["base"], "--control-vector", files["one"], "-np", "2",
                       "--slot-save-path", files["slots"]) as s:
        yield s


PRESET = """
[cv-one]
model = {links}/one.gguf
control-vector = {one}

[cv-sum]
model = {links}/sum.gguf
control-vector-scaled = {one}:0.5,{two}:-1.5

[cv-zero]
model = {links}/zero.gguf
control-vector-scaled = {one}:0

[cv-past]
model = {links}/past.gguf
control-vector = {one}
control-vector-layer-range = 2 2
"""


@pytest.fixture(scope="module")
def ref(files, tmp_path_factory):
    """The plain model (the default), the references by name (ref-one, ref-sum), and
    the plain model under a preset's vectors (cv-one, cv-sum, cv-zero, cv-past)."""
    links = tmp_path_factory.mktemp("cvec-links")
    for name in ("one", "sum", "zero", "past"):
        os.symlink(files["base"], links / ("%s.gguf" % name))
    ini = links / "models.ini"
    ini.write_text(PRESET.format(links=links, one=files["one"], two=files["two"]))
    with ServerProcess(files["base"], "--models-dir", files["refs"], "--models-preset", ini,
                       "--slot-save-path", files["slots"]) as s:
        yield s


def complete(s, prompt, n=N, **body):
    status, _, out = s.post("/completion", dict(prompt=prompt, n_predict=n, temperature=0,
                                                **body))
    assert status == 200, out
    return out


def text(s, prompt, n=N, **body):
    return complete(s, prompt, n, **body)["content"]


_expected = {}


def expected(ref, prompt, model=None):
    """The reference server's text of ``model`` (None: the plain model)."""
    key = (prompt, model)
    if key not in _expected:
        _expected[key] = text(ref, prompt, **({"model": model} if model else {}))
    return _expected[key]


# -- what a vector does to the text ---------------------------------------------------------

def test_a_vector_gives_the_text_of_its_numbers_as_a_layer_bias(srv, ref):
    assert text(srv, SHORT) == expected(ref, SHORT, "ref-one")
    assert text(srv, LONG) == expected(ref, LONG, "ref-one")
    # the vector changes the text at all (else the test above proves nothing)
    assert expected(ref, SHORT, "ref-one") != expected(ref, SHORT)
    assert any("control vector %s x 1, layers 1-1" % os.path.basename(srv.args[
        srv.args.index("--control-vector") + 1]) in line for line in srv.output)


def test_a_preset_gives_its_model_a_vector_of_its_own(ref):
    assert text(ref, SHORT, model="cv-one") == expected(ref, SHORT, "ref-one")


def test_two_vectors_are_summed_with_their_scales(ref):
    assert text(ref, SHORT, model="cv-sum") == expected(ref, SHORT, "ref-sum")
    assert expected(ref, SHORT, "ref-sum") != expected(ref, SHORT, "ref-one")


def test_scale_zero_gives_the_plain_text(ref):
    assert text(ref, SHORT, model="cv-zero") == expected(ref, SHORT)


def test_a_layer_range_without_the_vectors_layer_gives_the_plain_text(ref):
    # the tiny model has layers 0 and 1, and a vector never goes to layer 0
    assert text(ref, SHORT, model="cv-past") == expected(ref, SHORT)


def test_models_lists_a_presets_vector_keys(ref, files):
    status, _, body = ref.get("/models")
    assert status == 200
    preset = {m["id"]: m["status"].get("preset", "") for m in body["data"]}
    assert "control-vector-scaled = %s:0.5,%s:-1.5\n" % (files["one"], files["two"]) \
        in preset["cv-sum"]
    assert "control-vector-layer-range = 2 2\n" in preset["cv-past"]


def test_embeddings_run_with_the_vector(srv, ref):
    # llama-server's one context embeds with its vector too
    def embedding(s, **body):
        status, _, out = s.post("/v1/embeddings", dict(input=LONG, **body))
        assert status == 200, out
        return out["data"][0]["embedding"]
    got, want = embedding(srv), embedding(ref, model="ref-one")
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    assert max(abs(a - b) for a, b in zip(got, embedding(ref))) > 1e-3


# -- caches key on the vector -----------------------------------------------------------

def test_a_slot_file_restores_only_under_the_same_vector(srv, ref):
    assert text(srv, LONG, id_slot=0) == expected(ref, LONG, "ref-one")
    status, _, out = srv.post("/slots/0?action=save", {"filename": "under-one.bin"})
    assert status == 200, out
    # the same numbers in another server (a preset's): restored, and they serve
    status, _, out = ref.post("/slots/0?action=restore&model=cv-one",
                              {"filename": "under-one.bin"})
    assert status == 200, out
    again = complete(ref, LONG, model="cv-one")
    assert again["content"] == expected(ref, LONG, "ref-one")
    assert again["timings"]["cache_n"] > 0
    # none, or another vector: refused, saying why
    for model, why in ((None, "the slot was saved under a control vector, and this server "
                              "runs none"),
                       ("cv-sum", "the slot was saved under another control vector than "
                                  "this server's")):
        path = "/slots/0?action=restore" + ("&model=%s" % model if model else "")
        status, _, out = ref.post(path, {"filename": "under-one.bin"})
        assert status == 400 and why in out["error"]["message"], out
    assert text(ref, LONG) == expected(ref, LONG)


def test_states_on_disk_serve_only_a_worker_of_the_same_vector(files, tmp_path):
    flags = ("--cache-dir", str(tmp_path))
    with ServerProcess(files["base"], "--control-vector", files["one"], *flags) as s:
        first = complete(s, LONG)
    with ServerProcess(files["base"], *flags) as s:
        plain = complete(s, LONG)
        assert plain["timings"]["cache_n"] == 0
    with ServerProcess(files["base"], "--control-vector", files["one"], *flags) as s:
        again = complete(s, LONG)
    assert again["timings"]["cache_n"] > 0 and again["content"] == first["content"]
    assert plain["content"] != first["content"]


# -- the flags ------------------------------------------------------------------------------

def test_the_flags_read_as_llama_servers(files):
    from offgrid.flags import parse_args
    from offgrid.server.models.launch import model_args, worker_settings
    from offgrid.server.models.entry import ModelEntry
    one, two = str(files["one"]), str(files["two"])
    args = parse_args(["-m", str(files["base"]), "--control-vector", "%s,%s" % (one, two),
                       "--control-vector-scaled", "%s:0.25" % one,
                       "--control-vector", two, "--control-vector-layer-range", "1", "-1"])
    assert args.control_vectors == [[one, 1.0], [two, 1.0], [one, 0.25], [two, 1.0]]
    s = worker_settings(str(files["base"]),
                        model_args(ModelEntry(id="m", path=str(files["base"])), args))
    assert s.control_vectors == args.control_vectors and s.control_vector_layers == [1, -1]


@pytest.mark.parametrize("argv, message", [
    (["--control-vector-scaled", "a.gguf"], "--control-vector-scaled a.gguf: give FNAME:SCALE"),
    (["--control-vector-scaled", "a.gguf:x"], "the scale 'x' is not a number"),
    (["--control-vector", "a.gguf", "--control-vector-layer-range", "2", "1"],
     "START is past END"),
])
def test_a_flag_that_does_not_read_stops_the_start(files, capsys, argv, message):
    from offgrid.flags import parse_args
    with pytest.raises(SystemExit):
        parse_args(["-m", str(files["base"])] + argv)
    assert message in capsys.readouterr().err


# -- bad files ------------------------------------------------------------------------------

def _bad(files, tiny_dir, kind):
    return {"missing": tiny_dir / "no-such-vector.gguf", "model": files["base"]}.get(kind) \
        or controlvectors.bad(tiny_dir, kind)


@pytest.mark.parametrize("kind, why", [
    ("missing", "no such file"),
    ("n_embd", "its vectors have 32 values, the model's layers 64 (a control vector for "
               "another model)"),
    ("f16", "tensor direction.1 has ggml type 1, not F32 (0)"),
    ("layer0", "tensor direction.0: layer 0 takes no control vector"),
    ("arch", "it is a control vector for a model of architecture 'qwen2', the model is "
             "'llama'"),
    ("model", "tensor blk.0.attn_k.weight is not a direction.<layer>"),
    ("empty", "it holds no direction tensors"),
])
def test_a_file_that_cannot_be_used_is_refused_before_libllama_sees_it(
        files, tiny_dir, plain_model, kind, why):
    from offgrid.engine.controlvector import ControlVector
    from offgrid.errors import ModelLoadError
    bad = _bad(files, tiny_dir, kind)
    with pytest.raises(ModelLoadError) as e:
        ControlVector.load(plain_model, [[str(files["one"]), 1.0], [str(bad), 0.5]])
    assert str(e.value) == "--control-vector %s: %s" % (bad, why)


def test_a_file_cut_short_is_refused_not_read_past_its_end(files, plain_model, tmp_path):
    from offgrid.engine.controlvector import ControlVector
    from offgrid.errors import ModelLoadError
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(files["one"].read_bytes()[:-100])
    with pytest.raises(ModelLoadError) as e:
        ControlVector.load(plain_model, [[str(cut), 1.0]])
    assert str(e.value) == ("--control-vector: %s: tensor direction.1's data lies outside "
                            "the file" % cut)


def test_a_file_for_another_model_stops_the_start_saying_why(files, tiny_dir):
    # libllama itself would log it and serve on without the vector (llama-server's way)
    bad = controlvectors.bad(tiny_dir, "n_embd")
    p = subprocess.run([sys.executable, "-m", "offgrid", "-m", str(files["base"]), "--port",
                        "0", "-t", "1", "--control-vector-scaled", "%s:0.5" % bad],
                       capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert "--control-vector %s: its vectors have 32 values, the model's layers 64" % bad in out
    assert "SIGABRT" not in out and "Aborted" not in out
