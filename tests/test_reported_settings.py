"""What the server reports is what is in force, and what it cannot do it refuses.

/props' ``speculative``, /metrics' ``n_busy_slots_per_decode`` and the
``min_keep`` of ``generation_settings`` are measured or read, not written
as constants; a sampler offgrid does not run is refused by name when a
request asks it to act, and accepted at its inactive default (as clients
that copy llama-server's sampler list send it).
"""


import pytest

try:
    from .serverproc import ServerProcess
except ImportError:
    from serverproc import ServerProcess


@pytest.fixture(scope="module")
def srv(smollm_path):
    with ServerProcess(smollm_path, "-np", "2") as s:
        yield s


def test_props_say_whether_requests_draft(smollm_path, srv):
    # the default --spec-type edits drafts the requests whose prompt carries
    # their answer (engine/copydraft.py)
    status, _, props = srv.get("/props")
    assert props["default_generation_settings"]["speculative"] is True
    with ServerProcess(smollm_path, "--spec-type", "none") as s:
        status, _, props = s.get("/props")
        assert props["default_generation_settings"]["speculative"] is False


def test_busy_slots_per_decode_counts_the_sessions_of_each_step(smollm_path):
    with ServerProcess(smollm_path, "-np", "2") as s:
        s.post("/completion", {"prompt": "Hi", "n_predict": 8, "ignore_eos": True})
        alone = s.metrics()["llamacpp:n_busy_slots_per_decode"]
        assert alone == 1.0
        # two choices decoded together: steps of two sessions pull the mean up
        s.post("/completion", {"prompt": "Hi", "n_predict": 64, "n_cmpl": 2,
                               "ignore_eos": True})
        together = s.metrics()["llamacpp:n_busy_slots_per_decode"]
        assert 1.0 < together <= 2.0


def test_min_keep_is_read_and_reported(srv):
    status, _, out = srv.post("/completion", {"prompt": "Hi", "n_predict": 1})
    assert out["generation_settings"]["min_keep"] == 0      # llama-server's default
    status, _, out = srv.post("/completion", {"prompt": "Hi", "n_predict": 1, "min_keep": 3})
    assert status == 200 and out["generation_settings"]["min_keep"] == 3


def test_dry_which_offgrid_does_not_run_is_refused_when_asked_to_act(srv):
    status, _, out = srv.post("/completion", {"prompt": "Hi", "n_predict": 1,
                                              "dry_multiplier": 0.8})
    assert status == 400 and "dry_multiplier" in out["error"]["message"]


def test_llama_servers_chain_and_defaults_are_accepted(srv):
    status, _, out = srv.post("/completion", {
        "prompt": "Hi", "n_predict": 1, "mirostat": 0, "dry_multiplier": 0.0,
        "xtc_probability": 0.0, "top_n_sigma": -1.0,
        "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p",
                     "xtc", "temperature"]})
    assert status == 200, out
    assert out["generation_settings"]["samplers"] == [
        "penalties", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]


def test_an_unknown_sampler_name_is_refused_by_name(srv):
    status, _, out = srv.post("/completion", {"prompt": "Hi", "n_predict": 1,
                                              "samplers": ["top_k", "beam_search"]})
    assert status == 400 and "beam_search" in out["error"]["message"]
