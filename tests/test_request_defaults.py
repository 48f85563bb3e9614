"""The server's defaults for what a request leaves out, as llama-server's flags set them.

llama-server starts each request from its params_base: ``--grammar``,
``--grammar-file``, ``-j/--json-schema`` and ``-jf/--json-schema-file`` hold every
request without an output format of its own to that grammar (a chat's tool
grammar takes its place); ``-l`` biases tokens for a request with no
``logit_bias``; ``--ignore-eos``, ``--keep`` and ``--no-cache-prompt`` set those
fields; ``-sp/--special`` shows the control tokens generated.  A request's own field
wins.  Served here on the tiny model.
"""

import json

import pytest

from offgrid.flags import parse_args
from serverproc import ServerProcess

YES_NO = 'root ::= "yes" | "no"'
COLOURS = {"enum": ["red", "green"]}


# -- the flags, read -----------------------------------------------------------------------

def test_the_last_output_format_given_wins_and_files_are_read(tmp_path):
    g = tmp_path / "g.gbnf"
    g.write_text(YES_NO)
    s = tmp_path / "s.json"
    s.write_text(json.dumps(COLOURS))
    assert parse_args(["-m", "x", "--json-schema-file", str(s), "--grammar-file", str(g)]
                      ).output_default == ["grammar", YES_NO]
    assert parse_args(["-m", "x", "--grammar", "root ::= \"a\"", "-jf", str(s)]
                      ).output_default == ["schema", COLOURS]
    assert parse_args(["-m", "x", "-j", "{}"]).output_default == ["schema", {"type": "object"}]
    args = parse_args(["-m", "x", "-l", "15043+1", "--logit-bias", "7-inf", "-l", "3-0.5"])
    assert args.sampling["logit_bias"] == [(15043, 1.0), (7, float("-inf")), (3, -0.5)]
    args = parse_args(["-m", "x"])
    assert (args.output_default, args.ignore_eos, args.keep, args.cache_prompt) == \
        (None, False, 0, True)
    assert "logit_bias" not in args.sampling


@pytest.mark.parametrize("argv,words", [
    (["--grammar-file", "/nonexistent/g.gbnf"], "--grammar-file /nonexistent/g.gbnf"),
    (["-jf", "/nonexistent/s.json"], "--json-schema-file /nonexistent/s.json"),
    (["-j", "{not json"], "--json-schema: not JSON"),
    (["-j", "[1]"], "a JSON schema is an object"),
    (["-l", "15043"], "TOKEN_ID(+/-)BIAS"),
    (["-l", "15043+inf"], "TOKEN_ID(+/-)BIAS"),
    (["-l", "x+1"], "TOKEN_ID(+/-)BIAS"),
    (["--keep", "-2"], "--keep -2"),
])
def test_a_default_that_does_not_read_stops_the_start(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["-m", "x"] + argv)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


# -- a default grammar, served ---------------------------------------------------------------

@pytest.fixture(scope="module")
def held(tmp_path_factory, plain_model_path):
    g = tmp_path_factory.mktemp("request-defaults") / "yes-no.gbnf"
    g.write_text(YES_NO + "\n")
    with ServerProcess(plain_model_path, "--grammar-file", g, "-np", "1", ctx=512) as server:
        yield server


def completion(server, **body):
    body = dict({"prompt": "Once upon a time", "n_predict": 8, "temperature": 0}, **body)
    status, _, out = server.post("/completion", body)
    assert status == 200, out
    return out


def test_every_dialect_is_held_to_the_servers_grammar(held):
    assert completion(held)["content"] in ("yes", "no")
    status, _, out = held.post("/v1/completions", {"prompt": "Hello", "max_tokens": 8,
                                                   "temperature": 0})
    assert status == 200, out
    assert out["choices"][0]["text"] in ("yes", "no")
    status, _, out = held.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0})
    assert status == 200, out
    assert out["choices"][0]["message"]["content"] in ("yes", "no")
    status, _, out = held.post("/api/generate", {"model": "x", "prompt": "Hello",
                                                 "stream": False,
                                                 "options": {"num_predict": 8,
                                                             "temperature": 0}})
    assert status == 200, out
    assert out["response"] in ("yes", "no")


def test_a_requests_own_format_wins_over_the_servers(held):
    assert completion(held, grammar='root ::= "maybe"')["content"] == "maybe"
    out = completion(held, json_schema={"enum": ["blue"]})
    assert out["content"].strip() == '"blue"'
    # and /props says what the server's grammar is
    status, _, props = held.get("/props")
    assert status == 200
    assert props["default_generation_settings"]["params"]["grammar"].strip() == YES_NO


