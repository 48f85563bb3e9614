"""The official openai client against offgrid's /v1/responses (the Responses API).

Qwen2.5-Coder-0.5B-Instruct (a tool-calling Qwen template in its GGUF)
serves text, streams, function calls and JSON schemas.  Function calls come
from ``tool_choice`` (a grammar makes the model write one).  The last test
feeds our event writer to the SDK's stream state, for the reasoning items a
non-thinking model never makes (served as a stream from loopback, so the SDK
is driven through its public API only).
"""

import json
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest

from offgrid.request import Completion, FinishReason, Usage
from offgrid.server.api import responses as dialect
from offgrid.server.api.fields import Fields, generation_from

try:
    from . import rawhttp
    from .serverproc import ROOT, ServerProcess
except ImportError:
    import rawhttp
    from serverproc import ROOT, ServerProcess

QWEN = ROOT / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}]
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def srv():
    assert QWEN.is_file(), "the Qwen2.5-Coder model is missing at %s" % QWEN
    with ServerProcess(QWEN, threads=1) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0)


# -- text -------------------------------------------------------------------------------

def test_create_gives_output_text(client):
    r = client.responses.create(model="qwen", input="Say hello.", max_output_tokens=24,
                                temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert "hello" in r.output_text.lower()
    (msg,) = r.output
    assert msg.type == "message" and msg.content[0].type == "output_text"
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 24


def test_instructions_and_message_items_are_the_prompt(client):
    r = client.responses.create(
        model="qwen", instructions="Answer with one word.", max_output_tokens=8,
        temperature=0, store=False,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Say hi."}]},
               {"role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
               {"role": "user", "content": "Say hi again."}])
    assert r.instructions == "Answer with one word." and r.output_text.strip()
    assert r.usage.input_tokens > 20


def test_max_output_tokens_makes_it_incomplete(client):
    r = client.responses.create(model="qwen", input="Count from 1 to 50.",
                                max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output_text
    assert r.output[-1].status == "incomplete"


def test_stream_runs_through_the_sdk_parser(client):
    with client.responses.stream(model="qwen", input="Say hello.", max_output_tokens=24,
                                 temperature=0) as s:
        events = list(s)
        final = s.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    assert final.output_text == "".join(deltas) and "hello" in final.output_text.lower()
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_without_v1_is_the_same_endpoint(srv):
    # llama-server serves POST /responses too; an SDK pointed at the bare host uses it
    bare = openai.OpenAI(base_url=srv.base, api_key="none", max_retries=0)
    r = bare.responses.create(model="qwen", input="Say hello.", max_output_tokens=4,
                              temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text


def test_input_tokens_counts_the_prompt_a_response_would_evaluate(srv, client):
    body = {"model": "qwen", "instructions": "Answer briefly.", "tools": TOOLS,
            "input": [{"role": "user", "content": ASK}]}
    status, _, count = srv.post("/v1/responses/input_tokens", body)
    assert status == 200 and count["object"] == "response.input_tokens"
    used = client.responses.create(max_output_tokens=1, temperature=0, **body).usage
    assert count["input_tokens"] == used.input_tokens
    assert srv.post("/responses/input_tokens", body)[2] == count
    status, _, err = srv.post("/v1/responses/input_tokens", {"model": "qwen"})
    assert status == 400 and "'input' is required" in err["error"]["message"]


def test_stream_telemetry_progress_and_timings_as_llama_server(srv):
    status, events = srv.stream("/responses", {
        "input": "This is a test. " * 20, "max_output_tokens": 6, "temperature": 0,
        "stream": True, "return_progress": True, "timings_per_token": True})
    assert status == 200
    progress = [e for e in events if "prompt_progress" in e]
    assert progress and all(e["type"] == "response.in_progress" for e in progress)
    assert progress[-1]["prompt_progress"]["processed"] == progress[-1]["prompt_progress"]["total"]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and all(e["timings"]["predicted_n"] >= 1 for e in deltas)
    last = events[-1]
    assert last["type"] in ("response.completed", "response.incomplete")
    assert last["timings"]["predicted_n"] == last["response"]["usage"]["output_tokens"]
    ids = {e["response"]["id"] for e in events if "response" in e}
    assert len(ids) == 1
    # without them asked for: no progress events, no timings on the deltas
    plain = srv.stream("/v1/responses", {"input": "Hi", "max_output_tokens": 3,
                                         "stream": True})[1]
    assert not any("prompt_progress" in e for e in plain)
    assert not any("timings" in e for e in plain if e["type"].endswith(".delta"))


# -- function calls ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def forced_call(client):
    return client.responses.create(model="qwen", input=ASK, tools=TOOLS, max_output_tokens=60,
                                   temperature=0,
                                   tool_choice={"type": "function", "name": "get_weather"})


def test_named_function_gives_a_function_call_item(forced_call):
    (call,) = [o for o in forced_call.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    assert isinstance(json.loads(call.arguments)["city"], str)


def test_function_call_output_goes_back(client, forced_call):
    call = [o for o in forced_call.output if o.type == "function_call"][0]
    r = client.responses.create(
        model="qwen", tools=TOOLS, tool_choice="none", max_output_tokens=16, temperature=0,
        input=[{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id,
                "output": "21 degrees and sunny"}])
    assert r.output_text.strip()
    assert r.usage.input_tokens > forced_call.usage.input_tokens


def test_streamed_function_call_arguments(client):
    with client.responses.stream(model="qwen", input=ASK, tools=TOOLS, tool_choice="required",
                                 max_output_tokens=60, temperature=0) as s:
        events = list(s)
        final = s.get_final_response()
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and isinstance(json.loads(done[0].arguments)["city"], str)
    (call,) = [o for o in final.output if o.type == "function_call"]
    assert call.arguments == done[0].arguments and call.name == "get_weather"


# -- structured output -----------------------------------------------------------------------

def test_json_schema_text_format_parses_and_matches(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    r = client.responses.create(model="qwen", input="Invent a person.", max_output_tokens=60,
                                temperature=0,
                                text={"format": {"type": "json_schema", "name": "person",
                                                 "schema": schema, "strict": True}})
    person = json.loads(r.output_text)
    assert set(person) == {"name", "age"}
    assert isinstance(person["name"], str) and isinstance(person["age"], int)


# -- errors ---------------------------------------------------------------------------------

def test_previous_response_id_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="qwen", input="hi", previous_response_id="resp_123")
    assert "previous_response_id" in e.value.body["message"]
    assert e.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize("bad", [
    {},
    {"input": 42},
    {"input": [{"type": "input_image", "image_url": "x"}]},
    {"input": "hi", "max_output_tokens": "many"},
    {"input": "hi", "tools": [{"type": "function"}]},
    {"input": "hi", "tools": [{"name": "no_type"}]},
    {"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
    {"input": "hi", "text": {"format": {"type": "yaml"}}},
])
def test_bad_input_is_a_400_in_openai_shape(srv, bad):
    status, _, body = srv.post("/v1/responses", bad)
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]


# -- reasoning, through the SDK's own stream reader --------------------------------------------

class _Events:
    def __init__(self):
        self.sent = []

    def send(self, obj, event=None):
        self.sent.append((event, obj))
        return True

    def end(self):
        pass


def _sdk_reads(events):
    """The final Response the SDK's ``responses.stream`` makes of these (event, object) pairs,
    served as an event stream by a one-request server on loopback."""
    body = b"".join(b"event: %s\ndata: %s\n\n" % (name.encode(), json.dumps(obj).encode())
                    for name, obj in events)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        client = openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % server.server_address[1],
                               api_key="none", max_retries=0)
        with client.responses.stream(model="m", input="x") as stream:
            return stream.get_final_response()
    finally:
        server.shutdown()
        server.server_close()


def test_reasoning_becomes_a_reasoning_item_streamed_and_whole():
    call = {"id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    reply = {"reasoning_content": "The user asks.", "content": "Let me look.",
             "tool_calls": [call]}
    c = Completion("", [], FinishReason.STOP, "eos", "", Usage(7, 0, 5), reply=reply)
    req = dialect._Request(Fields({"input": "x"}), generation_from(Fields({}), 10), "auto", None)
    ids, es = dialect._Ids(), _Events()
    st = dialect._Stream(es, ids, "m", req, 0)
    for d in ({"reasoning_content": "The user "}, {"reasoning_content": "asks."},
              {"content": "Let me "}, {"content": "look."}, {"tool_call": [0, call]}):
        st.delta(d)
    st.finish(c)
    assert all(name == obj["type"] for name, obj in es.sent)
    final = _sdk_reads(es.sent)
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == "The user asks."
    assert final.output_text == "Let me look."
    whole = dialect.output_items(ids, reply)
    assert [(o.type, o.id) for o in final.output] == [(w["type"], w["id"]) for w in whole]


# -- a response that cannot finish ------------------------------------------------------------

@pytest.fixture(scope="module")
def small(smollm_path):
    with ServerProcess(smollm_path, threads=1) as s:
        yield s


def test_a_worker_dying_mid_stream_ends_it_with_response_failed(small):
    client = openai.OpenAI(base_url=small.base + "/v1", api_key="none", max_retries=0)
    stream = client.responses.create(model="m", input="Count from 1 to 500.", stream=True,
                                     max_output_tokens=2000, extra_body={"ignore_eos": True})
    events = []
    for e in stream:            # the SDK's own reader, to the stream's end
        events.append(e)
        if e.type == "response.output_text.delta" and len(events) == 6:
            for pid in rawhttp.children(small.proc.pid):
                os.kill(pid, signal.SIGKILL)
    types = [e.type for e in events]
    assert types[0] == "response.created" and "response.output_text.delta" in types
    assert types[-1] == "response.failed" and "response.completed" not in types
    failed = events[-1].response
    assert failed.id == events[0].response.id and failed.status == "failed"
    assert failed.error.code == "server_error" and "SIGKILL" in failed.error.message
    # the text so far is its output, the message item cut short
    (msg,) = failed.output
    assert msg.status == "incomplete" and msg.content[0].text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    small.wait_idle(timeout=120)        # the worker is back for the next request
    r = client.responses.create(model="m", input="Hi", max_output_tokens=2)
    assert r.status in ("completed", "incomplete")


# -- Codex's requests, as it sends them ------------------------------------------------------

NAMESPACED = [
    {"type": "function", "name": "exec_command", "description": "Runs a command.",
     "strict": False, "parameters": {"type": "object", "required": ["cmd"],
                                     "properties": {"cmd": {"type": "string"}}}},
    {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
        {"type": "function", "name": "close_agent", "description": "Close an agent.",
         "strict": False, "parameters": {"type": "object", "required": ["target"],
                                         "properties": {"target": {"type": "string"}}}}]},
    {"type": "namespace", "name": "other_v1", "tools": [
        {"type": "function", "name": "exec_command", "description": "A clash.",
         "parameters": {"type": "object", "properties": {}}}]},
    {"type": "web_search", "external_web_access": False},
    {"type": "custom", "name": "apply_patch", "format": {"type": "grammar", "syntax": "lark",
                                                         "definition": "start: x"}},
]


def codex_request(**over):
    body = {"model": "qwen", "stream": False, "tool_choice": "auto", "parallel_tool_calls": True,
            "reasoning": {"summary": "auto"}, "store": False,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "01a2-b3",
            "client_metadata": {"x-codex-turn-metadata": "{}"}, "tools": NAMESPACED,
            "input": [{"type": "message", "id": "msg_1", "role": "developer",
                       "content": [{"type": "input_text", "text": "You are a coding agent."}]},
                      {"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": "Say hello."}]}],
            "temperature": 0, "max_output_tokens": 16}
    body.update(over)
    return body


