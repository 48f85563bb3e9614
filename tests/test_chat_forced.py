"""Forced calls in each family's own shape (chat/forced.py).

``tool_choice`` "required" (or a named function, or Anthropic's any/tool)
holds the reply to a grammar; for a family with a call shape
(chat/shapes.py) that grammar writes the call as the family's template
renders one, so what is forced is what the model was taught and what its
reader (chat/calls.py) reads back:

- the template's own rendering of a call (and of two, for parallel calls) is
  a text the grammar takes, through libllama's grammar sampler, to its end,
  and the family's reader reads it back as the call;
- the grammar passes the GBNF checks a request's grammar must pass;
- where a marker is one token of the model's vocabulary, the grammar asks
  for that token; end to end over HTTP, tiny models with gemma-4's and
  Qwen3.5's real vocabularies and templates, forced, answer with a call in
  each dialect (OpenAI chat, Anthropic, Responses, Ollama), and a continued
  turn is written as each family's reader writes it.
(Sampled under the grammar by gemma-3-270m and read back whole:
test_chat_shapes.py.)
"""

import json

import pytest

from offgrid import libllama
from offgrid.chat.calls import as_shape
from offgrid.chat.gbnf import check_grammar
from offgrid.chat.reply import parse_reply
from offgrid.chat.template import ChatTemplate, Message, Tool, ToolCall

WEATHER = Tool("get_weather", "Weather in a city", {
    "type": "object", "required": ["city"],
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}})
CALL = ToolCall("get_weather", json.dumps({"city": "Paris", "days": 3}), "call00001")
ASK = [Message("user", "Weather in Paris for three days?")]


def _template(llama_src, name):
    return ChatTemplate((llama_src / "models" / "templates" / name).read_text(encoding="utf-8"))


def _shaped():
    from offgrid.chat.shapes import shape_of
    from offgrid.chat.adjust import template_family
    from tinymodels import llama_cpp_source
    out = []
    for p in sorted((llama_cpp_source() / "models" / "templates").glob("*.jinja")):
        src = p.read_text(encoding="utf-8")
        if shape_of(src, template_family(src)) or p.name in DERIVED:
            out.append(p.name)
    return out


DERIVED = {"tencent-Hy3.jinja", "GigaChat3-10B-A1.8B.jinja",
           "CohereForAI-c4ai-command-r-plus-tool_use.jinja"}
