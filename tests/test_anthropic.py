"""The official anthropic client against offgrid's /v1/messages: what Claude SDK users run.

Qwen2.5-Coder-0.5B-Instruct (its GGUF carries a tool-calling Qwen template)
serves text, streams and tools.  The model never decides to call a tool on
its own reliably, so the served call comes from ``tool_choice`` (a grammar
makes it write the call); what it puts in the arguments is its own, within
the tool's schema.  The last tests feed our own event writer to the SDK's
stream accumulator, for the thinking blocks a non-thinking model never makes.
"""

import anthropic
import pytest
from anthropic.lib.streaming._messages import accumulate_event

from offgrid.request import Completion, FinishReason, Usage
from offgrid.server.api import anthropic as dialect

try:
    from .serverproc import ROOT, ServerProcess
except ImportError:
    from serverproc import ROOT, ServerProcess

QWEN = ROOT / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
KEY = "sk-ant-test"
HI = [{"role": "user", "content": "Say hello."}]
GREEDY = {"temperature": 0}     # the SDK no longer has a temperature argument
TOOLS = [{"name": "get_weather", "description": "The weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def srv():
    assert QWEN.is_file(), "the Qwen2.5-Coder model is missing at %s" % QWEN
    with ServerProcess(QWEN, "--api-key", KEY, threads=1) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return anthropic.Anthropic(base_url=srv.base, api_key=KEY, max_retries=0)


# -- text -------------------------------------------------------------------------------

def test_create_answers_with_a_text_block(client):
    m = client.messages.create(model="qwen", max_tokens=24, messages=HI, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    (block,) = m.content
    assert block.type == "text" and "hello" in block.text.lower()
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 24


def test_system_prompt_as_blocks_is_part_of_the_prompt(client):
    one = client.messages.count_tokens(model="qwen", messages=HI, system="You are a pirate.")
    two = client.messages.count_tokens(
        model="qwen", messages=HI,
        system=[{"type": "text", "text": "You are a pirate."},
                {"type": "text", "text": "Answer briefly."}])
    assert two.input_tokens > one.input_tokens > 0


def test_max_tokens_stops_with_max_tokens(client):
    m = client.messages.create(model="qwen", max_tokens=2, extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Count from 1 to 50."}])
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2


def test_stop_sequence_is_reported(client):
    m = client.messages.create(model="qwen", max_tokens=40, extra_body=GREEDY,
                               stop_sequences=["3"],
                               messages=[{"role": "user", "content":
                                          "Count from 1 to 10, separated by commas."}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "3"
    assert "3" not in m.content[0].text and "2" in m.content[0].text


def test_stream_gives_text_deltas_and_the_sdk_assembles_the_message(client):
    with client.messages.stream(model="qwen", max_tokens=24, messages=HI,
                                extra_body=GREEDY) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert len(pieces) > 1
    assert final.content[0].type == "text" and final.content[0].text == "".join(pieces)
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.input_tokens > 0 and final.usage.output_tokens > 0


def test_stream_event_sequence(client):
    with client.messages.create(model="qwen", max_tokens=4, messages=HI, extra_body=GREEDY,
                                stream=True) as events:
        types = [e.type for e in events]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}


def test_count_tokens(client):
    n = client.messages.count_tokens(model="qwen", messages=HI)
    m = client.messages.create(model="qwen", max_tokens=1, messages=HI, extra_body=GREEDY)
    assert n.input_tokens == m.usage.input_tokens


# -- tools ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def forced_call(client):
    return client.messages.create(model="qwen", max_tokens=60, messages=ASK, tools=TOOLS,
                                  tool_choice={"type": "tool", "name": "get_weather"},
                                  extra_body=GREEDY)


def test_named_tool_choice_forces_a_tool_use_block(forced_call):
    assert forced_call.stop_reason == "tool_use"
    (use,) = [b for b in forced_call.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    assert isinstance(use.input, dict) and isinstance(use.input.get("city"), str)


def test_tool_result_goes_back_and_text_comes_out(client, forced_call):
    use = [b for b in forced_call.content if b.type == "tool_use"][0]
    history = ASK + [{"role": "assistant",
                      "content": [b.model_dump(exclude_none=True) for b in forced_call.content]}]
    turn = history + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use.id, "content": "21 degrees and sunny"}]}]
    before = client.messages.count_tokens(model="qwen", messages=history + [
        {"role": "user", "content": "ok"}], tools=TOOLS)
    after = client.messages.count_tokens(model="qwen", messages=turn, tools=TOOLS)
    assert after.input_tokens > before.input_tokens      # the result is in the prompt
    m = client.messages.create(model="qwen", max_tokens=16, messages=turn, tools=TOOLS,
                               tool_choice={"type": "none"}, extra_body=GREEDY)
    assert m.content[0].type == "text" and m.content[0].text.strip()
    assert m.stop_reason in ("end_turn", "max_tokens")


def test_streamed_tool_use_arrives_as_input_json(client):
    with client.messages.stream(model="qwen", max_tokens=60, messages=ASK, tools=TOOLS,
                                tool_choice={"type": "any"}, extra_body=GREEDY) as s:
        types = [e.type for e in s]
        final = s.get_final_message()
    assert "input_json" in types
    assert final.stop_reason == "tool_use"
    use = [b for b in final.content if b.type == "tool_use"][0]
    assert use.name == "get_weather" and isinstance(use.input.get("city"), str)


# -- errors in Anthropic's shape -----------------------------------------------------------

def _is_anthropic_error(body, kind="invalid_request_error"):
    return body["type"] == "error" and body["error"]["type"] == kind \
        and isinstance(body["error"]["message"], str) and body["error"]["message"]


def test_missing_max_tokens_is_a_400_in_anthropic_shape(srv):
    status, _, body = srv.post("/v1/messages", {"model": "q", "messages": HI},
                               headers={"x-api-key": KEY})
    assert status == 400 and _is_anthropic_error(body)
    assert "max_tokens" in body["error"]["message"]


@pytest.mark.parametrize("bad", [
    {"max_tokens": "ten", "messages": HI},
    {"max_tokens": 8, "messages": "hello"},
    {"max_tokens": 8, "messages": [{"role": "robot", "content": "hi"}]},
    {"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
    {"max_tokens": 8, "messages": HI, "tool_choice": {"type": "sometimes"}},
    {"max_tokens": 8, "messages": HI, "tools": TOOLS, "tool_choice": {"type": "tool",
                                                                      "name": "nope"}},
    {"max_tokens": 8, "messages": HI, "system": 42},
    {"max_tokens": 8, "messages": HI, "thinking": "yes"},
    {"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": 7, "content": "x"}]}]},
])
def test_wrong_types_are_400s_in_anthropic_shape(srv, bad):
    status, _, body = srv.post("/v1/messages", dict(bad, model="q"),
                               headers={"x-api-key": KEY})
    assert status == 400 and _is_anthropic_error(body)


