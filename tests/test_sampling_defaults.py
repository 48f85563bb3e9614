"""A model's sampling defaults: its file's general.sampling.*, its preset's, the flags'.

convert_hf_to_gguf.py writes a model's generation_config.json into its GGUF
(``general.sampling.temp``, ``top_k``, ``top_p``, ...), and llama-server
samples with those where a request says nothing, unless a flag given on its
command line says otherwise (common_init_sampler_from_model).  The served
file here is the tiny test model with such keys written into it.
"""

import pytest

import gguf
from offgrid.flags import parse_args
from offgrid.request import SamplingParams
from offgrid.server.models import sampling
from serverproc import ServerProcess

# what the file says (top_k 1: every sampled token is the most likely one)
FILE_KEYS = {"top_k": gguf.int32(1), "temp": gguf.float32(1.5), "top_p": gguf.float32(0.9),
             "penalty_last_n": gguf.int32(32)}


def with_sampling(src, dst, keys):
    return gguf.with_metadata(src, dst, {"general.sampling." + k: v for k, v in keys.items()})


# -- the order, without a model -------------------------------------------------------------

META = {"general.sampling.top_k": "1", "general.sampling.temp": "1.500000",
        "general.sampling.top_p": "0.900000", "general.sampling.mirostat": "2",
        "general.sampling.min_p": "many", "general.sampling.sequence": "top_k;temperature"}


def test_the_file_gives_its_settings_and_says_what_does_not_read():
    got, notes = sampling.from_file(META)
    assert got == {"top_k": 1, "temperature": 1.5, "top_p": 0.9, "mirostat": 2,
                   "samplers": ("top_k", "temperature")}
    assert len(notes) == 1 and "general.sampling.min_p" in notes[0], notes


def test_the_preset_wins_over_the_file_and_a_given_flag_over_both():
    preset = {"sampling.top_k": 3, "sampling.min_p": 0.2, "ctx_size": 512}
    flags = parse_args(["-m", "x.gguf", "--min-p", "0.1", "--seed", "7"]).sampling
    got, _ = sampling.model_defaults(META, preset, flags)
    want = SamplingParams(top_k=3, temperature=1.5, top_p=0.9, min_p=0.1, seed=7, mirostat=2,
                          samplers=("top_k", "temperature"))
    assert got == want
    # a flag not given does not hide the file's value behind llama-server's default
    assert parse_args(["-m", "x.gguf"]).sampling == {}


@pytest.mark.parametrize("argv,what", [
    (["--mirostat", "3"], "mirostat"), (["--dry-multiplier", "0.5"], "DRY"),
    (["--samplers", "top_k;magic"], "magic"), (["--repeat-penalty", "0"], "repeat_penalty"),
])
def test_a_flag_offgrid_cannot_honour_is_an_error_at_start(argv, what, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["-m", "x.gguf"] + argv)
    assert e.value.code == 2
    assert what in capsys.readouterr().err


def test_the_samplers_off_and_their_parameters_are_taken_as_llama_servers_defaults():
    args = parse_args(["-m", "x.gguf", "--mirostat", "0", "--dry-multiplier", "0",
                       "--dry-sequence-breaker", "none", "--xtc-threshold", "0.1",
                       "--top-n-sigma", "-1", "--sampling-seq", "kt", "--temperature", "0.6"])
    assert args.sampling == {"samplers": ("top_k", "temperature"), "temperature": 0.6,
                             "mirostat": 0, "xtc_threshold": 0.1, "top_n_sigma": -1.0}


# -- served --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory, plain_model_path, smollm_path):
    """-m: the file with sampling keys, and --top-p given; a preset's model: the
    plain file with keys of its own."""
    d = tmp_path_factory.mktemp("sampling-defaults")
    keyed = with_sampling(plain_model_path, d / "keyed.gguf", FILE_KEYS)
    preset = d / "models.ini"
    preset.write_text("[plain]\nmodel = %s\ntop-k = 3\nmin-p = 0.2\ntop-p = 0.5\n" % smollm_path)
    with ServerProcess(keyed, "--models-preset", preset, "--top-p", "0.8", "-np", "1",
                       ctx=512) as server:
        yield server


def settings_of(server, model=None, **body):
    body = dict({"prompt": "Once upon a time", "n_predict": 12}, **body)
    if model:
        body["model"] = model
    status, _, out = server.post("/completion", body)
    assert status == 200, out
    return out["generation_settings"], out["content"]


def test_a_request_that_says_nothing_samples_with_the_files_keys_under_the_flags(served):
    s, _ = settings_of(served)
    assert (s["top_k"], s["temperature"], s["repeat_last_n"]) == (1, 1.5, 32)
    assert s["top_p"] == pytest.approx(0.8)          # the flag, over the file's 0.9
    assert s["min_p"] == pytest.approx(0.05)         # neither says: llama-server's
    status, _, props = served.get("/props")
    assert status == 200
    params = props["default_generation_settings"]["params"]
    assert (params["top_k"], params["temperature"]) == (1, 1.5)


def test_the_files_top_k_makes_every_seed_the_greedy_text(served):
    _, greedy = settings_of(served, temperature=0)
    texts = {settings_of(served, seed=seed)[1] for seed in (1, 2, 3)}
    assert texts == {greedy}
    # and a request's own top_k wins: at 1.5 the seeds part from the greedy text
    free = {settings_of(served, seed=seed, top_k=0)[1] for seed in (1, 2, 3)}
    assert free - {greedy}, free


def test_a_preset_models_keys_under_the_flags(served):
    s, _ = settings_of(served, model="plain")
    assert (s["top_k"], s["temperature"]) == (3, 0.8)
    assert s["min_p"] == pytest.approx(0.2)
    assert s["top_p"] == pytest.approx(0.8)          # the flag, over the preset's 0.5


def test_ollama_show_lists_the_models_own_parameters(served):
    status, _, out = served.post("/api/show", {"model": "keyed.gguf"})
    assert status == 200, out
    lines = out["parameters"].splitlines()
    assert "top_k 1" in lines and "temperature 1.5" in lines and "repeat_last_n 32" in lines
    assert any(line.startswith("num_ctx ") for line in lines)
    assert "PARAMETER top_k 1\n" in out["modelfile"]
