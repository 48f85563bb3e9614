"""Tool calls: read per template family, streamed and not, and served end to end.

The first half parses given model output for each family (Hermes/Qwen,
Qwen3-Coder XML, Llama 3.x, Mistral, generic JSON) whole and piece by piece,
with markers split across pieces.  The second half runs a real server with
gemma-3-270m and Qwen2.5's template through the official openai client.  The
base model never calls a tool by itself, so the served calls come from
``tool_choice: required`` / a named function, whose grammar makes the model
write a call in the template's syntax; what it chooses to put in the
arguments is its own (within the tool's schema).
"""

import json

import openai
import pytest

from offgrid.chat.template import (CALL_TRIGGERS, ChatTemplate, Message, Tool, ToolCall, ReplyFormat,
                          tool_call_grammar)
from offgrid.chat.reply import ReplyStream, parse_reply

try:
    from .serverproc import TEST_THREADS, ServerProcess
except ImportError:
    from serverproc import TEST_THREADS, ServerProcess


def fmt(syntax, **kw):
    return ReplyFormat(tool_syntax=syntax, parse_tools=True, **kw)


def streamed(text, f, size):
    """Deltas for ``text`` fed in pieces of ``size`` characters, and the final reply."""
    s = ReplyStream(f)
    deltas = []
    for i in range(0, len(text), size):
        deltas += s.add(text[i:i + size])
    last, reply = s.finish()
    return deltas + last, reply


def calls(reply):
    return [(c.name, json.loads(c.arguments)) for c in reply.tool_calls]