# Shaped templates that render no call text to compare with (chat/shapes.py's
# tests say why): their grammar is still checked and sampled below.
NO_RENDERING = {"LFM2-8B-A1B.jinja", "LFM2.5-Instruct.jinja", "Cohere2MoE.jinja",
                "NVIDIA-Nemotron-Nano-v2.jinja", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja"}


def rendered_call(t, calls=(CALL,), tools=(WEATHER,)):
    """What the template writes after the generation prompt for an assistant
    message of ``calls``, from the shape's first marker to its last."""
    render = t.probe_renderer()
    gp = render(ASK, list(tools), True)
    turn = render(ASK + [Message("assistant", "", tool_calls=list(calls))], list(tools), False)
    shape = as_shape(t.call_shape)
    k = len(gp) if turn.startswith(gp) else len(turn) - len(turn.lstrip())
    if not shape.recipients:
        k = turn.find(shape.openers[0], turn.rfind(ASK[0].content))
    anchor = max(turn.rfind("Paris"), turn.rfind("Rome"))
    ends = [turn.find(m, anchor) + len(m) for m in (shape.section[1], shape.call[1], shape.close)
            if m and turn.find(m, anchor) >= 0]
    if shape.body == "python":
        ends = [turn.find("]" + shape.section[1], anchor) + 1 + len(shape.section[1])]
    if not ends:                    # the calls end where their JSON does
        start = min(i for i in (turn.find("{", k), turn.find("[", k)) if i >= 0)
        ends = [json.JSONDecoder().raw_decode(turn, start)[1]]
    end = max(ends)
    return turn[k:end]


def takes(model, grammar, text):
    """The part of ``text`` libllama's grammar sampler takes, token by token,
    and whether the grammar may end there (an end of generation allowed)."""
    ptr = libllama.init_grammar_sampler(model.lib, model.handle.vocab, grammar)
    assert ptr, "libllama refused the grammar"
    g = libllama.SamplerHandle(model.lib, ptr, "grammar")
    try:
        taken = []
        for tok in model.tokenize(text, add_special=False):
            if not g.allows(tok):
                return model.detokenize(taken), False
            g.accept(tok)
            taken.append(tok)
        eog = [t for t in range(model.n_vocab) if model.is_eog(t)][:1]
        return model.detokenize(taken), bool(eog) and g.allows(eog[0])
    finally:
        g.close()


@pytest.mark.parametrize("name", sorted(set(_shaped()) - NO_RENDERING))
def test_the_forced_grammar_takes_the_templates_own_call(qwen, llama_src, name):
    t = _template(llama_src, name)
    grammar = t.call_grammar([WEATHER], "required", False)
    check_grammar(qwen, grammar)
    text = rendered_call(t)
    taken, complete = takes(qwen, grammar, text)
    assert taken == text and complete, "%s: the grammar stops at %r of %r" % (
        name, text[len(taken):len(taken) + 40], text)
    # and what the grammar takes, the family's reader reads as the call
    fmt = t.apply(ASK, [WEATHER], tool_choice="required").reply_format
    got = [(c.name, json.loads(c.arguments)) for c in parse_reply(text, fmt).tool_calls]
    assert got == [("get_weather", {"city": "Paris", "days": 3})]


@pytest.mark.parametrize("name", sorted(set(_shaped()) - NO_RENDERING))
def test_parallel_forced_calls_take_the_templates_two_calls(qwen, llama_src, name):
    t = _template(llama_src, name)
    shape = as_shape(t.call_shape)
    if shape.recipients and len(shape.recipients) > 2:
        pytest.skip("Muse ends each message to a tool with an end of generation")
    second = ToolCall("get_weather", json.dumps({"city": "Rome"}), "call00002")
    text = rendered_call(t, (CALL, second))
    taken, complete = takes(qwen, t.call_grammar([WEATHER], "required", True), text)
    assert taken == text and complete, "%s: the grammar stops at %r of %r" % (
        name, text[len(taken):len(taken) + 40], text)


# -- end to end: a real family's vocabulary, its template, over HTTP ---------------------

try:
    from . import archmodels
    from .serverproc import ServerProcess
except ImportError:
    import archmodels
    from serverproc import ServerProcess

CITY = {"type": "object", "required": ["city"],
        "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}}}
ASKED = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def gemma4_tiny_path(tiny_dir):
    return archmodels.build("gemma3", tiny_dir, vocab="gemma-4",
                            template="google-gemma-4-31B-it.jinja")


def test_a_forced_call_asks_for_the_vocabularys_own_marker_tokens(lib, gemma4_tiny_path,
                                                                   llama_src):
    """Where a marker is one token of the model's vocabulary, the forced
    grammar asks for that token (not its text in pieces), as the model writes it."""
    from offgrid.chat.prompt import prepare_chat
    from offgrid.engine.model import Model
    model = Model.load(str(gemma4_tiny_path), progress=False)
    try:
        t = _template(llama_src, "google-gemma-4-31B-it.jinja")
        plan = prepare_chat(model, t, ASK, [WEATHER], "required")
        marks = [model.tokenize(m, add_special=False)[0] for m in ("<|tool_call>", "<tool_call|>",
                                                                   '<|"|>')]
        assert all("<[%d]>" % k in plan.grammar for k in marks), plan.grammar
        # the call as gemma-4 writes it, its markers as those tokens, is what it takes
        text = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'
        assert takes(model, plan.grammar, text) == (text, True)
        # and the lazy grammar of tool_choice auto stays text (it is fed its trigger as text)
        lazy = prepare_chat(model, t, ASK, [WEATHER], "auto")
        assert lazy.grammar_triggers and "<[" not in lazy.grammar
    finally:
        model.close()


# family -> (architecture, the pinned source's vocabulary, the family's template)
TINY = {"gemma-4": ("gemma3", "gemma-4", "google-gemma-4-31B-it.jinja"),
        "qwen3.5": ("qwen35", "qwen35", "Qwen3.5-4B.jinja")}


@pytest.fixture(scope="module", params=sorted(TINY))
def family_tiny(request, tiny_dir, llama_src):
    """A tiny model with a family's own vocabulary behind its template, over HTTP:
    gemma-4's (the pinned ggml-vocab-gemma-4.gguf: <|tool_call>, <tool_call|>
    and <|"|> are tokens of it, and forced, it writes them as those tokens), and
    Qwen3.5's (ggml-vocab-qwen35.gguf, whose <tool_call>, <function=... it
    writes in pieces of text), thinking on as the template's default: forced,
    each writes its family's call syntax.  (server, family)"""
    arch, vocab, template = TINY[request.param]
    path = archmodels.build(arch, tiny_dir, vocab=vocab, template=template)
    with ServerProcess(path, "--chat-template", llama_src / "models" / "templates" / template) \
            as s:
        yield s, request.param


def _is_city_call(name, arguments):
    args = arguments if isinstance(arguments, dict) else json.loads(arguments)
    return name == "get_weather" and set(args) == {"city"} and args["city"] in ("Paris", "Tokyo")


def test_a_forced_call_in_a_real_vocabulary_is_an_openai_tool_call(family_tiny):
    server, _ = family_tiny
    status, _, body = server.post("/v1/chat/completions", {
        "model": "m", "messages": ASKED, "tool_choice": "required", "max_tokens": 60,
        "temperature": 0, "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "Weather", "parameters": CITY}}]})
    assert status == 200, body
    choice = body["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
    assert _is_city_call(call["function"]["name"], call["function"]["arguments"]), call


def test_a_forced_call_in_a_real_vocabulary_is_an_anthropic_tool_use(family_tiny):
    server, _ = family_tiny
    status, _, body = server.post("/v1/messages", {
        "model": "m", "max_tokens": 60, "temperature": 0, "messages": ASKED,
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "tools": [{"name": "get_weather", "description": "Weather", "input_schema": CITY}]})
    assert status == 200 and body["stop_reason"] == "tool_use", body
    (use,) = [b for b in body["content"] if b["type"] == "tool_use"]
    assert _is_city_call(use["name"], use["input"]), use


def test_a_forced_call_in_a_real_vocabulary_is_a_responses_function_call(family_tiny):
    server, _ = family_tiny
    status, _, body = server.post("/v1/responses", {
        "model": "m", "input": ASKED, "tool_choice": "required", "max_output_tokens": 60,
        "temperature": 0, "tools": [{"type": "function", "name": "get_weather",
                                     "description": "Weather", "parameters": CITY}]})
    assert status == 200, body
    (call,) = [o for o in body["output"] if o["type"] == "function_call"]
    assert _is_city_call(call["name"], call["arguments"]), call


def test_a_forced_call_in_a_real_vocabulary_is_an_ollama_tool_call(family_tiny):
    server, _ = family_tiny
    status, _, body = server.post("/api/chat", {
        "model": "m", "messages": ASKED, "stream": False, "tool_choice": "required",
        "options": {"temperature": 0, "num_predict": 60},
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "Weather", "parameters": CITY}}]})
    assert status == 200, body
    (call,) = body["message"]["tool_calls"]
    assert _is_city_call(call["function"]["name"], call["function"]["arguments"]), call


# the end of a continued turn's prompt, by the part that goes on (True: by the
# message, here its reasoning), as each family's llama.cpp reader writes it
CONTINUED = {
    "gemma-4": {"content": "<|turn>model\n<|channel>thought\nI'm thinking<channel|>",
                "reasoning_content": "<|turn>model\n<|channel>thought\nI'm thinking",
                True: "<|turn>model\n<|channel>thought\nI'm thinking"},
    "qwen3.5": {"content": "<|im_start|>assistant\n<think>\nI'm thinking\n</think>\n\n",
                "reasoning_content": "<|im_start|>assistant\n<think>\nI'm thinking",
                True: "<|im_start|>assistant\n<think>\nI'm thinking"}}


@pytest.mark.parametrize("part", ["content", "reasoning_content", True])
def test_continue_final_message_names_the_part_that_goes_on(family_tiny, part):
    """llama-server's continue_final_message "content" / "reasoning_content":
    a message with reasoning only is continued after its closed reasoning, or
    inside it, written as the family's reader writes it."""
    server, family = family_tiny
    status, _, body = server.post("/apply-template", {
        "add_generation_prompt": False, "continue_final_message": part, "messages": ASKED + [
            {"role": "assistant", "content": "", "reasoning_content": "I'm thinking"}]})
    assert status == 200, body
    assert body["prompt"].endswith(CONTINUED[family][part]), body["prompt"][-80:]


def test_every_shapes_lazy_grammar_and_trigger_are_taken_by_libllama(qwen_path, llama_src):
    """tool_choice auto: the shape's grammar, lazy from its first marker.  libllama
    compiles the trigger with std::regex, which throws through the C API on
    what it cannot read, so this runs in a child process: a crash fails it."""
    import subprocess
    import sys
    from pathlib import Path
    names = sorted(_shaped())
    child = """if 1:
        import sys
        sys.path.insert(0, %r)
        from offgrid import libllama
        from offgrid.engine.model import Model
        from test_chat_forced import WEATHER, ASK, _template
        from pathlib import Path
        model = Model.load(%r, progress=False)
        for name in %r:
            p = _template(Path(%r), name).apply(ASK, [WEATHER], tool_choice="auto")
            if not p.grammar_triggers:
                continue
            ptr = libllama.init_grammar_sampler(model.lib, model.handle.vocab, p.grammar,
                                                p.grammar_triggers)
            assert ptr, name
            model.lib.llama_sampler_free(ptr)
            print("ok", name)
    """ % (str(Path(__file__).parent), str(qwen_path), names, str(llama_src))
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                       timeout=120, cwd=str(Path(__file__).parent.parent))
    assert r.returncode == 0, r.stderr[-2000:]
    lazy = {line.split()[1] for line in r.stdout.splitlines()}
    # every shape but those whose calls are messages to a recipient, and those
    # opened by a word the model may write in its text (code's "functools")
    assert set(names) - lazy == {
        "meetkai-functionary-medium-v3.2.jinja", "muse-glimmer.jinja",
        "fireworks-ai-llama-3-firefunction-v2.jinja",
        "CohereForAI-c4ai-command-r-plus-tool_use.jinja"}
