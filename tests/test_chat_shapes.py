"""Call shapes (chat/shapes.py, calls.py, derive.py): declared, derived, and typed.

- Every template of the pinned source reads back its own rendering of a
  call: the text the template puts in an assistant turn for a call is what
  the model learnt to write, so the reply reader must take it as that call.
- A family's shape derived from its template (its table entry removed, as
  for a template nobody listed) reads llama.cpp's cases for that template as
  the declared entry does.
- A tagged argument is typed by the tool's schema: a string stays a string.
"""

import dataclasses
import json

import pytest

from offgrid.chat.calls import read_calls, typed_value
from offgrid.chat.derive import turn_text
from offgrid.chat.reply import ReplyStream, parse_reply
from offgrid.chat.template import ChatTemplate, Message, Tool, ToolCall

try:
    from . import test_chat_parse_cases as cases
except ImportError:
    import test_chat_parse_cases as cases

WEATHER = Tool("get_weather", "Weather in a city", {
    "type": "object", "required": ["city"],
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}})
ASK = [Message("user", "Weather in Paris for three days?")]
CALL = ("get_weather", {"city": "Paris", "days": 3})


def _template(llama_src, name):
    return ChatTemplate((llama_src / "models" / "templates" / name).read_text(encoding="utf-8"))


def _all_templates():
    from tinymodels import llama_cpp_source
    return sorted(p.name for p in (llama_cpp_source() / "models" / "templates").glob("*.jinja"))


# Templates whose rendering of a call is not read back, and why; checked exactly.
NO_CALL_TEXT = {     # the template renders an assistant's calls as nothing
    "HuggingFaceTB-SmolLM3-3B.jinja", "LFM2-8B-A1B.jinja", "LFM2.5-Instruct.jinja",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", "google-gemma-2-2b-it.jinja",
    "ibm-granite-granite-3.3-2B-Instruct.jinja", "llama-cpp-rwkv-world.jinja",
    "microsoft-Phi-3.5-mini-instruct.jinja"}
UNALIGNED = {        # a text turn and a call turn do not share their start: no probe text
    "Cohere2MoE.jinja", "NVIDIA-Nemotron-Nano-v2.jinja"}
UNREAD = {           # the call text is there, and no reader takes it yet
    "upstage-Solar-Open-100B.jinja"}           # derived with the call's id in a marker


@pytest.mark.parametrize("name", _all_templates())
def test_a_templates_own_call_reads_back_as_that_call(llama_src, name):
    t = _template(llama_src, name)
    written = turn_text(t.probe_renderer(), [ToolCall(CALL[0], json.dumps(CALL[1]), "call00001")],
                        [WEATHER])
    if name in UNALIGNED:
        assert written is None
        return
    fmt = t.apply(ASK, [WEATHER]).reply_format
    got = [(c.name, json.loads(c.arguments)) for c in parse_reply(written, fmt).tool_calls]
    if name in NO_CALL_TEXT:
        assert written == "" and got == []
    elif name in UNREAD:
        assert got == [], "%s now reads its own call: take it off UNREAD" % name
    else:
        assert got == [CALL], "%s wrote %r" % (name, written)
        # and streamed in pieces, the call is sent once, whole
        s = ReplyStream(fmt)
        deltas = [d for i in range(0, len(written), 3) for d in s.add(written[i:i + 3])]
        deltas += s.finish()[0]
        sent = [d.tool_call[1] for d in deltas if d.tool_call]
        assert [(c.name, json.loads(c.arguments)) for c in sent] == [CALL]


# Families in the table whose markers the diff finds (all read by llama.cpp's
# auto-parser, none by a reader of its own): with their entry removed, as for
# a template nobody listed, their replies must read as with it -- whatever
# syntax their markers suggest (GLM's and Apriel's <tool_call>/<tool_calls>
# are no hermes JSON, Functionary v3.1's <function=...> no Llama 3 JSON).
DERIVABLE = ["GLM-4.7-Flash.jinja", "GLM-4.6.jinja", "ByteDance-Seed-OSS.jinja",
             "MiniMax-M2.jinja", "deepseek-ai-DeepSeek-V3.1.jinja",
             "meetkai-functionary-medium-v3.1.jinja", "Apertus-8B-Instruct.jinja",
             "unsloth-Apriel-1.5.jinja", "GigaChat3.1-10B-A1.8B.jinja"]
# (Qwen3-Coder's entry says more than its renderings show: its models also
# write <function=...> without <tool_call>, which no rendering does.)


@pytest.mark.parametrize("name", DERIVABLE)
def test_a_template_with_its_entry_removed_reads_its_cases_as_with_it(llama_src, name,
                                                                      monkeypatch):
    import offgrid.chat.template as template_module
    declared = _template(llama_src, name)
    monkeypatch.setattr(template_module, "shape_of", lambda src, family: "")
    derived = _template(llama_src, name)
    monkeypatch.undo()
    assert declared.call_shape and isinstance(derived.call_shape, dict)
    mine = [c for c in cases.CASES if c["template"] == name]
    assert any(c["expect"]["tool_calls"] for c in mine)
    for case in mine:
        for way in cases.ways(case):
            assert not cases.outcome(llama_src, case, way, declared), (case["id"], way)
            assert not cases.outcome(llama_src, case, way, derived), (case["id"], way)


