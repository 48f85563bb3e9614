"""llama.cpp's own reply-parser cases, read through offgrid's path, whole and streamed.

``tests/golden/chat_parse_cases.json`` is the pinned source's
``tests/test-chat.cpp`` ported case by case (``scripts/port_chat_parse_cases.py``;
the first test here checks the file is still what the script reads from
the source).  Each case is a template, a request (messages, tools,
reasoning format, thinking, ...), a model output, and the message
llama.cpp reads from it.  Here each goes the way a request goes in the
worker: ``ChatTemplate`` over the template's text, ``prepare_chat`` with
the case's settings (the tool-call rescue on, as by default), then
``parse_reply`` on the whole output, and ``ReplyStream`` fed 3 characters
at a time.  Both must give llama.cpp's message, compared as test-chat.cpp
compares: content and reasoning stripped of surrounding whitespace, each
call's name, its arguments as parsed JSON, and its id where the case names
one (offgrid makes an id for a call the model wrote none for).

Cases offgrid does not meet yet are listed in
tests/golden/chat_parse_known_failing.txt, by id and by way (whole,
streamed, cut-off).  The list is checked exactly: a listed case
that starts to pass fails the test until it is taken off the list, so the
list only shrinks and never hides a regression.  DELIBERATE lists the cases
offgrid answers differently on purpose (docs/compatibility.md says why).
"""

import json
from pathlib import Path

import pytest

from offgrid.chat.prompt import prepare_chat
from offgrid.chat.reply import ReplyStream, parse_reply
from offgrid.chat.template import ChatTemplate, Message, Tool, ToolCall

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "golden" / "chat_parse_cases.json"
CASES = json.loads(DATA.read_text(encoding="utf-8"))["cases"]
PIECE = 3

# A streamed case whose output ends mid-call (``is_partial``): llama.cpp
# shows the call's arguments as they grow; offgrid sends each call once,
# whole, when it is complete (so that no dialect ever takes one back).
DELIBERATE = {c["id"] for c in CASES if c.get("is_partial") and c["expect"]["tool_calls"]}

# A case that continues the last assistant message (continue_final_message):
# llama.cpp's message is the continued one, prefill included; offgrid answers,
# as the Anthropic API and its own recorded responses (tests/golden/replay) do,
# with what was generated after the prefill.  Such a case is held to
# llama.cpp's message less the prefilled content and reasoning.
def expectation(case):
    expect = case["expect"]
    if not case["params"].get("continue_final_message"):
        return expect
    last = case["params"]["messages"][-1]
    out = dict(expect)
    for key in ("content", "reasoning_content"):
        if last[key] and out[key].startswith(last[key]):
            out[key] = out[key][len(last[key]):]
    return out


_KNOWN = Path(__file__).resolve().parent / "golden" / "chat_parse_known_failing.txt"


def _known_failing():
    """{(case id, way)} from the list file: one "ID WAY" a line, '#' comments."""
    out = set()
    for line in _KNOWN.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            cid, way = line.split()
            out.add((cid, way))
    return out


KNOWN_FAILING = _known_failing()


def _message(m):
    parts = [p["text"] for p in m["content_parts"]] or None
    return Message(m["role"], m["content"], parts, m["reasoning_content"],
                   [ToolCall(c["name"], c["arguments"], c["id"]) for c in m["tool_calls"]],
                   m["tool_call_id"], m["tool_name"])


def _tool(t):
    return Tool(t["name"], t["description"], json.loads(t["parameters"]))


_templates = {}


def _template(llama_src, name):
    if name not in _templates:
        src = (llama_src / "models" / "templates" / name).read_text(encoding="utf-8")
        _templates[name] = ChatTemplate(src)
    return _templates[name]


def reply_format(llama_src, case, template=None):
    """The ReplyFormat the worker would read this case's reply with (with
    ``template`` rather than the case's own ChatTemplate, if given)."""
    p = case["params"]
    user = {"role": "user", "content": "Hey there!", "reasoning_content": "", "tool_calls": [],
            "content_parts": [], "tool_name": "", "tool_call_id": ""}
    messages = [_message(m) for m in p.get("messages") or [user]]
    schema = json.loads(p["json_schema"]) if p.get("json_schema") else None
    plan = prepare_chat(None, template or _template(llama_src, case["template"]), messages,
                        [_tool(t) for t in p.get("tools", [])], p.get("tool_choice", "auto"),
                        schema, None, p.get("add_generation_prompt", True),
                        p.get("enable_thinking", True), None, p.get("parallel_tool_calls", False),
                        p.get("reasoning_format", "none"), check=False,
                        continuation=p.get("continue_final_message"))
    return plan.reply_format


def _args(text):
    try:
        return json.loads(text)
    except ValueError:
        return None         # partial JSON: compared as absent, as test-chat.cpp does