def test_a_chat_with_tools_is_not_held_to_the_servers_grammar(held):
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 8,
            "temperature": 0, "tools": [tool], "tool_choice": "required"}
    status, _, out = held.post("/v1/chat/completions", body)
    assert status == 200, out
    # tool_choice required holds the reply to a call of the tool, not to yes or no
    calls = out["choices"][0]["message"].get("tool_calls") or []
    assert out["choices"][0]["message"].get("content") not in ("yes", "no")
    assert not calls or calls[0]["function"]["name"] == "get_weather"


def test_a_schema_flag_is_held_to_as_json(tmp_path, plain_model_path):
    with ServerProcess(plain_model_path, "-j", json.dumps(COLOURS), "-np", "1",
                       ctx=512) as server:
        assert completion(server)["content"].strip() in ('"red"', '"green"')


def test_a_grammar_the_model_cannot_take_fails_the_load_naming_the_flag(plain_model_path):
    server = ServerProcess(plain_model_path, "--grammar", "root ::= (", "-np", "1", ctx=512)
    with pytest.raises(RuntimeError) as e:
        server.start()
    assert server.stop() == 1
    assert "--grammar(-file): " in str(e.value), e.value


# -- -l, --ignore-eos, --keep, --no-cache-prompt ------------------------------------------------

@pytest.fixture(scope="module")
def biased(plain_model_path):
    with ServerProcess(plain_model_path, "-l", "42+100", "-l", "99999999+1", "--ignore-eos",
                       "--keep", "3", "--no-cache-prompt", "--special", "-np", "1", ctx=512) as server:
        yield server


def test_the_flags_bias_is_a_requests_unless_it_gives_its_own(biased):
    out = completion(biased, n_predict=4, return_tokens=True)
    assert out["tokens"] == [42] * 4
    assert out["generation_settings"]["logit_bias"] == [[42, 100.0]]
    # a request's logit_bias (even an empty one) takes the place of the server's
    out = completion(biased, n_predict=4, return_tokens=True, logit_bias=[])
    assert out["tokens"] != [42] * 4
    assert out["generation_settings"]["logit_bias"] == []
    # the id past the vocabulary is left out, with a line saying so
    assert "-l 99999999: not a token of this model" in "".join(biased.output)


def test_ignore_eos_keep_and_cache_prompt_are_the_flags_unless_the_request_says(biased):
    s = completion(biased)["generation_settings"]
    assert (s["ignore_eos"], s["n_keep"], s["cache_prompt"]) == (True, 3, False)
    s = completion(biased, ignore_eos=False, n_keep=1, cache_prompt=True)["generation_settings"]
    assert (s["ignore_eos"], s["n_keep"], s["cache_prompt"]) == (False, 1, True)
    status, _, props = biased.get("/props")
    params = props["default_generation_settings"]["params"]
    assert (params["ignore_eos"], params["n_keep"], params["cache_prompt"]) == (True, 3, False)
    # --no-cache-prompt: the same prompt again is evaluated whole, not taken from the cache
    first = completion(biased, n_predict=1)
    again = completion(biased, n_predict=1)
    assert again["timings"]["prompt_n"] == first["timings"]["prompt_n"] > 1
    cached = completion(biased, n_predict=1, cache_prompt=True)
    assert cached["timings"]["prompt_n"] < first["timings"]["prompt_n"]


def test_special_shows_the_control_tokens_generated(biased, plain_model_path):
    status, _, out = biased.post("/tokenize", {"content": "<repo_name>"})
    assert status == 200 and len(out["tokens"]) == 1, out
    control = out["tokens"][0]
    body = dict(n_predict=2, logit_bias=[[control, 100]], n_probs=2, return_tokens=True)
    out = completion(biased, **body)
    assert out["tokens"] == [control] * 2
    assert out["content"] == "<repo_name>" * 2
    assert [p["token"] for p in out["completion_probabilities"]] == ["<repo_name>"] * 2
    # the candidates too: after the sampler's bias it is the first of them
    out = completion(biased, post_sampling_probs=True, **body)
    assert out["completion_probabilities"][0]["top_probs"][0]["token"] == "<repo_name>"
    with ServerProcess(plain_model_path, "-np", "1", ctx=512) as plain:
        out = completion(plain, **body)
    assert out["tokens"] == [control] * 2 and out["content"] == ""


def test_a_reverse_prompt_stops_requests_that_give_no_stop(plain_model_path):
    """-r (llama-server's antiprompt): a stop string for a request without one of its own."""
    with ServerProcess(plain_model_path, "-np", "1", ctx=512) as plain:
        text = completion(plain, n_predict=12)["content"]
    word = text[len(text) // 2:len(text) // 2 + 3]
    assert len(word) == 3 and text.index(word) > 0, text
    with ServerProcess(plain_model_path, "-r", word, "-np", "1", ctx=512) as s:
        out = completion(s, n_predict=12)
        assert out["content"] == text[:text.index(word)], (out["content"], text, word)
        assert (out["stop_type"], out["stopping_word"]) == ("word", word)
        # a request's own stop takes its place
        assert completion(s, n_predict=12, stop=["\x00never"])["content"] == text