def test_a_template_in_no_entry_gets_a_derived_shape(llama_src):
    """tencent-Hy3 is in no table: its calls are read by the shape its renderings show."""
    t = _template(llama_src, "tencent-Hy3.jinja")
    assert isinstance(t.call_shape, dict) and t.call_shape["key"][0] == "<arg_key:opensource>"
    fmt = t.apply(ASK, [WEATHER]).reply_format
    text = ("Let me look.<tool_calls:opensource><tool_call:opensource>get_weather<tool_sep:opensource>"
            "<arg_key:opensource>city</arg_key:opensource><arg_value:opensource>Paris"
            "</arg_value:opensource><arg_key:opensource>days</arg_key:opensource>"
            "<arg_value:opensource>3</arg_value:opensource></tool_call:opensource>"
            "</tool_calls:opensource>")
    r = parse_reply(text, fmt)
    assert r.content == "Let me look." and \
        [(c.name, json.loads(c.arguments)) for c in r.tool_calls] == [CALL]


# -- arguments typed by the schema ------------------------------------------------------

@pytest.mark.parametrize("raw, schema, value", [
    ("007", {"type": "string"}, "007"),
    ("true", {"type": "string"}, "true"),
    ("3", {"type": "string"}, "3"),
    ("3", {"type": "integer"}, 3),
    ("2.5", {"type": "number"}, 2.5),
    ("true", {"type": "boolean"}, True),
    ("null", {"type": ["string", "null"]}, None),
    ("1abc", {"type": ["string", "integer"]}, "1abc"),
    ("7", {"type": ["string", "integer"]}, 7),
    ('["a", "b"]', {"type": "array"}, ["a", "b"]),
    ("plain words", {}, "plain words"),
    ("42", {}, 42),
    ("celsius", {"enum": ["celsius", "fahrenheit"]}, "celsius"),
])
def test_a_tagged_value_is_typed_by_the_schema(raw, schema, value):
    assert typed_value(raw, schema) == value


def test_a_string_argument_written_as_a_number_stays_a_string():
    tool = {"set_zip": {"type": "object", "properties": {"zip": {"type": "string"},
                                                         "n": {"type": "integer"}}}}
    text = ("<tool_call>\n<function=set_zip>\n<parameter=zip>\n007\n</parameter>\n"
            "<parameter=n>\n7\n</parameter>\n</function>\n</tool_call>")
    _, calls, pending = read_calls(text, "qwen3-coder", False, tool)
    assert not pending and json.loads(calls[0].arguments) == {"zip": "007", "n": 7}


# -- streaming holds only what can still become a call ------------------------------------

def test_text_that_cannot_become_a_call_streams_at_once():
    s = "The tag <tool is not a call, nor is <arg_key> alone."
    content, calls, pending = read_calls(s[:10], "glm", True)
    assert content == "The tag " and not pending     # "<tool" may still be <tool_call>
    content, calls, pending = read_calls(s, "glm", True)
    assert content == s and calls == [] and not pending


def test_a_call_is_held_from_its_marker_until_whole():
    text = "Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Par"
    content, calls, pending = read_calls(text, "glm", True)
    assert (content, calls, pending) == ("Checking.", [], True)
    content, calls, pending = read_calls(text + "is</arg_value></tool_call>", "glm", True)
    assert content == "Checking." and [c.name for c in calls] == ["get_weather"]


def test_a_marker_that_opens_no_call_is_given_back_as_content():
    text = "Use <tool_call> tags like this: <tool_call>{not json}</tool_call>"
    content, calls, _ = read_calls(text, "glm", False)
    assert calls == [] and content == text


# -- a forced call reads back ------------------------------------------------------------

# (gpt-oss's forced form, a message to functions.NAME, is test_chat_tools.py's:
# unprompted, gemma-3-270m fills its JSON with blanks past any short budget.)
FORCED = ["google-gemma-4-31B-it.jinja", "Qwen3.5-4B.jinja", "LFM2.5-8B-A1B.jinja",
          "deepseek-ai-DeepSeek-V3.2.jinja", "GLM-4.7-Flash.jinja",
          "MiniMax-M2.jinja", "moonshotai-Kimi-K2.jinja", "ByteDance-Seed-OSS.jinja"]