def differences(expect, content, reasoning, calls):
    """What differs from llama.cpp's message, as test-chat.cpp compares (empty if nothing)."""
    out = []
    if expect["content"].strip() != content.strip():
        out.append("content %r, llama.cpp %r" % (content, expect["content"]))
    if expect["reasoning_content"].strip() != reasoning.strip():
        out.append("reasoning %r, llama.cpp %r" % (reasoning, expect["reasoning_content"]))
    want = [(c["name"], _args(c["arguments"]), c["id"]) for c in expect["tool_calls"]]
    got = [(c.name, _args(c.arguments), c.id) for c in calls]
    if len(want) != len(got) or any(
            w[:2] != g[:2] or (w[2] and w[2] != g[2]) for w, g in zip(want, got)):
        out.append("calls %r, llama.cpp %r" % (got, want))
    return out


def run_whole(fmt, case):
    r = parse_reply(case["input"], fmt, partial=bool(case.get("is_partial")))
    return differences(expectation(case), r.content, r.reasoning_content, r.tool_calls)


def run_streamed(fmt, case):
    """Feed the output in pieces; what the deltas add up to must be llama.cpp's message."""
    s = ReplyStream(fmt)
    text = case["input"]
    deltas = []
    for i in range(0, len(text), PIECE):
        deltas += s.add(text[i:i + PIECE])
    if not case.get("is_partial"):
        deltas += s.finish()[0]
    content = "".join(d.content for d in deltas if d.content is not None)
    reasoning = "".join(d.reasoning_content for d in deltas if d.reasoning_content is not None)
    calls = [d.tool_call[1] for d in deltas if d.tool_call is not None]
    return differences(expectation(case), content, reasoning, calls)


def run_cut_off(fmt, case):
    """The deliberate difference: llama.cpp shows a cut-off call's arguments
    so far; offgrid sends no call until it is whole, and the rest of what it
    streamed is llama.cpp's."""
    s = ReplyStream(fmt)
    deltas = []
    for i in range(0, len(case["input"]), PIECE):
        deltas += s.add(case["input"][i:i + PIECE])
    content = "".join(d.content for d in deltas if d.content is not None)
    reasoning = "".join(d.reasoning_content for d in deltas if d.reasoning_content is not None)
    calls = [d.tool_call[1] for d in deltas if d.tool_call is not None]
    expect = dict(case["expect"], tool_calls=[])
    return differences(expect, content, reasoning, calls)


WAYS = {"whole": run_whole, "streamed": run_streamed, "cut-off": run_cut_off}


def ways(case):
    return ["cut-off"] if case["id"] in DELIBERATE else ["whole", "streamed"]


def outcome(llama_src, case, way, template=None):
    """[] when offgrid reads the case as llama.cpp does, else what differs."""
    try:
        fmt = reply_format(llama_src, case, template)
    except Exception as e:              # a template offgrid cannot render for this request
        return ["prepare_chat failed: %s: %s" % (type(e).__name__, e)]
    return WAYS[way](fmt, case)


def test_the_data_file_is_what_the_port_reads_from_the_pinned_source(llama_src):
    import sys
    sys.path.insert(0, str(ROOT / "scripts"))
    import port_chat_parse_cases as port
    assert port.port(llama_src) == CASES, \
        "tests/golden/chat_parse_cases.json is stale: run scripts/port_chat_parse_cases.py"
    assert len(CASES) > 400 and len({c["template"] for c in CASES}) >= 58


def test_every_listed_case_exists():
    ids = {c["id"] for c in CASES}
    assert {cid for cid, _ in KNOWN_FAILING} <= ids
    by_id = {c["id"]: c for c in CASES}
    assert all(way in ways(by_id[cid]) for cid, way in KNOWN_FAILING)


@pytest.mark.parametrize("case, way", [(c, w) for c in CASES for w in ways(c)],
                         ids=["%s-%s" % (c["id"], w) for c in CASES for w in ways(c)])
def test_llama_cpp_case(llama_src, case, way):
    diff = outcome(llama_src, case, way)
    if (case["id"], way) in KNOWN_FAILING:
        assert diff, ("%s now reads as llama.cpp does (%s): take it off "
                      "tests/golden/chat_parse_known_failing.txt" % (case["id"], way))
    else:
        assert not diff, "%s (%s):\n  output %r\n  %s" % (
            case["id"], way, case["input"], "\n  ".join(diff))


# -- templates llama.cpp's cases do not cover: offgrid's own -------------------------------

_WEATHER = {"name": "get_weather", "description": "Weather in a city", "parameters": json.dumps(
    {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}})}