def test_prompt_longer_than_the_context_is_a_400_in_anthropic_shape(srv):
    long = [{"role": "user", "content": "word " * 3000}]
    status, _, body = srv.post("/v1/messages", {"max_tokens": 8, "messages": long},
                               headers={"x-api-key": KEY})
    assert status == 400 and _is_anthropic_error(body)
    assert "context" in body["error"]["message"]


def test_sdk_raises_bad_request_with_the_body(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="qwen", max_tokens=0, messages=HI)
    assert _is_anthropic_error(e.value.body)


def test_wrong_key_is_a_401_in_anthropic_shape(srv):
    client = anthropic.Anthropic(base_url=srv.base, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        client.messages.count_tokens(model="qwen", messages=HI)
    assert _is_anthropic_error(e.value.body, "authentication_error")


def test_other_routes_keep_openai_errors(srv):
    status, _, body = srv.post("/v1/chat/completions", {"messages": "x"},
                               headers={"x-api-key": KEY})
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert "type" not in body


# -- thinking, through the SDK's own accumulator ---------------------------------------------

class _Events:
    """An EventStream stand-in that keeps (event name, payload) pairs."""

    def __init__(self):
        self.sent = []

    def send(self, obj, event=None):
        self.sent.append((event, obj))
        return True


def test_reasoning_becomes_a_thinking_block_streamed_and_whole():
    reply = {"reasoning_content": "The user greets.", "content": "Hello!", "tool_calls": [
        {"id": "t1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}]}
    c = Completion("", [], FinishReason.STOP, "eos", "", Usage(7, 0, 5), reply=reply)
    es = _Events()
    st = dialect._Stream(es, "msg_1", "m", 7)
    for d in ({"reasoning_content": "The user "}, {"reasoning_content": "greets."},
              {"content": "Hello"}, {"content": "!"}, {"tool_call": [0, reply["tool_calls"][0]]}):
        st.delta(d)
    st.finish(c)
    assert all(name == obj["type"] for name, obj in es.sent)
    snapshot, bufs = None, {}
    for _, obj in es.sent:
        snapshot = accumulate_event(event=obj, current_snapshot=snapshot, json_bufs=bufs)
    whole = dialect.content_blocks(reply)
    streamed = [b.to_dict() for b in snapshot.content]
    assert [b["type"] for b in streamed] == [b["type"] for b in whole] \
        == ["thinking", "text", "tool_use"]
    assert streamed[0]["thinking"] == whole[0]["thinking"] == "The user greets."
    assert streamed[1]["text"] == "Hello!"
    assert streamed[2]["input"] == whole[2]["input"] == {"city": "Oslo"}
    assert snapshot.stop_reason == "tool_use" and snapshot.usage.output_tokens == 5


# -- Claude Code's requests, as it sends them ----------------------------------------------

# Claude Code 2.1's tools' schema features: JSON Schema 2020-12, integer bounds
# up to 2^53-1, a pattern, a record (propertyNames), a deferred tool, and a
# server tool it may list
CC_TOOLS = [
    {"name": "Read", "description": "Read a file.", "cache_control": {"type": "ephemeral"},
     "input_schema": {"$schema": "https://json-schema.org/draft/2020-12/schema",
                      "type": "object", "required": ["file_path"], "additionalProperties": False,
                      "properties": {
                          "file_path": {"type": "string"},
                          "offset": {"type": "integer", "minimum": 0,
                                     "maximum": 9007199254740991},
                          "limit": {"type": "integer", "exclusiveMinimum": 0}}}},
    {"name": "Workflow", "description": "Run a workflow.", "input_schema": {
        "type": "object", "properties": {
            "resumeFromRunId": {"type": "string", "pattern": "^wf_[a-z0-9-]{6,}$"},
            "env": {"type": "object", "propertyNames": {"pattern": "^[A-Z_]+$"},
                    "additionalProperties": {"type": "string"}},
            "budget": {"type": "number", "minimum": 0, "maximum": 1}}}},
    {"name": "Later", "description": "A deferred tool.", "defer_loading": True,
     "input_schema": {"type": "object", "properties": {}}},
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
]


def cc_request(**over):
    body = {
        "model": "claude-sonnet", "max_tokens": 32000, "stream": False,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1"},
                   {"type": "text", "text": "You are a helpful agent.",
                    "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Say hello.",
                                          "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": [{"type": "text", "text": "# Environment\nPlatform: linux"}]}],
        "tools": CC_TOOLS,
        "metadata": {"user_id": "{\"device_id\": \"abc\"}"},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"}, "temperature": 0}
    body.update(over)
    return body


def test_claude_codes_first_request_is_answered(srv):
    """Every field Claude Code 2.1 sends, the ?beta=true query and its beta headers."""
    status, _, body = srv.post("/v1/messages?beta=true", cc_request(max_tokens=16), headers={
        "x-api-key": KEY, "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                          "context-management-2025-06-27,advanced-tool-use-2025-11-20"})
    assert status == 200, body
    assert body["type"] == "message" and body["content"]


def test_its_system_turn_is_in_the_prompt_and_its_deferred_tool_is_not(srv):
    status, _, with_note = srv.post("/v1/messages/count_tokens?beta=true", cc_request(),
                                    headers={"x-api-key": KEY})
    req = cc_request()
    req["messages"] = req["messages"][:1]
    _, _, without = srv.post("/v1/messages/count_tokens", req, headers={"x-api-key": KEY})
    assert status == 200 and with_note["input_tokens"] > without["input_tokens"]
    msgs, referenced = dialect.messages_from(None, cc_request()["messages"]), set()
    assert [m.role for m in msgs] == ["user", "system"]
    names = [t.name for t in dialect.tools_from(CC_TOOLS, referenced)]
    assert names == ["Read", "Workflow"]        # Later deferred, web_search not ours to run


def test_a_tool_reference_brings_a_deferred_tool_in():
    referenced = set()
    msgs = dialect.messages_from(None, [
        {"role": "user", "content": "find a tool"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch",
                                           "input": {"query": "later"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "tool_reference", "tool_name": "Later"}]}]}], referenced)
    assert referenced == {"Later"} and "Later" in msgs[-1].content
    assert [t.name for t in dialect.tools_from(CC_TOOLS, referenced)] == \
        ["Read", "Workflow", "Later"]


def test_its_tool_schemas_constrain_a_forced_call(srv):
    import re
    status, _, body = srv.post("/v1/messages", cc_request(
        max_tokens=200, tool_choice={"type": "tool", "name": "Workflow"},
        messages=[{"role": "user", "content": "Resume workflow run wf_abcdef12."}]),
        headers={"x-api-key": KEY})
    assert status == 200, body
    call = [b for b in body["content"] if b["type"] == "tool_use"][0]
    args = call["input"]
    if "resumeFromRunId" in args:
        assert re.fullmatch(r"wf_[a-z0-9-]{6,}", args["resumeFromRunId"]), args
    if "budget" in args:
        assert 0 <= args["budget"] <= 1
    for k in args.get("env", {}):
        assert re.fullmatch(r"[A-Z_]+", k)


def test_unknown_thinking_types_are_the_templates_default_not_a_400(srv):
    status, _, body = srv.post("/v1/messages", dict(cc_request(max_tokens=8),
                                                    thinking={"type": "auto"}),
                               headers={"x-api-key": KEY})
    assert status == 200, body