FAMILIES = {
    "hermes": ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
               '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n'
               '</tool_call>',
               "I will check.", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    "qwen3-coder": ('<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n'
                    '<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>',
                    "", [("get_weather", {"city": "New York", "days": 3})]),
    "llama3-tag": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
                   "", [("get_weather", {"city": "Paris"})]),
    "llama3-json": ('{"type": "function", "name": "get_weather", "parameters": {"city": "Oslo"}}',
                    "", [("get_weather", {"city": "Oslo"})]),
    "mistral-json": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, '
                     '"id": "abcdefghi"}, {"name": "get_time", "arguments": {}}]',
                     "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    "mistral-args": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{}',
                     "", [("get_weather", {"city": "Rome"}), ("get_time", {})]),
    "generic": ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Lima"}}]}',
                "", [("get_weather", {"city": "Lima"})]),
    "generic-fenced": ('```json\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n```',
                       "", [("get_time", {"tz": "UTC"})]),
    # gpt-oss: the generation prompt opened the assistant message; a call ends
    # generation (<|call|> is end-of-generation), so it may or may not show
    "harmony": ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant'
                '<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant'
                '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                '{"city": "Paris"}<|call|>',
                "Checking.", [("get_weather", {"city": "Paris"})]),
    "harmony-role": ('<|channel|>analysis<|message|>Time?<|end|><|start|>assistant '
                     'to=functions.get_time<|channel|>commentary json<|message|>{"tz": "CET"}',
                     "", [("get_time", {"tz": "CET"})]),
}
SYNTAX = {"hermes": "hermes", "qwen3-coder": "hermes", "llama3-tag": "llama3",
          "llama3-json": "llama3", "mistral-json": "mistral", "mistral-args": "mistral",
          "generic": "generic", "generic-fenced": "generic", "harmony": "harmony",
          "harmony-role": "harmony"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_parses_whole(family):
    text, content, expected = FAMILIES[family]
    reply = parse_reply(text, fmt(SYNTAX[family]))
    assert reply.content == content
    assert calls(reply) == expected


@pytest.mark.parametrize("size", [1, 2, 5, 13])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_streams_the_same_calls_with_distinct_indexes(family, size):
    text, content, expected = FAMILIES[family]
    deltas, reply = streamed(text, fmt(SYNTAX[family]), size)
    assert "".join(d.content for d in deltas if d.content) == content
    tool_deltas = [d.tool_call for d in deltas if d.tool_call]
    assert [i for i, _ in tool_deltas] == list(range(len(expected)))
    assert [(c.name, json.loads(c.arguments)) for _, c in tool_deltas] == expected
    ids = [c.id for _, c in tool_deltas]
    assert all(ids) and len(set(ids)) == len(ids)
    assert [c.id for c in reply.tool_calls] == ids      # the final reply keeps the sent ids


def test_mistral_ids_from_the_model_are_kept():
    reply = parse_reply(FAMILIES["mistral-json"][0], fmt("mistral"))
    assert reply.tool_calls[0].id == "abcdefghi"


def test_text_without_calls_is_content():
    reply = parse_reply("Just words, and a {brace}.", fmt("hermes"))
    assert reply.content == "Just words, and a {brace}." and reply.tool_calls == []


def test_broken_call_stays_content():
    text = 'Sure <tool_call>{"name": "get_weather", "arguments": {"city":'
    assert parse_reply(text, fmt("hermes")).content == text
    deltas, reply = streamed(text, fmt("hermes"), 3)
    assert "".join(d.content for d in deltas if d.content) == text and not reply.tool_calls


def test_without_tools_nothing_is_parsed_as_a_call():
    f = ReplyFormat(tool_syntax="hermes", parse_tools=False)
    text = FAMILIES["hermes"][0]
    assert parse_reply(text, f).content == text


HARMONY_ANSWER = ('<|channel|>analysis<|message|>The user greets. Reply briefly.<|end|>'
                  '<|start|>assistant<|channel|>final<|message|>Hello! How can I help?')


@pytest.mark.parametrize("size", [1, 3, 7, 200])
def test_harmony_analysis_is_reasoning_and_final_is_content(size):
    f = ReplyFormat(tool_syntax="harmony")
    deltas, reply = streamed(HARMONY_ANSWER, f, size)
    assert reply.reasoning_content == "The user greets. Reply briefly."
    assert reply.content == "Hello! How can I help?" and not reply.tool_calls
    assert "".join(d.reasoning_content for d in deltas if d.reasoning_content) == \
        reply.reasoning_content
    assert "".join(d.content for d in deltas if d.content) == reply.content
    # reasoning streams before the answer; no marker leaks into either
    kinds = [("r" if d.reasoning_content else "c") for d in deltas]
    assert kinds == sorted(kinds, reverse=True)
    assert "<|" not in "".join(d.content or d.reasoning_content or "" for d in deltas)


def test_harmony_reasoning_format_none_keeps_the_analysis_as_written():
    f = ReplyFormat(tool_syntax="harmony", extract_reasoning=False)
    reply = parse_reply(HARMONY_ANSWER, f)
    assert reply.reasoning_content == ""
    # the answer follows the analysis's own <|end|> directly, as llama.cpp gives it
    # (its test-chat.cpp: "...thinking<|end|>Hello, world!")
    assert reply.content == ("<|channel|>analysis<|message|>The user greets. Reply briefly."
                             "<|end|>Hello! How can I help?")


def test_harmony_calls_need_tools_and_whole_json():
    text = FAMILIES["harmony"][0]
    untold = parse_reply(text, ReplyFormat(tool_syntax="harmony", parse_tools=False))
    assert untold.tool_calls == [] and untold.content == "Checking."
    broken = text.replace('{"city": "Paris"}<|call|>', '{"city": "Par')
    assert parse_reply(broken, fmt("harmony")).content == 'Checking.\n\n{"city": "Par'
    s = ReplyStream(fmt("harmony"))
    sent = s.add(text.replace("<|call|>", ""))      # JSON whole, message not closed yet
    assert not [d for d in sent if d.tool_call]
    last, reply = s.finish()
    assert [d.tool_call[1].name for d in last if d.tool_call] == ["get_weather"]


def test_harmony_text_without_channels_streams_as_content():
    deltas, reply = streamed("Plain words, no channels.", ReplyFormat(tool_syntax="harmony"), 4)
    assert reply.content == "Plain words, no channels."
    assert "".join(d.content for d in deltas if d.content) == reply.content
    assert len([d for d in deltas if d.content]) > 1         # while generating, not at the end


def test_harmony_forced_call_json_is_read_as_a_call():
    # a reply that skips the channels and writes the call as bare JSON
    text = '{"name": "get_time", "arguments": {"tz": "UTC"}}'
    assert calls(parse_reply(text, fmt("harmony"))) == [("get_time", {"tz": "UTC"})]
    deltas, _ = streamed(text, fmt("harmony"), 4)
    assert not [d for d in deltas if d.content]


def test_marker_split_across_pieces_is_not_sent_as_content():
    f = fmt("hermes")
    s = ReplyStream(f)
    sent = []
    for piece in ["Hi ", "<tool", "_ca", "ll>\n", '{"name": "f", "arguments": {}}', "</tool_call>"]:
        sent += s.add(piece)
    assert [d.content for d in sent if d.content] == ["Hi"]
    assert [d.tool_call[1].name for d in sent if d.tool_call] == ["f"]


# -- templates decide the syntax; grammars force a parseable call -----------------



def template(llama_src, name):
    return ChatTemplate((llama_src / "models" / "templates" / name).read_text(encoding="utf-8"))


@pytest.mark.parametrize("name, syntax", [
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes"), ("Qwen3-Coder.jinja", "hermes"),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3"),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral"),
    ("microsoft-Phi-3.5-mini-instruct.jinja", "generic"),
    ("openai-gpt-oss-120b.jinja", "harmony"),
])
def test_template_family_is_detected(llama_src, name, syntax):
    assert template(llama_src, name).tool_syntax == syntax


