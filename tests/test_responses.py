"""The official openai client against offgrid's /v1/responses (the Responses API).

Qwen2.5-Coder-0.5B-Instruct (a tool-calling Qwen template in its GGUF)
serves text, streams, function calls and JSON schemas.  Function calls come
from ``tool_choice`` (a grammar makes the model write one).  The last test
feeds our event writer to the SDK's stream state, for the reasoning items a
non-thinking model never makes.
"""

import json

import openai
import pytest
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from openai._models import construct_type_unchecked

from offgrid.request import Completion, FinishReason, Usage
from offgrid.server import responses as dialect
from offgrid.server.params import Fields, generation_from

try:
    from .serverproc import ROOT, ServerProcess
except ImportError:
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


# -- reasoning, through the SDK's own stream state --------------------------------------------

class _Events:
    def __init__(self):
        self.sent = []

    def send(self, obj, event=None):
        self.sent.append((event, obj))
        return True

    def end(self):
        pass


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
    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for _, obj in es.sent:
        state.handle_event(construct_type_unchecked(type_=ResponseStreamEvent, value=obj))
    final = state._completed_response
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == "The user asks."
    assert final.output_text == "Let me look."
    whole = dialect.output_items(ids, reply)
    assert [(o.type, o.id) for o in final.output] == [(w["type"], w["id"]) for w in whole]


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
