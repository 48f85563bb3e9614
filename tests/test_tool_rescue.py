"""The tool-call rescue (offgrid/chat/rescue.py, engine/sampling.py CallRescue).

With tools and tool_choice "auto", Qwen2.5-Coder-0.5B writes its calls as bare
JSON ({"name": "Read", "arguments": {...}}, sometimes in a ```json fence) and
then invents the result.  A reply that opens that way with a given tool's name
is held to that tool's call grammar, ends with the object, and is read as the
call; anything else is left as it is.  --no-tool-call-rescue turns it off.
"""

import json

import openai
import pytest

from offgrid import libllama
from offgrid.chat.gbnf import check_grammar
from offgrid.chat.prompt import prepare_chat
from offgrid.chat.reply import ReplyStream, parse_reply
from offgrid.chat.rescue import bare_call_grammar, call_key, finished_calls, rescue_of, tool_args
from offgrid.chat.template import ChatTemplate, ReplyFormat
from offgrid.engine.sampling import build_sampler
from offgrid.request import SamplingParams
from offgrid.request import Message, Tool, ToolCall

try:
    from .serverproc import ROOT, TEST_THREADS, ServerProcess
except ImportError:
    from serverproc import ROOT, TEST_THREADS, ServerProcess

QWEN = ROOT / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
READ = Tool("Read", "Read a file from the local filesystem.", {
    "type": "object", "required": ["file_path"], "additionalProperties": False,
    "properties": {"file_path": {"type": "string", "description": "The absolute path"},
                   "offset": {"type": "integer", "minimum": 0, "maximum": 9007199254740991},
                   "pages": {"type": "string", "description": "Page range for PDF files "
                                                             "(e.g., \"1-5\")."}}})
BASH = Tool("Bash", "Run a shell command.", {
    "type": "object", "required": ["command"],
    "properties": {"command": {"type": "string"}}})
GOAL = Tool("get_goal", "Get the current goal.", {"type": "object", "properties": {}})
TOOLS = [READ, BASH, GOAL]
READ_IT = "Use the Read tool to read /tmp/notes.txt and tell me what it says."


# -- reading a rescued reply ------------------------------------------------------------

FMT = ReplyFormat(tool_syntax="hermes", parse_tools=True, tool_names=("Read", "Bash"),
                  bare_calls=True)


@pytest.mark.parametrize("text", [
    '{"name": "Read", "arguments": {"file_path": "/a"}}',
    '```json\n{"name": "Read", "arguments": {"file_path": "/a"}}',
    '```json\n{"name": "Read", "arguments": {"file_path": "/a"}}\n```',
    '  {"name": "Read", "parameters": {"file_path": "/a"}}',
])
def test_a_rescued_reply_is_one_call(text):
    r = parse_reply(text, FMT)
    assert r.content == "" and [(c.name, json.loads(c.arguments)) for c in r.tool_calls] == \
        [("Read", {"file_path": "/a"})]
    stream = ReplyStream(FMT)
    deltas = [d for ch in text for d in stream.add(ch)]
    last, whole = stream.finish()
    assert [d for d in deltas + last if d.content] == []
    assert [d.tool_call[1].name for d in deltas + last if d.tool_call] == ["Read"]


@pytest.mark.parametrize("text", [
    "The file says hello.",
    '{"city": "Paris", "name": "Read"}',
    '{"name": "Write", "arguments": {}}',
    '{"name": "Read", "arguments": {"file_path": "/a"}}\nThe result was: hello',
    "```python\nprint('hi')\n```",
])
def test_anything_else_is_content(text):
    r = parse_reply(text, FMT)
    assert r.tool_calls == [] and r.content == text.strip()


CODEX_LIKE = [Tool("exec_command", "", {"type": "object", "required": ["cmd"],
                                          "properties": {"cmd": {}, "workdir": {}}}),
              Tool("write_stdin", "", {"type": "object", "required": ["session_id"],
                                       "properties": {"session_id": {}, "chars": {}}}),
              Tool("get_goal", "", {"type": "object", "properties": {}})]
