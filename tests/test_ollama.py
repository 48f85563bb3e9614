"""Ollama's API on offgrid's port, through the official ``ollama`` client.

One server on Qwen2.5-Coder 0.5B (it has FIM tokens and a template that takes
tools), one thread, short generations.  Besides the client, a replay of
Continue's Ollama provider (core/llm/llms/Ollama.ts): it reads /api/show's
``parameters`` line by line and enables FIM when the template has
``.Suffix``.
"""

import hashlib
import os
import signal
import json
import re
from pathlib import Path

import ollama
import pytest

try:
    from . import rawhttp
    from .serverproc import ServerProcess
except ImportError:
    import rawhttp
    from serverproc import ServerProcess

QWEN = Path(__file__).resolve().parent.parent / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
NAME = QWEN.name
GREEDY = {"temperature": 0, "num_predict": 8}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def srv():
    assert QWEN.is_file(), "Qwen2.5-Coder is missing at %s" % QWEN
    with ServerProcess(QWEN, threads=1, ctx=2048) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return ollama.Client(host=srv.base)


def ndjson(srv, path, body):
    """POST and read an NDJSON stream: (status, content type, [objects])."""
    c = srv.conn()
    try:
        c.request("POST", path, body=json.dumps(body).encode(),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        text = r.read().decode("utf-8")
        return r.status, r.getheader("Content-Type"), [json.loads(x) for x in text.splitlines()]
    finally:
        c.close()


# -- what is served -------------------------------------------------------------------

def test_version_answers(client):
    assert re.fullmatch(r"\d+\.\d+\.\d+", client._request_raw("GET", "/api/version").json()
                        ["version"])


def test_version_is_one_codex_oss_accepts(client):
    """Codex's --oss needs 0.13.4 or newer, the Ollama whose /v1/responses it uses."""
    version = client._request_raw("GET", "/api/version").json()["version"]
    assert tuple(int(x) for x in version.split(".")) >= (0, 13, 4)


@pytest.mark.parametrize("name", [NAME, QWEN.stem, QWEN.stem + ":latest"])
def test_pulling_a_served_model_succeeds_at_once(client, srv, name):
    assert client.pull(name, stream=False).status == "success"
    status, ctype, lines = ndjson(srv, "/api/pull", {"model": name})
    assert status == 200 and ctype.startswith("application/x-ndjson")
    assert lines[-1] == {"status": "success"}


def test_pulling_any_other_model_says_offgrid_never_downloads(client, srv):
    with pytest.raises(ollama.ResponseError) as e:
        list(client.pull("llama3.2:1b", stream=True))
    assert "never downloads" in str(e.value)
    status, _, lines = ndjson(srv, "/api/pull", {"model": "llama3.2:1b"})
    assert status == 200 and list(lines[-1]) == ["error"]       # Ollama's way, in the stream


def test_list_names_the_model_with_its_file_digest_and_details(client):
    models = client.list().models
    assert [m.model for m in models] == [NAME]
    m = models[0]
    assert m.digest == hashlib.sha256(QWEN.read_bytes()).hexdigest()
    assert m.size == QWEN.stat().st_size
    d = m.details
    assert (d.format, d.family, d.quantization_level) == ("gguf", "qwen2", "Q4_K_M")
    assert d.parameter_size.endswith("M")


def test_show_says_insert_and_tools_and_has_suffix_in_the_template(client):
    r = client.show(NAME)
    assert ".Suffix" in r.template and ".Tools" in r.template
    assert set(r.capabilities) == {"completion", "insert", "tools"}
    assert r.modelinfo["general.architecture"] == "qwen2"
    assert r.modelinfo["qwen2.context_length"] == 32768        # a number, as in Ollama
    assert r.details.family == "qwen2"
    assert "num_ctx 2048" in r.parameters


def test_ps_lists_the_running_model_and_its_context(client):
    models = client.ps().models
    assert [m.model for m in models] == [NAME]
    assert models[0].context_length == 2048 and models[0].expires_at.year > 2100


# -- /api/generate ------------------------------------------------------------------

def test_generate_with_suffix_fills_in_the_middle(client):
    r = client.generate(model="qwen2.5-coder:0.5b", prompt="def add(a, b):\n    return ",
                        suffix="\n", options=GREEDY)
    assert r.response.strip() == "a + b"        # it stops before the next function
    assert r.done and r.done_reason == "stop" and 0 < r.eval_count <= 8
    assert r.model == "qwen2.5-coder:0.5b"      # the name asked for, as Ollama answers


def test_generate_streams_ndjson_lines_ending_with_the_counts(srv):
    status, ctype, lines = ndjson(srv, "/api/generate", {
        "model": NAME, "prompt": "Say hello.", "options": GREEDY})
    assert status == 200 and ctype == "application/x-ndjson"
    *pieces, last = lines
    assert pieces and all(p["done"] is False and isinstance(p["response"], str) for p in pieces)
    assert "".join(p["response"] for p in pieces).strip()
    assert last["done"] is True and last["done_reason"] == "length" and last["response"] == ""
    assert last["eval_count"] == 8 and last["prompt_eval_count"] > 0
    # nanoseconds: a generation on one thread takes more than a millisecond
    assert last["total_duration"] >= last["eval_duration"] > 1_000_000


def test_generate_with_an_empty_prompt_answers_done_at_once(client):
    r = client.generate(model=NAME, prompt="")
    assert r.done and r.done_reason == "load" and r.response == ""


def test_generate_format_schema_constrains_the_response(client):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris"]}},
              "required": ["city"]}
    r = client.generate(model=NAME, prompt="Which city is the capital of France? Answer in "
                        "JSON.", format=schema, options={"temperature": 0, "num_predict": 24})
    assert json.loads(r.response) == {"city": "Paris"}