def _own(template, output, content, reasoning="", calls=(), **params):
    cid = "own-%s-%d" % (template.split(".")[0], len(OWN_CASES))
    OWN_CASES.append({"id": cid, "template": template, "input": output,
                      "params": dict({"reasoning_format": "auto", "enable_thinking": True},
                                     **params),
                      "expect": {"content": content, "reasoning_content": reasoning,
                                 "tool_calls": [{"name": n, "arguments": json.dumps(a), "id": ""}
                                                for n, a in calls]}})


OWN_CASES = []
# SmolLM3 (the pinned template renders no tools): it thinks in <think> when
# thinking is on (the prompt opens no block), and its prompt writes an empty
# block when it is off; a call, which its template cannot teach, is read in
# the generic form (a bare JSON object, as the tool-call rescue holds it).
_own("HuggingFaceTB-SmolLM3-3B.jinja", "<think>\nParis is in France.\n</think>\nIt is sunny.",
     "It is sunny.", "Paris is in France.")
_own("HuggingFaceTB-SmolLM3-3B.jinja", "<think>\nParis is in France.\n</think>\nIt is sunny.",
     "<think>\nParis is in France.\n</think>\nIt is sunny.", reasoning_format="none")
_own("HuggingFaceTB-SmolLM3-3B.jinja", "It is sunny.", "It is sunny.", enable_thinking=False)
_own("HuggingFaceTB-SmolLM3-3B.jinja", '{"name": "get_weather", "arguments": {"city": "Paris"}}',
     "", "", [("get_weather", {"city": "Paris"})], tools=[_WEATHER])
_own("HuggingFaceTB-SmolLM3-3B.jinja", "<think>\nI need the weather.\n</think>\n"
     '{"name": "get_weather", "arguments": {"city": "Paris"}}',
     "", "I need the weather.", [("get_weather", {"city": "Paris"})], tools=[_WEATHER])
# Phi-3.5-mini: no reasoning, no tools in its template; a <think> it writes
# is its text, a bare JSON call with tools is read as the call.
_own("microsoft-Phi-3.5-mini-instruct.jinja", "It is sunny in Paris.", "It is sunny in Paris.")
_own("microsoft-Phi-3.5-mini-instruct.jinja", "Let me see: <think> is a tag.",
     "Let me see: <think> is a tag.")
_own("microsoft-Phi-3.5-mini-instruct.jinja",
     '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```', "", "",
     [("get_weather", {"city": "Paris"})], tools=[_WEATHER])
_own("microsoft-Phi-3.5-mini-instruct.jinja", "It is sunny.", "It is sunny.", tools=[_WEATHER])

# A continued turn (continue_final_message) in families whose llama.cpp
# reader writes it its own way and that test-chat.cpp does not continue:
# the prompt ends inside the reasoning or the answer, and the reply goes on
# from there (chat/adjust.py's CONTINUED_TURNS).  Messages as llama.cpp
# reads them from prompt + output; offgrid answers without the prefill.


def _continued(template, mode, output, content, reasoning):
    prefill = {"role": "assistant", "content": "Hello, " if mode == "content" else "",
               "reasoning_content": "I'm thinking" if mode == "content" else "I'm",
               "tool_calls": [], "content_parts": [], "tool_name": "", "tool_call_id": ""}
    user = dict(prefill, role="user", content="Hey there!", reasoning_content="")
    _own(template, output, content, reasoning, messages=[user, prefill],
         add_generation_prompt=False, continue_final_message=mode)


_continued("Kimi-K3.jinja", "content", "world!<|close|>response<|sep|>", "Hello, world!",
           "I'm thinking")
_continued("Kimi-K3.jinja", "reasoning", " more<|close|>think<|sep|><|open|>response<|sep|>Hi",
           "Hi", "I'm more")
_continued("Cohere2MoE.jinja", "content", "world!<|END_TEXT|>", "Hello, world!", "I'm thinking")
_continued("Cohere2MoE.jinja", "reasoning", " more<|END_THINKING|><|START_TEXT|>Hi<|END_TEXT|>",
           "Hi", "I'm more")
_continued("muse-glimmer.jinja", "content", "world!<|eot|>", "Hello, world!", "I'm thinking")
_continued("muse-glimmer.jinja", "reasoning",
           " more<|eom|><|start|>assistant to=user<|message|>Hi<|eot|>", "Hi", "I'm more")


@pytest.mark.parametrize("case, way", [(c, w) for c in OWN_CASES for w in ("whole", "streamed")],
                         ids=["%s-%s" % (c["id"], w) for c in OWN_CASES
                              for w in ("whole", "streamed")])
def test_own_case(llama_src, case, way):
    diff = outcome(llama_src, case, way)
    assert not diff, "%s (%s):\n  output %r\n  %s" % (case["id"], way, case["input"],
                                                       "\n  ".join(diff))