FMT_ARGS = ReplyFormat(tool_syntax="hermes", parse_tools=True, bare_calls=True,
                       tool_names=tuple(t.name for t in CODEX_LIKE),
                       tool_args=tool_args(CODEX_LIKE))


def test_a_call_naming_no_tool_is_read_by_its_arguments():
    """Qwen 0.5B with Codex's tools: the command where exec_command's name belongs."""
    text = ('```json\n{\n  "name": "cat calc.py",\n  "arguments": {"cmd": "cat calc.py", '
            '"workdir": "/w", "required": ["cmd"]}\n}\n```')
    calls = parse_reply(text, FMT_ARGS).tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("exec_command", {"cmd": "cat calc.py", "workdir": "/w"})]     # unknown keys dropped
    chatty = '{"name": "cat", "arguments": {"cmd": "cat a"}, "message": "Running it..."}'
    assert [c.name for c in parse_reply(chatty, FMT_ARGS).tool_calls] == ["exec_command"]


@pytest.mark.parametrize("text", [
    '{"name": "Alice", "age": 3}',                              # an answer, not a call
    '{"name": "x", "arguments": {"foo": 1}}',                   # fits no tool
    '{"name": "x", "arguments": {"cmd": "a", "session_id": 1}}',   # fits two
    '{"name": "x", "arguments": "cmd"}',                        # arguments not an object
])
def test_arguments_that_fit_no_single_tool_leave_it_content(text):
    assert parse_reply(text, FMT_ARGS).tool_calls == []


# Claude Code's Read and Codex's exec_command, as they send them (abridged)
CLAUDE_READ = Tool("Read", "Reads a file.", {
    "type": "object", "required": ["file_path"], "additionalProperties": False,
    "properties": {
        "file_path": {"type": "string", "description": "The absolute path to the file to read"},
        "offset": {"type": "integer", "minimum": 0, "maximum": 9007199254740991,
                   "description": "The line number to start reading from."},
        "limit": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9007199254740991,
                  "description": "The number of lines to read."},
        "pages": {"type": "string", "description": "Page range for PDF files (e.g., \"1-5\", "
                  "\"3\", \"10-20\"). Only applicable to PDF files."},
        "allow_large": {"type": "boolean", "description": "Set to true to read a large file."}}})
CODEX_EXEC = Tool("exec_command", "Runs a command.", {
    "type": "object", "required": ["cmd"], "additionalProperties": False,
    "properties": {
        "cmd": {"type": "string", "description": "Shell command to execute."},
        "justification": {"type": "string", "description": "User-facing approval question for "
                                                           "`require_escalated`; omit otherwise."},
        "prefix_rule": {"type": "array", "items": {"type": "string"}, "description":
                        "Reusable approval prefix for `cmd`; for example [\"git\", \"pull\"]."},
        "sandbox_permissions": {"type": "string", "enum": ["use_default", "require_escalated"],
                                "description": "Per-command sandbox override."},
        "workdir": {"type": "string", "description": "Working directory for the command. "
                                                     "Defaults to the turn cwd."},
        "yield_time_ms": {"type": "number", "description": "Wait before yielding output."}}})
FMT_AGENTS = ReplyFormat(tool_syntax="hermes", parse_tools=True, bare_calls=True,
                         tool_names=("Read", "exec_command"),
                         tool_args=tool_args([CLAUDE_READ, CODEX_EXEC]))


def _args_of(text, fmt=FMT_AGENTS):
    return [(c.name, json.loads(c.arguments)) for c in parse_reply(text, fmt).tool_calls]


