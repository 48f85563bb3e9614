"""XTC, top-n-sigma and mirostat: llama-server's samplers beyond the default chain.

libllama runs them (llama_sampler_init_xtc, _top_n_sigma, _mirostat,
_mirostat_v2), placed as common_sampler_init places them: top-n-sigma and XTC
in the chain where llama-server's default order has them, mirostat in place of
the chain (after the logit bias, at the temperature).  What each must do is
checked where its result is exact: XTC at probability 1 drops every candidate
of probability at least the threshold but the least likely of them, so at
temperature 0 the pick is that one (read from the step's own probabilities
before sampling); top-n-sigma at n near 0 and mirostat 2 at tau 0 keep only
the most likely token, so every seed at temperature 2 gives the greedy text.
DRY is still refused (test_reported_settings.py).
"""

import pytest

from serverproc import ServerProcess

PROMPT = "The three primary colours are"
N = 16


@pytest.fixture(scope="module")
def srv(qwen_path):
    with ServerProcess(qwen_path, "-np", "1", ctx=512) as s:
        yield s


def complete(srv, **body):
    status, _, out = srv.post("/completion", dict({"prompt": PROMPT, "n_predict": N}, **body))
    assert status == 200, out
    return out


def test_xtc_at_probability_1_picks_the_least_likely_of_the_candidates_over_the_threshold(srv):
    out = complete(srv, temperature=0, samplers=["xtc", "temperature"], xtc_probability=1.0,
                   xtc_threshold=0.1, n_probs=10, return_tokens=True)
    cut = 0
    for step, token in zip(out["completion_probabilities"], out["tokens"]):
        top = step["top_logprobs"]              # before sampling: the raw distribution
        above = [c["id"] for c in top if c["logprob"] >= -2.302585092994046]   # p >= 0.1
        want = above[-1] if len(above) >= 2 else top[0]["id"]
        assert token == want, (step, above)
        cut += len(above) >= 2
    assert cut, "no step had two candidates over the threshold: nothing was checked"
    assert out["generation_settings"]["samplers"] == ["xtc", "temperature"]


def test_xtc_at_its_defaults_in_llama_servers_chain_changes_nothing_at_temperature_0(srv):
    greedy = complete(srv, temperature=0)["content"]
    assert complete(srv, temperature=0, xtc_probability=0.0)["content"] == greedy
    assert complete(srv, temperature=0, xtc_probability=1.0, xtc_threshold=0.6)["content"] \
        == greedy                               # a threshold over 0.5 turns it off


@pytest.mark.parametrize("body", [{"top_n_sigma": 1e-6}, {"mirostat": 2, "mirostat_tau": 0.0}],
                         ids=["top-n-sigma", "mirostat-2"])
def test_a_sampler_keeping_only_the_top_token_makes_every_seed_greedy(srv, body):
    greedy = complete(srv, temperature=0)["content"]
    free = {complete(srv, temperature=2.0, seed=seed)["content"] for seed in (1, 2, 3)}
    assert free != {greedy}, "temperature 2 gave the greedy text: nothing to tell apart"
    kept = {complete(srv, temperature=2.0, seed=seed, **body)["content"] for seed in (1, 2, 3)}
    assert kept == {greedy}


def test_mirostat_1_samples_by_its_seed(srv):
    one = complete(srv, temperature=1.0, seed=5, mirostat=1)["content"]
    assert complete(srv, temperature=1.0, seed=5, mirostat=1)["content"] == one
    status, _, out = srv.post("/completion", {"prompt": PROMPT, "mirostat": 3})
    assert status == 400 and "mirostat" in out["error"]["message"]