def test_codexs_first_request_is_answered(srv):
    status, _, body = srv.post("/v1/responses", codex_request())
    assert status == 200, body
    assert body["status"] in ("completed", "incomplete") and body["output"]


def test_namespace_functions_are_tools_named_as_codex_reads_them_back():
    tools, spaces = dialect.tools_from(NAMESPACED)
    assert [t.name for t in tools] == ["exec_command", "close_agent", "other_v1__exec_command"]
    assert spaces["close_agent"] == ("multi_agent_v1", "close_agent")
    item = dialect._call_item("fc_1", {"id": "c1", "name": "other_v1__exec_command",
                                       "arguments": "{}"}, spaces=spaces)
    assert (item["namespace"], item["name"]) == ("other_v1", "exec_command")
    msgs = dialect.messages_from(None, [
        {"type": "function_call", "call_id": "c1", "name": "close_agent",
         "namespace": "multi_agent_v1", "arguments": "{\"target\": \"a\"}"},
        {"type": "function_call_output", "call_id": "c1", "output": "closed"}], spaces)
    assert msgs[0].tool_calls[0].name == "close_agent" and msgs[1].role == "tool"


def test_a_namespace_call_comes_back_with_its_namespace(srv):
    status, _, body = srv.post("/v1/responses", codex_request(
        max_output_tokens=60, input="Close the agent named alpha.",
        tool_choice={"type": "function", "name": "close_agent"}))
    assert status == 200, body
    calls = [o for o in body["output"] if o["type"] == "function_call"]
    assert [(c["namespace"], c["name"]) for c in calls] == [("multi_agent_v1", "close_agent")]
    assert "target" in json.loads(calls[0]["arguments"])


def test_a_namespace_call_streams_with_its_namespace(client):
    with client.responses.stream(model="qwen", input="Close the agent named alpha.",
                                 tools=NAMESPACED[:2], max_output_tokens=60, temperature=0,
                                 tool_choice={"type": "function", "name": "close_agent"}) as s:
        final = s.get_final_response()
    call = [o for o in final.output if o.type == "function_call"][0]
    assert call.name == "close_agent" and call.model_dump().get("namespace") == \
        "multi_agent_v1"