@pytest.mark.parametrize("written, kept", [
    # what Qwen 0.5B copied out of the schemas (seen with the real clients)
    ({"file_path": "/w/a.txt", "offset": 9007199254740991, "limit": 9007199254740991,
      "pages": "", "allow_large": True},
     {"file_path": "/w/a.txt", "allow_large": True}),
    ({"file_path": "/w/a.txt", "pages": "Page range for PDF files"}, {"file_path": "/w/a.txt"}),
    # what a caller means stays
    ({"file_path": "/w/a.txt", "offset": 120, "limit": 40, "pages": "1-5"},
     {"file_path": "/w/a.txt", "offset": 120, "limit": 40, "pages": "1-5"}),
])
def test_a_rescued_call_loses_what_it_copied_out_of_the_schema_only(written, kept):
    call = json.dumps({"name": "Read", "arguments": written})
    assert _args_of(call) == [("Read", kept)]
    stream = ReplyStream(FMT_AGENTS)
    deltas = [d for ch in call for d in stream.add(ch)]
    last, whole = stream.finish()
    assert [json.loads(d.tool_call[1].arguments) for d in deltas + last if d.tool_call] == [kept]


def test_codex_exec_command_keeps_its_workdir_and_loses_copied_prose():
    written = {"cmd": "cat calc.py", "justification": "User-facing approval question for "
               "`require_escalated`", "prefix_rule": ["git", "pull"],
               "sandbox_permissions": "use_default", "workdir": "/w", "yield_time_ms": 10000}
    assert _args_of("```json\n" + json.dumps({"name": "exec_command", "arguments": written})) \
        == [("exec_command", {"cmd": "cat calc.py", "sandbox_permissions": "use_default",
                              "workdir": "/w", "yield_time_ms": 10000})]
    # a justification of its own, an example not from the description: meant, kept
    meant = {"cmd": "git pull", "justification": "Fetch the latest commits from origin",
             "prefix_rule": ["git", "fetch"]}
    assert _args_of(json.dumps({"name": "exec_command", "arguments": meant})) == \
        [("exec_command", meant)]
    # required arguments are never touched, empty or not
    assert _args_of('{"name": "exec_command", "arguments": {"cmd": ""}}') == \
        [("exec_command", {"cmd": ""})]


def test_a_call_in_the_templates_own_form_is_left_as_written():
    text = ('<tool_call>\n{"name": "Read", "arguments": {"file_path": "/a", "pages": "", '
            '"offset": 9007199254740991}}\n</tool_call>')
    assert _args_of(text) == [("Read", {"file_path": "/a", "pages": "",
                                        "offset": 9007199254740991})]


def test_without_the_rescue_a_bare_call_in_a_hermes_template_is_content():
    fmt = ReplyFormat(tool_syntax="hermes", parse_tools=True, tool_names=("Read",))
    text = '{"name": "Read", "arguments": {"file_path": "/a"}}'
    assert parse_reply(text, fmt).content == text


# -- a finished call is never rescued again -------------------------------------------

QWEN25_TEMPLATE = None