CITY = Tool("get_weather", "Weather in a city", {
    "type": "object", "required": ["city"],
    "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}}})


@pytest.mark.parametrize("name", FORCED)
def test_a_forced_call_reads_back_through_the_templates_reader(gemma, llama_src, name):
    """tool_choice "required": the grammar (the family's call shape) makes
    gemma-3-270m write a call, and the template's reply format reads it."""
    try:
        from .test_chat_tools import lazy_run
    except ImportError:
        from test_chat_tools import lazy_run
    prompt = _template(llama_src, name).apply(ASK, [CITY], tool_choice="required")
    assert prompt.grammar and not prompt.grammar_triggers
    text = lazy_run(gemma, prompt.grammar, (), "", 160)   # DSML's call: over 80 tokens
    # written in the family's own syntax (chat/forced.py), from its first marker
    from offgrid.chat.calls import as_shape
    assert text.startswith(as_shape(prompt.reply_format.call_shape).openers[0]), text
    reply = parse_reply(text, prompt.reply_format)
    assert [(c.name, sorted(json.loads(c.arguments))) for c in reply.tool_calls] == \
        [("get_weather", ["city"])], text


# -- served: a shape family's call through the worker, in each dialect ------------------

try:
    from .serverproc import ServerProcess
except ImportError:
    from serverproc import ServerProcess

CITY_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                "parameters": CITY.parameters}}]
ASKED = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def glm(gemma_path, llama_src):
    """gemma-3-270m behind GLM-4.7's template: its calls are read by the "glm" shape."""
    with ServerProcess(gemma_path, "--chat-template",
                       llama_src / "models" / "templates" / "GLM-4.7-Flash.jinja") as s:
        yield s


def _city_call(name, arguments):
    assert name == "get_weather"
    args = arguments if isinstance(arguments, dict) else json.loads(arguments)
    assert set(args) == {"city"} and args["city"] in ("Paris", "Tokyo")


def test_a_shape_familys_forced_call_is_served_as_a_tool_call(glm):
    status, _, body = glm.post("/v1/chat/completions", {
        "model": "m", "messages": ASKED, "tools": CITY_TOOLS, "tool_choice": "required",
        "max_tokens": 60, "temperature": 0})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and not choice["message"].get("content")
    (call,) = choice["message"]["tool_calls"]
    _city_call(call["function"]["name"], call["function"]["arguments"])


def test_a_shape_familys_call_streams_once_whole(glm):
    import openai
    client = openai.OpenAI(base_url=glm.base + "/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(model="m", messages=ASKED, tools=CITY_TOOLS,
                                            tool_choice="required", max_tokens=60,
                                            temperature=0, stream=True)
    chunks = [c for c in stream if c.choices]
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].id
    _city_call(deltas[0].function.name, deltas[0].function.arguments)
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)


def test_a_shape_familys_call_is_a_tool_use_block_in_anthropics_dialect(glm):
    status, _, body = glm.post("/v1/messages", {
        "model": "m", "max_tokens": 60, "temperature": 0, "messages": ASKED,
        "tool_choice": {"type": "any"},
        "tools": [{"name": "get_weather", "description": "Weather",
                   "input_schema": CITY.parameters}]})
    assert status == 200 and body["stop_reason"] == "tool_use", body
    (use,) = [b for b in body["content"] if b["type"] == "tool_use"]
    _city_call(use["name"], use["input"])


@pytest.mark.parametrize("name, text", [
    ("GLM-4.7-Flash.jinja",                 # a declared shape, by name (its prompt opens <think>)
     "Hm.</think>Sure.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"),
    ("tencent-Hy3.jinja",                   # a derived shape, by its fields
     "Sure.<tool_calls:opensource><tool_call:opensource>get_weather<tool_sep:opensource>"
     "<arg_key:opensource>city</arg_key:opensource><arg_value:opensource>Paris"
     "</arg_value:opensource></tool_call:opensource></tool_calls:opensource>"),
])
def test_the_reply_format_reads_the_same_after_the_trip_to_the_front_and_back(
        llama_src, name, text):
    """The worker sends the ReplyFormat to the front as JSON and gets it back
    with the generate frame (engine/worker.py): the shape must survive."""
    from offgrid.engine.worker import _reply_format
    fmt = _template(llama_src, name).apply(ASK, [CITY]).reply_format
    back = _reply_format(json.loads(json.dumps(dataclasses.asdict(fmt))))
    for f in (fmt, back):
        r = parse_reply(text, f)
        assert r.content == "Sure." and \
            [(c.name, json.loads(c.arguments)) for c in r.tool_calls] == \
            [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("name, markers", [
    ("Kimi-K3.jinja", ["<|open|>", "<|sep|>", "<|close|>", '<|open|>call tool="']),
    ("google-gemma-4-31B-it.jinja", ["<|tool_call>", "<tool_call|>"]),
    ("deepseek-ai-DeepSeek-V3.1.jinja", ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>",
                                         "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"]),
    ("moonshotai-Kimi-K2.jinja", ["<|tool_calls_section_begin|>", "<|tool_call_argument_begin|>"]),
    ("tencent-Hy3.jinja", ["<tool_calls:opensource>", "<arg_key:opensource>"]),
])
def test_a_shapes_markers_are_kept_as_text_in_the_reply(llama_src, name, markers):
    """preserved_tokens asks the vocabulary about each of the shape's markers
    and their bracketed pieces: where one is a control token, generation then
    shows its text, so the reader can find it (llama.cpp's preserved tokens)."""
    from offgrid.chat.prompt import reply_markers
    fmt = _template(llama_src, name).apply(ASK, [CITY]).reply_format
    assert set(markers) <= set(reply_markers(fmt))
