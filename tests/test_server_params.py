"""Request fields parsed at the edge (server/api/fields.py) the llama-server way.

--temp and --seed: llama-server's test suite starts every server with ``--temp 0.8 --seed 42``
and expects two identical requests to sample the same text; a request's own
field still wins.
"""

from offgrid.flags import parse_args
from offgrid.request import SamplingParams
from offgrid.server.api.fields import Fields, generation_from

N_VOCAB = 1000
SERVER = SamplingParams(temperature=0.0, seed=42)


def gen(body, base=SERVER):
    return generation_from(Fields(body), N_VOCAB, sampling_default=base)


def test_a_request_without_sampling_fields_takes_the_servers():
    s = gen({"prompt": "x"}).sampling
    assert (s.temperature, s.seed) == (0.0, 42)


def test_a_requests_own_temperature_and_seed_win():
    s = gen({"temperature": 1.5, "seed": 7}).sampling
    assert (s.temperature, s.seed) == (1.5, 7)


def test_seed_minus_one_in_a_request_means_random_even_with_a_server_seed():
    assert gen({"seed": -1}).sampling.seed is None


def test_the_server_defaults_are_not_changed_by_a_request():
    gen({"temperature": 1.5, "seed": 7, "logit_bias": [[1, 2.0]]})
    assert (SERVER.temperature, SERVER.seed, SERVER.logit_bias) == (0.0, 42, [])


def test_without_server_defaults_llama_servers_own_apply():
    s = gen({}, base=None).sampling
    assert (s.temperature, s.seed) == (0.8, None)


def test_the_flags_are_llama_servers():
    args = parse_args(["-m", "x.gguf", "--temp", "0", "--seed", "42"])
    assert args.sampling == {"temperature": 0.0, "seed": 42}
    args = parse_args(["-m", "x.gguf", "-s", "3"])
    assert args.sampling == {"seed": 3}


# -- llama-server's JSON prompt form (params.prompt_from) -----------------------------

def test_a_json_prompt_object_is_its_prompt_string():
    from offgrid.server.api.fields import prompt_from
    assert prompt_from({"prompt_string": "I believe"}).parts == ["I believe"]


def test_a_json_prompt_with_multimodal_data_is_refused():
    import pytest
    from offgrid.server.httpd.httperrors import BadRequest
    from offgrid.server.api.fields import prompt_from
    with pytest.raises(BadRequest, match="multimodal"):
        prompt_from({"prompt_string": "x <__media__>", "multimodal_data": ["iVBOR"]})


# -- several prompts (params.prompts_from), llama-server's reading ------------------

def test_a_list_without_token_ids_is_several_prompts():
    from offgrid.server.api.fields import prompts_from
    got = prompts_from([[1, 2], "text", {"prompt_string": "json"}, [3, "mixed"]])
    assert [p.parts for p in got] == [[[1, 2]], ["text"], ["json"], [[3], "mixed"]]


def test_a_list_with_a_token_id_at_its_top_is_one_prompt():
    from offgrid.server.api.fields import prompts_from
    got = prompts_from([1, 2, "text", 3])
    assert [p.parts for p in got] == [[[1, 2], "text", [3]]]


def test_one_element_lists_are_one_prompt():
    from offgrid.server.api.fields import prompts_from
    assert [p.parts for p in prompts_from(["x"])] == [["x"]]
    assert [p.parts for p in prompts_from([[5, 6]])] == [[[5, 6]]]


def test_too_many_prompts_are_refused():
    import pytest
    from offgrid.server.httpd.httperrors import BadRequest
    from offgrid.server.api.fields import MAX_PROMPTS, prompts_from
    with pytest.raises(BadRequest, match="at most"):
        prompts_from(["x"] * (MAX_PROMPTS + 1))


# -- logit_bias by text ----------------------------------------------------------------

def test_logit_bias_text_gets_every_token_of_the_text():
    asked = []

    def tokenize(text):
        asked.append(text)
        return [7, 8] if text == " the " else [9]
    s = generation_from(Fields({"logit_bias": [[" the ", -100], [5, False], ["x", 1]]}),
                        N_VOCAB, tokenize=tokenize).sampling
    assert s.logit_bias == [(7, -100.0), (8, -100.0), (5, float("-inf")), (9, 1.0)]
    assert asked == [" the ", "x"]


def test_logit_bias_keys_that_are_numbers_are_ids_and_others_text():
    s = generation_from(Fields({"logit_bias": {"12": 2, "-": 1}}), N_VOCAB,
                        tokenize=lambda text: [3]).sampling
    assert s.logit_bias == [(12, 2.0), (3, 1.0)]


def test_logit_bias_text_without_a_tokenizer_is_refused():
    import pytest
    from offgrid.server.httpd.httperrors import BadRequest
    with pytest.raises(BadRequest, match="not a token id"):
        generation_from(Fields({"logit_bias": [["x", 1]]}), N_VOCAB)