def _qwen25(llama_src):
    global QWEN25_TEMPLATE
    if QWEN25_TEMPLATE is None:
        src = (llama_src / "models" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
        QWEN25_TEMPLATE = ChatTemplate(src)
    return QWEN25_TEMPLATE


def _after_a_read(call_id="call_1", result_id="call_1"):
    return [Message("user", READ_IT),
            Message("assistant", "", tool_calls=[
                ToolCall("Read", '{"file_path": "/tmp/notes.txt"}', call_id)]),
            Message("tool", "buy milk", tool_call_id=result_id)]


def _read_back(llama_src, messages, text, size=None):
    """The reply to ``messages`` read as the worker reads it: whole, or streamed in pieces."""
    fmt = prepare_chat(None, _qwen25(llama_src), messages, TOOLS, "auto",
                       check=False).reply_format
    if size is None:
        return parse_reply(text, fmt)
    s = ReplyStream(fmt)
    deltas = []
    for i in range(0, len(text), size):
        deltas += s.add(text[i:i + size])
    deltas += s.finish()[0]
    return deltas


SAME_READ = '{"name": "Read", "arguments": {"file_path": "/tmp/notes.txt"}}'


@pytest.mark.parametrize("text", [
    SAME_READ,
    '```json\n{"name": "Read", "arguments": {"file_path":"/tmp/notes.txt"}}',
    # the same call once what it copied out of the schema is dropped
    '{"name": "Read", "arguments": {"file_path": "/tmp/notes.txt", "pages": ""}}',
])
def test_a_rescued_call_identical_to_a_finished_one_stays_text(llama_src, text):
    r = _read_back(llama_src, _after_a_read(), text)
    assert r.tool_calls == [] and r.content == text.strip()


@pytest.mark.parametrize("size", [1, 3, 7])
def test_a_streamed_repeat_is_sent_as_text_once_whole(llama_src, size):
    deltas = _read_back(llama_src, _after_a_read(), SAME_READ, size)
    assert not [d for d in deltas if d.tool_call]
    assert "".join(d.content for d in deltas if d.content) == SAME_READ


def test_a_different_call_after_a_result_is_still_rescued(llama_src):
    text = '{"name": "Read", "arguments": {"file_path": "/tmp/other.txt"}}'
    r = _read_back(llama_src, _after_a_read(), text)
    assert [(c.name, json.loads(c.arguments)) for c in r.tool_calls] == \
        [("Read", {"file_path": "/tmp/other.txt"})]


def test_a_call_whose_result_is_not_there_yet_is_rescued(llama_src):
    """An assistant call with no tool result after it is not finished (a retry
    after an edit of the conversation, say)."""
    r = _read_back(llama_src, _after_a_read()[:2] + [Message("user", "Go on.")], SAME_READ)
    assert [c.name for c in r.tool_calls] == ["Read"]


def test_results_match_their_calls_by_id_or_by_position():
    calls = [ToolCall("Read", '{"file_path": "/a"}', "c1"), ToolCall("Bash", '{"command": "ls"}', "c2")]
    ask = Message("assistant", "", tool_calls=calls)
    by_id = finished_calls([ask, Message("tool", "x", tool_call_id="c2")])
    assert by_id == (call_key("Bash", '{"command":"ls"}'),)
    by_position = finished_calls([ask, Message("tool", "x")])
    assert by_position == (call_key("Read", '{ "file_path" : "/a" }'),)
    assert finished_calls([ask]) == ()
    # a result after the next assistant turn answers nothing of this one
    assert finished_calls([ask, Message("assistant", "ok"), Message("tool", "x")]) == ()


def test_a_call_in_the_templates_own_form_is_read_even_when_repeated(llama_src):
    """Only the rescue holds back: a model that writes its template's own call
    means it (calls may be meant twice: a poll, a retry)."""
    text = '<tool_call>\n' + SAME_READ + '\n</tool_call>'
    assert [c.name for c in _read_back(llama_src, _after_a_read(), text).tool_calls] == ["Read"]


def test_a_held_call_keeps_its_optional_arguments_and_drops_copied_ones(qwen):
    """The grammar holds a call to its tool's whole schema; reading it drops only the
    values copied out of the schema (a sentinel maximum, an empty string)."""
    plan = _qwen_plan(qwen, [Message("user", READ_IT)])
    for forced, kept in [(', "offset": 12', {"offset": 12}),
                         (', "offset": 9007199254740991, "pages": ""', {})]:
        text, ended = generate(qwen, plan, forced='{"name": "Read", "arguments": {"file_path": '
                                                  '"/tmp/notes.txt"' + forced + "}")
        assert ended, text
        calls = parse_reply(text, plan.reply_format).tool_calls
        args = json.loads(calls[0].arguments)
        assert args["file_path"] == "/tmp/notes.txt" and \
            {k: v for k, v in args.items() if k in ("offset", "pages")} == kept, text


def test_the_rescue_grammar_passes_the_checks(qwen):
    check_grammar(qwen, bare_call_grammar(TOOLS))
    assert rescue_of(TOOLS, "auto") is not None
    assert rescue_of(TOOLS, "required") is None and rescue_of(TOOLS, "auto", False) is None
    assert rescue_of([], "auto") is None


# -- generation: the watch and the hold, on the model ------------------------------------

def _qwen_plan(model, messages, tools=TOOLS, rescue=True):
    template = ChatTemplate(model.chat_template, "", "<|im_end|>")
    return prepare_chat(model, template, messages, tools, "auto", rescue=rescue)


_CELLS = {}


def _prompt_cells(model, tokens):
    """Sequence 0's state after ``tokens`` (evaluated once, then kept)."""
    key = tuple(tokens)
    if key not in _CELLS:
        ctx = libllama.ContextHandle(model.lib, model.handle, len(tokens) + 16, 512, 512,
                                     TEST_THREADS, TEST_THREADS)
        try:
            for i in range(0, len(tokens), 512):
                assert ctx.decode_parts([(tokens[i:i + 512], i, (0,), ctx.OUT_NONE)]) == 0
            _CELLS[key] = ctx.seq_state(0)
            assert _CELLS[key] is not None
        finally:
            ctx.close()
    return _CELLS[key]


def generate(model, plan, forced="", n=80, rescue=True):
    """Greedy reply to ``plan``'s prompt through the server's sampler (build_sampler),
    its lazy <tool_call> grammar and, with ``rescue``, the rescue's watch.  ``forced``
    is written first, as if the model had picked it (offered to the sampler)."""
    params = SamplingParams(temperature=0.0, grammar=plan.grammar,
                            grammar_triggers=plan.grammar_triggers)
    if rescue and plan.rescue:
        params.rescue_grammar, params.rescue_opener = plan.rescue["grammar"], \
            plan.rescue["opener"]
        params.rescue_names = tuple(plan.rescue["names"])
        params.rescue_watch_chars = plan.rescue["watch_chars"]
    prompt = model.tokenize(plan.text, add_special=True, parse_special=True)
    n_ctx = len(prompt) + n + 64
    ctx = libllama.ContextHandle(model.lib, model.handle, n_ctx, 512, 512, TEST_THREADS,
                                 TEST_THREADS)
    sampler = build_sampler(model.lib, params, model.n_vocab, n_ctx, vocab=model.handle.vocab,
                            piece_of=model.token_bytes)
    try:
        # all but the prompt's last token from its cells, evaluated once a
        # prompt (several tests reply to the same one, held and free): the
        # last token then decodes alone, every time alike
        assert ctx.set_seq_state(0, _prompt_cells(model, prompt[:-1]))
        assert ctx.decode_parts([(prompt[-1:], len(prompt) - 1, (0,), ctx.OUT_LAST)]) == 0
        pos = len(prompt)
        out, ended = [], False
        for t in model.tokenize(forced, add_special=False) if forced else []:
            sampler.accept(t)
            sampler.observe(t)
            out.append(t)
            assert ctx.decode_parts([([t], pos, (0,), ctx.OUT_LAST)]) == 0
            pos += 1
        for _ in range(n):
            t = sampler.sample(ctx)
            if t is None or model.is_eog(t):
                ended = True
                break
            out.append(t)
            assert ctx.decode_parts([([t], pos, (0,), ctx.OUT_LAST)]) == 0
            pos += 1
        return b"".join(model.token_bytes(t) for t in out).decode("utf-8", "replace"), ended
    finally:
        sampler.close()
        ctx.close()


def test_a_reply_that_opens_a_call_is_held_to_it_and_ends_there(qwen):
    plan = _qwen_plan(qwen, [Message("user", READ_IT)])
    text, ended = generate(qwen, plan)
    assert ended, "the reply went on past the call: %r" % text
    r = parse_reply(text, plan.reply_format)
    assert [c.name for c in r.tool_calls] == ["Read"], text
    assert json.loads(r.tool_calls[0].arguments)["file_path"] == "/tmp/notes.txt"


def test_without_the_rescue_the_model_goes_on_past_its_bare_call(qwen):
    """What the rescue is for: the same greedy reply, unheld, is not one call."""
    plan = _qwen_plan(qwen, [Message("user", READ_IT)], rescue=False)
    text, _ = generate(qwen, plan, rescue=False)
    assert text.lstrip().startswith(("{", "```"))
    assert parse_reply(text, plan.reply_format).tool_calls == []


def test_a_fenced_opener_is_held_from_its_object(qwen):
    plan = _qwen_plan(qwen, [Message("user", READ_IT)])
    text, ended = generate(qwen, plan, forced='```json\n{"name": "Bash", "arguments": {')
    assert ended and text.startswith('```json\n{"name": "Bash"')
    calls = parse_reply(text, plan.reply_format).tool_calls
    assert [c.name for c in calls] == ["Bash"] and "command" in json.loads(calls[0].arguments)


def test_the_models_repeat_of_a_finished_call_comes_back_as_text(qwen):
    """What loops agents: after Read's result Qwen2.5-Coder-0.5B writes the same
    Read again (greedy, seen as is); held and read, it is the model's text."""
    plan = _qwen_plan(qwen, _after_a_read())
    text, ended = generate(qwen, plan, n=60)
    assert ended and json.loads(text.strip().strip("`").replace("json\n", "", 1)) == \
        {"name": "Read", "arguments": {"file_path": "/tmp/notes.txt"}}, text
    r = parse_reply(text, plan.reply_format)
    assert r.tool_calls == [] and r.content == text.strip()


def test_a_plain_answer_is_untouched(qwen):
    plan = _qwen_plan(qwen, [Message("user", "Write a haiku about the sea.")])
    held, _ = generate(qwen, plan, n=40)
    free, _ = generate(qwen, plan, n=40, rescue=False)
    assert held == free and not held.lstrip().startswith("{")


def test_an_object_naming_no_tool_is_left_free(qwen):
    """{"name": "Alice", ... is an answer, not a call: the watch ends, nothing is held."""
    plan = _qwen_plan(qwen, [Message("user", "Describe a person as JSON.")])
    forced = '{"name": "Alice", "age": '
    held, _ = generate(qwen, plan, forced=forced, n=30)
    free, _ = generate(qwen, plan, forced=forced, n=30, rescue=False)
    assert held == free


# -- through the server: every dialect gets the call ------------------------------------

@pytest.fixture(scope="module")
def srv():
    with ServerProcess(QWEN, ctx=4096) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0)


