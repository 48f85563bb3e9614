"""Streamed replies with tools given, replayed as real clients saw them (issue 14).

Each reply is the text a model wrote, fed to ReplyStream in token-sized
pieces (words, runs of punctuation, whitespace, and each special marker
whole, as a BPE vocabulary cuts them) under the ReplyFormat the model's own
template gives for a request with tools (the templates the goldens in
tests/golden/chat were made from).  What a client notices is when its first
delta comes, and whether calls come back as calls and text as text.
"""

import json
import re
from pathlib import Path

import pytest

from offgrid.chat.reply import OPENER_LIMIT, ReplyStream
from offgrid.chat.template import ChatTemplate, Message, Tool, ToolCall

GOLDEN = Path(__file__).resolve().parent / "golden" / "chat"

WEATHER = Tool("get_weather", "Weather in a city", {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
CLOCK = Tool("get_time", "Time in a zone", {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]})
TOOLS = [WEATHER, CLOCK]
ASK = [Message("user", "What is the weather in Paris?")]

QWEN = "Qwen-Qwen2.5-7B-Instruct"
QWEN_CODER = "Qwen3-Coder"
LLAMA3 = "meta-llama-Llama-3.1-8B-Instruct"
MISTRAL = "mistralai-Mistral-Nemo-Instruct-2407"
PHI = "microsoft-Phi-3.5-mini-instruct"          # no tool support: the generic form
GPT_OSS = "openai-gpt-oss-120b"
ALL = [QWEN, QWEN_CODER, LLAMA3, MISTRAL, PHI, GPT_OSS]

_templates = {}


@pytest.fixture(scope="module")
def template(llama_src):
    def load(name):
        if name not in _templates:
            golden = json.loads((GOLDEN / (name + ".json")).read_text(encoding="utf-8"))
            src = (llama_src / "models" / "templates" / golden["template"]).read_text(
                encoding="utf-8")
            _templates[name] = ChatTemplate(src, golden["bos_token"], golden["eos_token"],
                                            add_bos=True)
        return _templates[name]
    return load


_MARKERS = ("<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "<|channel|>",
            "<|message|>", "<|end|>", "<|start|>", "<|constrain|>", "<|call|>")
_PIECE = re.compile("|".join(re.escape(m) for m in _MARKERS) + r"| ?\w+|\s+|[^\w\s]+")


def pieces(text):
    out = _PIECE.findall(text)
    assert "".join(out) == text
    return out


def replay(fmt, text):
    """(deltas per piece, the finish() deltas, the final reply)."""
    s = ReplyStream(fmt)
    per_piece = [s.add(p) for p in pieces(text)]
    last, reply = s.finish()
    return per_piece, last, reply


def first_content_piece(per_piece):
    return next((i for i, ds in enumerate(per_piece) if any(d.content for d in ds)), None)


def content_of(per_piece, last):
    return "".join(d.content for ds in per_piece + [last] for d in ds if d.content)


def calls_of(reply):
    return [(c.name, json.loads(c.arguments)) for c in reply.tool_calls]


def fmt_for(template, name, messages=ASK):
    fmt = template(name).apply(messages, TOOLS, tool_choice="auto").reply_format
    assert fmt.parse_tools and fmt.tool_names == ("get_weather", "get_time")
    return fmt


NOT_CALLS = {
    "prose": "Sure! Paris is mild in spring, around 15 degrees, with some rain.",
    "code fence": "```python\nimport requests\nprint(requests.get('https://wttr.in/Paris'))\n```",
    "json fence": '```json\n{"city": "Paris", "temperature": 15, "sky": "cloudy"}\n```',
    "json answer": '{"city": "Paris", "temperature": 15, "sky": "cloudy"}',
    "json list": '[{"city": "Paris"}, {"city": "Tokyo"}]',
    "json naming no tool": '{"name": "Paris", "arguments": "none", "sky": "cloudy"}',
}


@pytest.mark.parametrize("kind", sorted(NOT_CALLS))
@pytest.mark.parametrize("name", ALL)
def test_reply_that_is_no_call_streams_from_its_first_pieces(template, name, kind):
    text = NOT_CALLS[kind]
    per_piece, last, reply = replay(fmt_for(template, name), text)
    first = first_content_piece(per_piece)
    assert first is not None and first <= 5, "first content at piece %s of %d" % (
        first, len(per_piece))
    assert content_of(per_piece, last) == text == reply.content
    assert reply.tool_calls == []


QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_qwen_tool_call_is_one_call_and_no_marker_text(template):
    per_piece, last, reply = replay(fmt_for(template, QWEN), QWEN_CALL)
    assert calls_of(reply) == [("get_weather", {"city": "Paris"})]
    assert content_of(per_piece, last) == "" == reply.content
    # sent once its JSON was whole, not at the end of generation
    assert [d.tool_call[0] for ds in per_piece for d in ds if d.tool_call] == [0]
    assert not [d for d in last if d.tool_call]


def test_text_before_a_qwen_call_streams_and_the_marker_does_not(template):
    text = "Let me look that up.\n" + QWEN_CALL
    per_piece, last, reply = replay(fmt_for(template, QWEN), text)
    assert first_content_piece(per_piece) <= 2
    assert content_of(per_piece, last) == "Let me look that up." == reply.content
    assert calls_of(reply) == [("get_weather", {"city": "Paris"})]


def test_parallel_qwen_call_blocks_are_two_calls(template):
    text = QWEN_CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n' \
                       '</tool_call>'
    per_piece, last, reply = replay(fmt_for(template, QWEN), text)
    assert calls_of(reply) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    sent = [d.tool_call for ds in per_piece + [last] for d in ds if d.tool_call]
    assert [i for i, _ in sent] == [0, 1]
    assert content_of(per_piece, last) == ""


def test_qwen3_coder_xml_call_is_one_call(template):
    text = ('<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
            '</function>\n</tool_call>')
    per_piece, last, reply = replay(fmt_for(template, QWEN_CODER), text)
    assert calls_of(reply) == [("get_weather", {"city": "Paris"})]
    assert content_of(per_piece, last) == ""


def test_repeated_json_lines_after_a_tool_result_are_content(template):
    """Qwen2.5-Coder answers a tool result by writing the call again as bare
    JSON lines; in a Hermes template only <tool_call> blocks are calls, so
    these are text (llama-server's reading), and ``llm`` runs nothing."""
    history = ASK + [
        Message("assistant", "", tool_calls=[ToolCall("get_weather", '{"city": "Paris"}',
                                                      "call_1")]),
        Message("tool", '{"temperature": 15}', tool_call_id="call_1")]
    line = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    text = "\n".join([line] * 13)
    per_piece, last, reply = replay(fmt_for(template, QWEN, history), text)
    assert reply.tool_calls == []
    assert first_content_piece(per_piece) == 0
    assert content_of(per_piece, last) == text == reply.content


def test_llama3_bare_json_call_is_a_call(template):
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    per_piece, last, reply = replay(fmt_for(template, LLAMA3), text)
    assert calls_of(reply) == [("get_weather", {"city": "Paris"})]
    assert content_of(per_piece, last) == ""


def test_llama3_call_in_the_openai_wrapper_is_a_call(template):
    text = '{"type": "function", "name": "get_time", "parameters": {"tz": "UTC"}}'
    _, _, reply = replay(fmt_for(template, LLAMA3), text)
    assert calls_of(reply) == [("get_time", {"tz": "UTC"})]


def test_llama3_json_lines_repeating_a_call_are_content(template):
    line = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    text = line + "\n" + line
    per_piece, last, reply = replay(fmt_for(template, LLAMA3), text)
    assert reply.tool_calls == [] and reply.content == text
    # held while it was one call, released as soon as a second began
    assert first_content_piece(per_piece) == len(pieces(line)) + 1


def test_a_name_that_no_tool_has_is_released_within_the_name(template):
    text = '{"name": "get_wind", "parameters": {"city": "Paris"}}'
    per_piece, last, reply = replay(fmt_for(template, LLAMA3), text)
    assert reply.tool_calls == [] and content_of(per_piece, last) == text
    assert "".join(pieces(text)[:first_content_piece(per_piece) + 1]) == '{"name": "get_wind'


def test_a_held_start_is_released_past_the_opener_limit(template):
    """An opener that is still undecided after OPENER_LIMIT characters (here,
    padding) is not one: the hold has a bound whatever the model writes."""
    text = "{" + " " * (OPENER_LIMIT + 50) + '"name": "get_weather", "parameters": {}}'
    s = ReplyStream(fmt_for(template, LLAMA3))
    sent_at = None
    for i in range(len(text)):
        if any(d.content for d in s.add(text[i])):
            sent_at = i
            break
    assert sent_at is not None and sent_at < OPENER_LIMIT + 1


def test_generic_fenced_call_is_a_call(template):
    text = '```json\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n```'
    per_piece, last, reply = replay(fmt_for(template, PHI), text)
    assert calls_of(reply) == [("get_time", {"tz": "UTC"})]
    assert content_of(per_piece, last) == ""


def test_generic_list_of_calls_is_parallel_calls(template):
    text = ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_time", "arguments": {"tz": "CET"}}]')
    _, _, reply = replay(fmt_for(template, PHI), text)
    assert calls_of(reply) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]


def test_mistral_call_after_its_marker_is_a_call(template):
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]'
    per_piece, last, reply = replay(fmt_for(template, MISTRAL), text)
    assert calls_of(reply) == [("get_weather", {"city": "Paris"})]
    assert content_of(per_piece, last) == ""


def test_mistral_json_without_its_marker_is_content(template):
    text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    per_piece, last, reply = replay(fmt_for(template, MISTRAL), text)
    assert reply.tool_calls == [] and first_content_piece(per_piece) == 0


def test_gpt_oss_call_message_is_a_call(template):
    text = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant'
            '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"city": "Paris"}<|call|>')
    per_piece, last, reply = replay(fmt_for(template, GPT_OSS), text)
    assert calls_of(reply) == [("get_weather", {"city": "Paris"})]
    assert reply.reasoning_content == "Need the weather."
    assert content_of(per_piece, last) == ""


def test_a_tool_call_tag_around_no_call_is_released_before_the_end(template):
    text = "<tool_call>\nI cannot call a tool for that, sorry. Paris is mild today."
    per_piece, last, reply = replay(fmt_for(template, QWEN), text)
    assert reply.tool_calls == [] and reply.content == text
    assert first_content_piece(per_piece) <= 3