# -- /api/chat ----------------------------------------------------------------------

def test_chat_not_streamed(client):
    r = client.chat(model=NAME, messages=[{"role": "user", "content": "Say hello."}],
                    options=GREEDY, stream=False)
    assert r.message.role == "assistant" and r.message.content.strip()
    assert r.done and r.eval_count == 8


def test_chat_streamed(client):
    parts = list(client.chat(model=NAME, messages=[{"role": "user", "content": "Say hello."}],
                             options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts).strip()
    assert parts[-1].eval_count == 8


def test_chat_tool_call_comes_with_arguments_as_an_object(client):
    # Qwen 0.5B writes the call as bare JSON, not <tool_call>: the rescue makes it a call
    r = client.chat(model=NAME, messages=PARIS, tools=[WEATHER],
                    options={"temperature": 0, "num_predict": 40}, stream=False)
    assert r.message.tool_calls, r.message.content
    call = r.message.tool_calls[0].function
    assert call.name == "get_weather" and call.arguments == {"city": "Paris"}


def test_chat_tools_round_trip(client):
    """The call, its result sent back in Ollama's shape, and the next turn.

    The next turn is the model's: the 0.5B model answers with the result only
    without tools; with them it asks for the same call again (a weak agent, see
    docs/agents.md), which the client gets as a call again, not as text."""
    messages = list(PARIS)
    r = client.chat(model=NAME, messages=messages, tools=[WEATHER],
                    options={"temperature": 0, "num_predict": 40}, stream=False)
    assert r.message.tool_calls
    messages += [r.message, {"role": "tool", "content": "Sunny, 22 C",
                             "tool_name": r.message.tool_calls[0].function.name}]
    r = client.chat(model=NAME, messages=messages, tools=[WEATHER],
                    options={"temperature": 0, "num_predict": 30}, stream=False)
    assert r.done and (r.message.tool_calls or r.message.content)
    if r.message.tool_calls:
        assert r.message.tool_calls[0].function.name == "get_weather"
    r = client.chat(model=NAME, messages=messages,
                    options={"temperature": 0, "num_predict": 30}, stream=False)
    assert not r.message.tool_calls and "22" in r.message.content


@pytest.mark.parametrize("stream", [False, True])
def test_chat_tool_choice_required_makes_the_call(srv, stream):
    body = {"model": NAME, "messages": PARIS, "tools": [WEATHER], "tool_choice": "required",
            "options": {"temperature": 0, "num_predict": 40}, "stream": stream}
    if stream:
        status, _, lines = ndjson(srv, "/api/chat", body)
        calls = [c for x in lines for c in x["message"].get("tool_calls", [])]
        assert lines[-1]["done"] and lines[-1]["done_reason"] == "stop"
    else:
        status, _, r = srv.post("/api/chat", body)
        calls = r["message"]["tool_calls"]
    assert status == 200 and len(calls) == 1
    assert calls[0]["function"]["name"] == "get_weather"
    assert calls[0]["function"]["arguments"] == {"city": "Paris"}


def test_chat_history_with_a_tool_result_in_ollamas_shape(client):
    messages = PARIS + [
        {"role": "assistant", "content": "",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "Sunny, 22 C", "tool_name": "get_weather"}]
    r = client.chat(model=NAME, messages=messages, tools=[WEATHER],
                    options={"temperature": 0, "num_predict": 12}, stream=False)
    assert r.message.content.strip() and not r.message.tool_calls


# -- Continue's Ollama provider -----------------------------------------------------

def test_continue_replay_enables_fim_and_completes_the_middle(srv):
    # constructor: POST /api/show {"name": model}; every parameters line must match its
    # regex (a line that does not throws, and FIM is never enabled)
    status, _, show = srv.post("/api/show", {"name": "qwen2.5-coder:0.5b"})
    assert status == 200
    num_ctx = None
    for line in show["parameters"].split("\n"):
        parts = re.match(r'^(\S+)\s+((?:".*")|\S+)$', line)
        assert parts, "Continue cannot read the parameters line %r" % line
        if parts.group(1) == "num_ctx":
            num_ctx = int(parts.group(2))
    assert num_ctx == 2048
    assert ".Suffix" in show["template"]      # fimSupported
    # model_info's values in their JSON types, as Ollama's (a GGUF bool is no string)
    info = show["model_info"]
    assert info["tokenizer.ggml.add_bos_token"] is False
    assert info["qwen2.block_count"] == 24 and info["general.architecture"] == "qwen2"
    # _streamFim: /api/generate with prompt, suffix, its options and keep_alive
    status, _, lines = ndjson(srv, "/api/generate", {
        "model": "qwen2.5-coder:0.5b", "prompt": "def add(a, b):\n    return ",
        "suffix": "\n", "raw": True, "keep_alive": 1800, "stream": True,
        "options": {"temperature": 0, "num_predict": 8, "num_ctx": num_ctx, "stop": ["\n\n"]}})
    assert status == 200
    assert "a + b" in "".join(x["response"] for x in lines)
    assert lines[-1]["done"] and lines[-1]["done_reason"] == "stop"     # at the stop string


# -- errors in Ollama's shape -------------------------------------------------------

BAD = [
    ("/api/generate", {"model": NAME, "prompt": 5}, 400, "'prompt' must be a string"),
    ("/api/generate", {"prompt": "hi"}, 400, "model is required"),
    ("/api/generate", {"model": NAME, "prompt": "hi", "template": "{{ .Prompt }}"}, 400,
     "'template' is not supported"),
    ("/api/generate", {"model": NAME, "prompt": "hi", "raw": True, "system": "x"}, 400,
     "raw mode does not support"),
    ("/api/generate", {"model": NAME, "prompt": "hi", "options": {"temperature": "hot"}}, 400,
     "'temperature' must be a number"),
    ("/api/generate", {"model": NAME, "prompt": "hi", "format": 5}, 400, "invalid format"),
    ("/api/generate", {"model": NAME, "prompt": "word " * 2100}, 400, "context"),
    ("/api/chat", {"model": NAME, "messages": "hi"}, 400, "'messages' must be an array"),
    ("/api/chat", {"model": NAME, "messages": [{"role": "user", "content": "hi",
                                                "images": ["aGk="]}]}, 400, "images"),
    ("/api/chat", {"model": NAME, "messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "role must be one of"),
    ("/api/chat", {"model": NAME, "messages": PARIS, "tools": [{"function": 3}]}, 400,
     "tools[0]"),
    ("/api/chat", {"model": NAME, "messages": PARIS, "think": "very"}, 400, "'think'"),
    ("/api/show", {}, 400, "model is required"),
    ("/api/embed", {"model": NAME, "input": 5}, 400, "invalid input type"),
    ("/api/embed", {"model": NAME, "input": "word " * 2100, "truncate": False}, 400,
     "too large"),
    ("/api/embeddings", {"model": NAME, "prompt": ["hi"]}, 400, "'prompt' must be a string"),
    ("/api/pull", {"model": "llama3.2", "stream": False}, 404, "never downloads"),
    ("/api/create", {"model": "x"}, 501, "never downloads"),
    ("/api/copy", {"source": "a", "destination": "b"}, 501, "copies"),
    ("/api/nothing", {}, 404, "/api/nothing"),
]


@pytest.mark.parametrize("path,body,status,message", BAD, ids=[
    "%s-%d" % (b[0], i) for i, b in enumerate(BAD)])
def test_bad_input_gets_an_error_in_ollamas_shape(srv, path, body, status, message):
    got, headers, r = srv.post(path, body)
    assert got == status
    assert headers["Content-Type"].startswith("application/json")   # not a 200 stream
    assert list(r) == ["error"] and message in r["error"]


def test_wrong_method_gets_an_error_in_ollamas_shape(srv):
    status, _, r = srv.request("DELETE", "/api/tags")
    assert status == 405 and isinstance(r["error"], str)
    status, _, r = srv.request("DELETE", "/api/delete", {"model": "x"})
    assert status == 501 and "deletes" in r["error"]


def test_a_body_that_is_not_json_gets_an_error_in_ollamas_shape(srv):
    status, _, r = srv.request("POST", "/api/chat", raw=b"{not json")
    assert status == 400 and isinstance(r["error"], str)


def test_the_client_raises_response_error_with_the_status(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=NAME, messages=[{"role": "user", "content": "hi",
                                           "images": [b"\x89PNG"]}])
    assert e.value.status_code == 400 and "images" in e.value.error


def test_openai_routes_keep_their_error_shape(srv):
    status, _, r = srv.post("/v1/chat/completions", {"messages": "hi"})
    assert status == 400 and r["error"]["code"] == 400 and r["error"]["message"]


# -- LangChain ----------------------------------------------------------------------

def test_langchain_chat_ollama_invokes_and_streams(srv):
    from langchain_ollama import ChatOllama
    llm = ChatOllama(model=NAME, base_url=srv.base, temperature=0, num_predict=8,
                     validate_model_on_init=True)       # checks the name with /api/tags
    reply = llm.invoke("Say hello.")
    assert reply.content.strip()
    assert reply.usage_metadata["output_tokens"] == 8
    assert "".join(chunk.content for chunk in llm.stream("Say hello.")).strip()


def test_langchain_bind_tools_gives_tool_calls(srv):
    from langchain_ollama import ChatOllama
    llm = ChatOllama(model=NAME, base_url=srv.base, temperature=0, num_predict=40)
    reply = llm.bind_tools([WEATHER]).invoke("What is the weather in Paris?")
    assert [c["name"] for c in reply.tool_calls] == ["get_weather"], reply
    assert reply.tool_calls[0]["args"] == {"city": "Paris"}


def test_langchain_follow_up_after_a_tool_result_ends_with_an_answer(srv):
    """The agent's loop: the call, its result, then an answer, not the same
    call again (Qwen2.5-Coder-0.5B writes the call again as bare JSON; the
    rescue leaves a finished call as text, issue 48)."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_ollama import ChatOllama
    llm = ChatOllama(model=NAME, base_url=srv.base, temperature=0, num_predict=40)
    bound = llm.bind_tools([WEATHER])
    history = [HumanMessage("What is the weather in Paris?")]
    call = bound.invoke(history)
    assert [c["name"] for c in call.tool_calls] == ["get_weather"], call
    history += [call, ToolMessage("Sunny, 21 C", tool_call_id=call.tool_calls[0]["id"] or "0")]
    answer = bound.invoke(history)
    assert answer.content.strip() and not answer.tool_calls, answer


# -- streams that end early ---------------------------------------------------------

def _open_stream(srv, path, body):
    """POST a stream and read its first line; returns (connection, response)."""
    c = srv.conn()
    c.request("POST", path, body=json.dumps(body).encode(),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    assert json.loads(r.readline())["done"] is False
    return c, r


def test_a_client_that_hangs_up_cancels_its_generation(srv):
    before = srv.metrics()["offgrid_requests_cancelled_total"]
    c, _ = _open_stream(srv, "/api/generate", {
        "model": NAME, "prompt": "Count from 1 to 1000.", "raw": True,
        "options": {"temperature": 0, "num_predict": 1000}})
    c.close()
    srv.wait_idle(timeout=20)       # far sooner than 1000 tokens on one thread
    assert srv.metrics()["offgrid_requests_cancelled_total"] == before + 1


def test_a_newer_request_with_the_same_id_slot_supersedes_the_stream(srv):
    c, r = _open_stream(srv, "/api/generate", {
        "model": NAME, "prompt": "Count from 1 to 1000.", "raw": True, "id_slot": 0,
        "options": {"temperature": 0, "num_predict": 1000}})
    status, _, newer = srv.post("/api/generate", {
        "model": NAME, "prompt": "Say hello.", "raw": True, "id_slot": 0, "stream": False,
        "options": {"temperature": 0, "num_predict": 2}})
    last = json.loads(r.read().decode().strip().splitlines()[-1])
    c.close()
    assert status == 200 and newer["eval_count"] == 2
    assert last["done"] and last["done_reason"] == "cancelled" and last["eval_count"] < 1000


def test_an_error_after_the_first_line_is_the_streams_last_line(srv):
    # the worker dies mid-stream: headers are out, so the 500 becomes an NDJSON line
    c, r = _open_stream(srv, "/api/chat", {
        "model": NAME, "messages": [{"role": "user", "content": "Count from 1 to 1000."}],
        "options": {"temperature": 0, "num_predict": 1000}})
    for pid in rawhttp.children(srv.proc.pid):
        os.kill(pid, signal.SIGKILL)
    rest = r.read().decode()
    c.close()
    last = json.loads(rest.strip().splitlines()[-1])
    assert list(last) == ["error"] and "SIGKILL" in last["error"]