OPENAI_TOOLS = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.parameters}} for t in TOOLS]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_get_the_call(client, stream):
    r = client.chat.completions.create(model="q", temperature=0, max_tokens=80,
                                       messages=[{"role": "user", "content": READ_IT}],
                                       tools=OPENAI_TOOLS, stream=stream)
    if stream:
        chunks = list(r)
        calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
        finish = chunks[-1].choices[0].finish_reason
    else:
        calls, finish = r.choices[0].message.tool_calls, r.choices[0].finish_reason
    assert finish == "tool_calls" and [c.function.name for c in calls] == ["Read"]
    assert json.loads(calls[0].function.arguments)["file_path"] == "/tmp/notes.txt"


def test_the_anthropic_dialect_gets_a_tool_use_block(srv):
    status, _, body = srv.post("/v1/messages", {
        "model": "q", "max_tokens": 80, "temperature": 0,
        "messages": [{"role": "user", "content": READ_IT}],
        "tools": [{"name": t.name, "description": t.description, "input_schema": t.parameters}
                  for t in TOOLS]})
    assert status == 200 and body["stop_reason"] == "tool_use", body
    assert [b["name"] for b in body["content"] if b["type"] == "tool_use"] == ["Read"]


def test_the_responses_dialect_gets_a_function_call_item(srv):
    status, _, body = srv.post("/v1/responses", {
        "model": "q", "max_output_tokens": 80, "temperature": 0, "input": READ_IT,
        "tools": [{"type": "function", "name": t.name, "description": t.description,
                   "parameters": t.parameters} for t in TOOLS]})
    assert status == 200
    assert [o["name"] for o in body["output"] if o["type"] == "function_call"] == ["Read"]


def test_the_flag_turns_the_rescue_off():
    with ServerProcess(QWEN, "--no-tool-call-rescue", ctx=4096) as s:
        status, _, body = s.post("/v1/chat/completions", {
            "temperature": 0, "max_tokens": 80, "tools": OPENAI_TOOLS,
            "messages": [{"role": "user", "content": READ_IT}]})
    assert status == 200
    m = body["choices"][0]["message"]
    assert not m.get("tool_calls") and '"Read"' in m["content"]