WEATHER = Tool("get_weather", "Weather in a city", {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
    "required": ["city"]})
CLOCK = Tool("get_time", "Time in a zone", {
    "type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}}, "required": ["tz"]})


@pytest.mark.parametrize("syntax", ["hermes", "llama3", "mistral", "mistral-args",
                                    "mistral-callid", "harmony", "generic"])
def test_forced_call_grammar_is_valid_gbnf(gemma, syntax):
    from offgrid import libllama
    from offgrid.chat.gbnf import check_grammar
    for choice, parallel in (("required", False), ("required", True), ("get_time", False)):
        grammar = tool_call_grammar([WEATHER, CLOCK], syntax, choice, parallel)
        check_grammar(gemma, grammar)
        ptr = libllama.init_grammar_sampler(gemma.lib, gemma.handle.vocab, grammar)
        assert ptr, "libllama refused a grammar the Python check passed"
        gemma.lib.llama_sampler_free(ptr)


def test_tool_results_round_trip_through_the_template(llama_src):
    src = (llama_src / "models" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    t = ChatTemplate(src)
    msgs = [Message("user", "Weather in Paris?"),
            Message("assistant", "", tool_calls=[ToolCall("get_weather", '{"city": "Paris"}',
                                                          "call_1")]),
            Message("tool", '{"temperature": 21}', tool_call_id="call_1")]
    prompt = t.apply(msgs, [WEATHER]).text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in prompt
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


# -- tool_choice "auto": a lazy grammar, as llama-server's ---------------------------

def test_auto_tool_choice_waits_for_the_call_opener(llama_src):
    qwen = template(llama_src, "Qwen-Qwen2.5-7B-Instruct.jinja")
    ask = [Message("user", "Weather in Paris?")]
    p = qwen.apply(ask, [WEATHER, CLOCK], tool_choice="auto")
    assert p.grammar_triggers == ("<tool_call>",)
    assert p.grammar == tool_call_grammar([WEATHER, CLOCK], "hermes", "required")
    assert qwen.apply(ask, [WEATHER], tool_choice="none").grammar is None
    assert qwen.apply(ask, [], tool_choice="auto").grammar is None
    forced = qwen.apply(ask, [WEATHER], tool_choice="required")
    assert forced.grammar is not None and forced.grammar_triggers == ()
    # Llama 3's JSON calls have no opener: left free
    llama3 = template(llama_src, "meta-llama-Llama-3.1-8B-Instruct.jinja")
    assert llama3.apply(ask, [WEATHER], tool_choice="auto").grammar is None
    for name, form in (("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral"),
                       ("unsloth-mistral-Devstral-Small-2507.jinja", "mistral-args"),
                       ("Mistral-Small-3.2-24B-Instruct-2506.jinja", "mistral-callid")):
        mistral = template(llama_src, name)
        assert (mistral.tool_syntax, mistral.call_form) == ("mistral", form)
        p = mistral.apply(ask, [WEATHER], tool_choice="auto")
        assert p.grammar_triggers == (CALL_TRIGGERS["mistral"],)
        assert p.grammar == tool_call_grammar([WEATHER], form, "required")
    oss = template(llama_src, "openai-gpt-oss-120b.jinja").apply(ask, [WEATHER], tool_choice="auto")
    assert oss.grammar_triggers == (CALL_TRIGGERS["harmony"],)
    assert oss.grammar == tool_call_grammar([WEATHER], "harmony", "required")


def lazy_run(model, grammar, triggers, forced, n):
    """Greedy text after a prompt: ``forced`` is put in the output first, as if
    the model had written it (fed to the sampler and decoded), then up to ``n``
    tokens are sampled.  The sampler chain is the server's (build_sampler)."""
    from offgrid import libllama
    from offgrid.engine.sampling import build_sampler
    from offgrid.request import SamplingParams
    params = SamplingParams(temperature=0.0, grammar=grammar, grammar_triggers=triggers)
    ctx = libllama.ContextHandle(model.lib, model.handle, 512, 512, 512, TEST_THREADS,
                                 TEST_THREADS)
    sampler = build_sampler(model.lib, params, model.n_vocab, 512, vocab=model.handle.vocab)
    try:
        prompt = model.tokenize("Question: what is the weather in Paris?\nAnswer:")
        assert ctx.decode_parts([(prompt, 0, (0,), ctx.OUT_LAST)]) == 0
        out = model.tokenize(forced, add_special=False) if forced else []
        for t in out:
            sampler.accept(t)
            assert ctx.decode_parts([([t], len(prompt), (0,), ctx.OUT_LAST)]) == 0
            prompt.append(t)
        for _ in range(n):
            t = sampler.sample(ctx)
            if model.is_eog(t):
                break
            out.append(t)
            assert ctx.decode_parts([([t], len(prompt), (0,), ctx.OUT_LAST)]) == 0
            prompt.append(t)
        return model.detokenize(out)
    finally:
        sampler.close()
        ctx.close()


def test_lazy_grammar_leaves_text_free_until_the_opener(gemma):
    grammar = tool_call_grammar([WEATHER, CLOCK], "hermes", "required")
    free = lazy_run(gemma, None, (), "", 12)
    assert "<tool_call>" not in free
    assert lazy_run(gemma, grammar, ("<tool_call>",), "", 12) == free
    # forced from the start, the same grammar allows nothing but a call
    assert lazy_run(gemma, grammar, (), "", 12).startswith("<tool_call>\n{")


def test_harmony_lazy_grammar_makes_a_message_to_a_function(gemma):
    """gpt-oss's form, on gemma's vocabulary (the markers are plain text there)."""
    grammar = tool_call_grammar([WEATHER, CLOCK], "harmony", "required")
    opened = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
              "<|channel|>commentary to=functions.")
    text = lazy_run(gemma, grammar, (CALL_TRIGGERS["harmony"],), opened, 60)
    reply = parse_reply(text, fmt("harmony"))
    assert reply.reasoning_content == "Need the weather."
    (call,) = reply.tool_calls
    assert (call.name, set(json.loads(call.arguments))) in (("get_weather", {"city"}),
                                                             ("get_time", {"tz"}))


@pytest.mark.parametrize("form", ["mistral", "mistral-args", "mistral-callid"])
def test_mistral_lazy_grammar_writes_the_templates_form(gemma, form):
    grammar = tool_call_grammar([WEATHER, CLOCK], form, "required")
    text = lazy_run(gemma, grammar, (CALL_TRIGGERS["mistral"],), "Sure. [TOOL_CALLS]", 60)
    assert text.startswith("Sure. [TOOL_CALLS]" + ("[" if form == "mistral" else ""))
    reply = parse_reply(text, fmt("mistral"))
    assert reply.content == "Sure."
    (call,) = reply.tool_calls
    assert (call.name, set(json.loads(call.arguments))) in (("get_weather", {"city"}),
                                                             ("get_time", {"tz"}))
    assert (len(call.id) == 9) == (form == "mistral-callid")     # the model's own id


def test_lazy_grammar_constrains_the_call_once_opened(gemma):
    grammar = tool_call_grammar([WEATHER, CLOCK], "hermes", "required")
    text = lazy_run(gemma, grammar, ("<tool_call>",), "Let me look. <tool_call>\n", 60)
    reply = parse_reply(text, fmt("hermes"))
    assert reply.content == "Let me look."
    (call,) = reply.tool_calls
    args = json.loads(call.arguments)
    assert (call.name, set(args)) in (("get_weather", {"city"}), ("get_time", {"tz"}))
    assert text.endswith("</tool_call>")      # and nothing after: the grammar is complete


# -- served end to end, through the openai client -----------------------------------

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the weather in a city",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]}}}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Get the time in a timezone",
        "parameters": {"type": "object", "required": ["tz"], "properties": {
            "tz": {"type": "string", "enum": ["UTC", "CET"]}}}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def srv(gemma_path, llama_src):
    qwen = llama_src / "models" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
    with ServerProcess(gemma_path, "--chat-template", qwen) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def required_call(client):
    return client.chat.completions.create(model="m", messages=ASK, tools=TOOLS,
                                          tool_choice="required", max_tokens=40, temperature=0)


def test_required_tool_call(required_call):
    choice = required_call.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    assert call.function.name in ("get_weather", "get_time")
    args = json.loads(call.function.arguments)
    assert set(args) == ({"city"} if call.function.name == "get_weather" else {"tz"})


def test_named_function_streams_one_whole_call(client):
    stream = client.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, max_tokens=40, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    chunks = [c for c in stream if c.choices]
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [d.index for d in deltas] == [0]
    assert deltas[0].id and deltas[0].type == "function"
    assert deltas[0].function.name == "get_time"
    assert json.loads(deltas[0].function.arguments)["tz"] in ("UTC", "CET")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)


def test_tool_result_conversation_is_served(client, required_call, srv):
    call = required_call.choices[0].message.tool_calls[0]
    msgs = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    status, _, body = srv.post("/apply-template", {"messages": msgs, "tools": TOOLS})
    assert status == 200
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in body["prompt"]
    assert call.function.name in body["prompt"]
    r = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=4,
                                       temperature=0, tool_choice="none")
    assert r.choices[0].message.tool_calls is None


def test_auto_tool_choice_lets_the_model_answer_in_text(client):
    """gemma-3 (a base model) does not open a call here; the lazy grammar must
    not force one, and the reply is plain content."""
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=12,
                                       temperature=0, tool_choice="auto")
    choice = r.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_auto_tool_choice_with_a_response_format_answers_the_format(client):
    r = client.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, max_tokens=40, temperature=0, tool_choice="auto",
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": {
            "type": "object", "required": ["city"],
            "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}}}}})
    assert json.loads(r.choices[0].message.content)["city"] in ("Paris", "Lima")


def test_required_tool_call_with_a_response_format_is_400(client):
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        client.chat.completions.create(
            model="m", messages=ASK, tools=TOOLS, max_tokens=4, tool_choice="required",
            response_format={"type": "json_object"})


def test_unknown_named_function_is_400(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="m", messages=ASK, tools=TOOLS, max_tokens=4,
            tool_choice={"type": "function", "function": {"name": "nope"}})


def test_malformed_tools_are_400(srv):
    status, _, body = srv.post("/v1/chat/completions", {"messages": ASK, "tools": [{"x": 1}]})
    assert status == 400 and "tools[0]" in body["error"]["message"]
