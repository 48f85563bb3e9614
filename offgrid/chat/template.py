"""Chat messages to a prompt with the model's own template, as llama-server builds it.

    tmpl = ChatTemplate(model.chat_template, bos_token="<bos>", eos_token="<eos>", add_bos=True)
    prompt = tmpl.apply(messages, tools, add_generation_prompt=True)
    prompt.text               what to tokenize (parse_special=True, add_special=True)
    prompt.reply_format       how to read the reply (chat.reply)

The template is Jinja, rendered by chat.jinja with the variables
llama-server passes: ``messages``, ``tools`` (only when there are some),
``add_generation_prompt`` (only when true), ``bos_token``, ``eos_token``,
``enable_thinking``, ``datetime`` and ``date_string`` (today, as "%b %d %Y" and
"%d %b %Y") plus any ``chat_template_kwargs``; ``strftime_now()`` is a global
function.  Before rendering, the messages get llama-server's adjustments,
decided by probing the template once at load (``detect_caps``): a system
message is merged into the first user message for templates that ignore
system messages, tool-call arguments become objects for templates that read
them as objects, text parts become one string (or the reverse); and a few
template families get their own adjustments (see ``_adjust_for_family``).

Tool calls and reasoning in the reply are read by chat.reply; this
module decides the format from the template (``ReplyFormat``) and builds the
grammar that forces a tool call when ``tool_choice`` requires one.
"""

import dataclasses
import json
import random
import re
import string
import time
from dataclasses import dataclass, field
from typing import List, Optional

from . import jinja
from .. import jsonlimit
from ..errors import InvalidRequest
from ..request import Message, Tool, ToolCall  # noqa: F401  (the typed chat request)
from .jsonschema import Grammar, json_literal, literal
from .derive import derive_shape
from .shapes import shape_of, stray_markers_of


class ChatTemplateError(InvalidRequest):
    """The template could not render these messages (it refused them, or failed)."""


class TemplateBudgetError(ChatTemplateError):
    """The template ran past its budget of steps, size or time (jinja.Budget): at load
    the model cannot be used; for a request, its messages are too much for it."""


# What probing a template at load may spend, all probes together: a real
# template needs a few thousand steps a probe (the largest of llama.cpp's
# seventy about 9,000 for a short conversation), a template that loops for good
# fails the load within seconds instead of spinning a core.
LOAD_STEPS = 2_000_000
LOAD_SECONDS = 10.0


def load_budget():
    return jinja.Budget(max_steps=LOAD_STEPS, seconds=LOAD_SECONDS)


# ---------------------------------------------------------------------------
# Messages and tools, typed
# ---------------------------------------------------------------------------

def new_tool_call_id(length=32):
    """A random id for a tool call (llama-server's form; Mistral templates want 9 characters)."""
    alphabet = string.ascii_letters + string.digits
    return "".join(random.choice(alphabet) for _ in range(length))


# ---------------------------------------------------------------------------
# What the template can do: llama-server's capability probes
# ---------------------------------------------------------------------------

@dataclass
class Caps:
    """What a template does with its inputs, learnt by rendering sample messages."""
    supports_tools: bool = True
    supports_tool_calls: bool = True
    supports_system_role: bool = True
    supports_parallel_tool_calls: bool = True
    supports_preserve_reasoning: bool = False
    supports_reasoning_effort: bool = False
    supports_string_content: bool = True
    supports_typed_content: bool = False
    supports_object_arguments: bool = False

    def as_dict(self):
        return dict(self.__dict__)


def _tracked(v):
    """A fresh copy of plain JSON data whose strings can be told apart by Stats."""
    if isinstance(v, str):
        return jinja.TrackedStr(v)
    if isinstance(v, list):
        return [_tracked(x) for x in v]
    if isinstance(v, dict):
        return {k: _tracked(x) for k, x in v.items()}
    return v


def _probe(template, budget, messages, tools=None, extra=None):
    """Render sample inputs with usage statistics: (ok, variables, output, stats)."""
    variables = {"messages": _tracked(messages), "tools": _tracked(tools or []),
                 "bos_token": jinja.TrackedStr(""), "eos_token": jinja.TrackedStr(""),
                 "add_generation_prompt": True}
    variables.update(extra or {})
    stats = jinja.Stats()
    try:
        out = template.render(variables, stats=stats, budget=budget)
        return True, variables, out, stats
    except jinja.BudgetExceeded as e:       # no answer at all: the template is unusable
        raise TemplateBudgetError("the chat template ran past its budget while it was "
                                  "probed: %s" % e)
    except MemoryError:     # past the worker's memory ceiling (engine/lifeline.py)
        raise TemplateBudgetError("the chat template ran out of memory while it was probed")
    except Exception:       # a probe that fails is an answer, not an error
        return False, variables, "", stats


_PROBE_TOOLS = [{"name": "tool", "type": "function", "function": {
    "name": "tool1", "description": "Tool description",
    "parameters": {"type": "object",
                   "properties": {"arg": {"type": "string", "description": "Arg description"}},
                   "required": ["arg"]}}}]


def _probe_tool_messages(args, n_calls=1):
    calls = [{"id": "call0000%d" % (i + 1), "type": "function",
              "function": {"name": "tool1", "arguments": args}} for i in range(n_calls)]
    return [{"role": "user", "content": "User message"},
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
            {"role": "assistant", "content": "The tool response was 'tool response'"},
            {"role": "user", "content": "User message"}]


def detect_caps(template, budget=None):
    """llama-server's caps_get(): which inputs the template reads, and how.

    ``budget`` (a jinja.Budget) is what all the probes may spend together;
    past it TemplateBudgetError."""
    budget = budget or load_budget()
    caps = Caps()
    marker = "STRING_MARKER"

    ok, v, out, st = _probe(template, budget, [{"role": "user", "content": marker}])
    content = v["messages"][0]["content"]
    checks_for_string = st.has_op(content, "test_is_string")
    as_array = st.has_op(content, "selectattr") or st.has_op(content, "array_access")
    if as_array:
        caps.supports_typed_content = True
    if not ok or (as_array and marker not in out):
        caps.supports_string_content = False
    if checks_for_string:
        ok, v, out, st = _probe(template, budget, [{"role": "user", "content": []}])
        content = v["messages"][0]["content"]
        if ok and (st.has_op(content, "selectattr") or st.has_op(content, "array_access")):
            caps.supports_typed_content = True

    ok, v, out, st = _probe(template, budget, [{"role": "system", "content": "System message"},
                                       {"role": "user", "content": "User message"}])
    if not st.was_used(v["messages"][0]["content"]):
        caps.supports_system_role = False

    ok, v, out, st = _probe(template, budget, _probe_tool_messages({"arg": "value"}), _PROBE_TOOLS)
    if ok:
        if not st.was_used(v["tools"][0]["function"]["name"]):
            caps.supports_tools = False
        calls = v["messages"][1]["tool_calls"]
        if not st.was_used(calls):
            caps.supports_tool_calls = False
        elif st.was_used(calls[0]["function"]["arguments"]["arg"]):
            caps.supports_object_arguments = True
    if not caps.supports_object_arguments:
        ok, v, out, st = _probe(template, budget, _probe_tool_messages('{"arg": "value"}'), _PROBE_TOOLS)
        if not ok:
            caps.supports_tool_calls = caps.supports_tools = False
        else:
            if not st.was_used(v["tools"][0]["function"]["name"]):
                caps.supports_tools = False
            if not st.was_used(v["messages"][1]["tool_calls"]):
                caps.supports_tool_calls = False

    args = {"arg": "value"} if caps.supports_object_arguments else '{"arg": "value"}'
    ok, v, out, st = _probe(template, budget, _probe_tool_messages(args, 2), _PROBE_TOOLS)
    if not ok or not st.was_used(v["messages"][1]["tool_calls"][1]["function"]):
        caps.supports_parallel_tool_calls = False

    placeholder = "<REASONING_CONTENT_PLACEHOLDER>"
    msgs = [{"role": "user", "content": "User message"},
            {"role": "assistant", "content": "Assistant message", "reasoning_content": placeholder},
            {"role": "user", "content": "User message"},
            {"role": "assistant", "content": "Assistant message",
             "reasoning_content": "Reasoning content"},
            {"role": "user", "content": "User message"}]
    ok, v, out, st = _probe(template, budget, msgs, extra=dict(_preserve_reasoning_vars(True),
                                                        enable_thinking=True))
    if placeholder in out:
        caps.supports_preserve_reasoning = True

    effort = jinja.TrackedStr("low")
    ok, v, out, st = _probe(template, budget, [{"role": "user", "content": "User message"}],
                            extra={"enable_thinking": True, "reasoning_effort": effort,
                                   "reasoning_strength": effort})
    caps.supports_reasoning_effort = st.was_used(effort)
    return caps


def _renders_later_system(template, budget):
    """Whether the template writes a system message that is not the first one
    where it stands (Qwen, Llama 3, ChatML do; Gemma's refuses it, some drop it)."""
    marker = "LATER_SYSTEM_MARKER"
    ok, _, out, _ = _probe(template, budget, [{"role": "system", "content": "System message"},
                                      {"role": "user", "content": "User message"},
                                      {"role": "assistant", "content": "Assistant message"},
                                      {"role": "system", "content": marker},
                                      {"role": "user", "content": "User message"}])
    return ok and marker in out


def _system_before_last_turn(msgs):
    """System messages that end the conversation after a user's message, moved
    to just before it.

    Claude Code sends its environment notes as a system turn after the user's
    request; rendered last, right before the reply, a small model answers the
    note (Qwen2.5-Coder-0.5B recites it) instead of the request.  Before the
    request they are the same context and the request is what is answered.
    """
    k = len(msgs)
    while k > 0 and msgs[k - 1]["role"] == "system":
        k -= 1
    if k == len(msgs) or k == 0 or msgs[k - 1]["role"] != "user":
        return msgs
    return msgs[:k - 1] + msgs[k:] + [msgs[k - 1]]


def _leading_system(msgs):
    """The system messages after the first message joined onto the leading one
    (made if there is none), for templates that cannot place them."""
    later = [i for i, m in enumerate(msgs) if m["role"] == "system" and i > 0]
    if not later:
        return msgs
    msgs = list(msgs)
    if msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": ""})
        later = [i + 1 for i in later]
    lead = dict(msgs[0])
    texts = [_as_text(lead["content"])] + [_as_text(msgs[i]["content"]) for i in later]
    text = "\n\n".join(t for t in texts if t)
    lead["content"] = [{"type": "text", "text": text}] if isinstance(lead["content"], list) \
        else text
    drop = set(later)
    return [lead] + [m for i, m in enumerate(msgs) if i and i not in drop]


def _preserve_reasoning_vars(enabled):
    return {"preserve_thinking": enabled, "clear_thinking": not enabled,
            "truncate_history_thinking": not enabled, "drop_thinking": not enabled}


# ---------------------------------------------------------------------------
# Template families: the ones whose messages or prompt llama-server adjusts
# ---------------------------------------------------------------------------

def template_family(src):
    """llama-server's specialised-template detection, in its order (first match wins)."""
    has = src.__contains__
    if has("[SYSTEM_PROMPT]") and has("[TOOL_CALLS]") and has("[ARGS]") and not has("[CALL_ID]"):
        return "ministral3"
    if has("<|channel|>"):
        return "gpt-oss"
    if has("<atem:function_calls>") and has("<|eom|>"):
        return "muse-glimmer"
    if has(">>>all") and has(">>>${recipient}"):
        return "functionary-v3.2"
    if has("<|tool_calls_section_begin|>") and has("<|tool_call_begin|>"):
        return "kimi-k2"
    if has("<|open|>") and has("<|close|>") and has("<|end_of_msg|>"):
        return "kimi-k3"
    if has("<role>ASSISTANT</role>") and has("<arg_key>"):
        return "ling3"
    if has("<|START_TEXT|>") and has("<|START_ACTION|>"):
        return "cohere2moe"
    if has("<|tool_list_start|>") and has("<|tool_list_end|>"):
        return "lfm2"
    if has("List of tools: [") and not has("<|tool_list_start|>"):
        return "lfm2.5"
    if has("<|role_sep|>") and has("<|message_sep|>") and not has("<|function_call|>"):
        return "gigachat3"
    if has("]<]minimax[>[") and has("<tool_call>") and has("<invoke name="):
        return "minimax-m3"
    if has("dsml_token") and has("DSML") and (has("function_calls") or has("tool_calls")):
        return "deepseek-v3.2"
    if has("'<|tool_call>call:'"):
        return "gemma4"
    if has("Tool usage guidelines:") and has('<function name="') and has('<param name="'):
        return "minicpm5"
    if has("<tool_call>") and has("<function=") and has("<parameter=") \
            and not has("'<tool_call><function=' ~ tool_call.name ~ '>'"):
        return "qwen3-coder"
    return None


def _adjust_for_family(family, src, messages):
    """Message changes llama-server makes for some families before rendering."""
    if family == "ministral3":
        out = []
        for m in messages:
            if m.get("role") not in ("system", "assistant"):
                out.append(m)
                continue
            blocks = []
            if isinstance(m.get("reasoning_content"), str):
                blocks.append({"type": "thinking", "thinking": m["reasoning_content"]})
            c = m.get("content")
            if isinstance(c, str):
                blocks.append({"type": "text", "text": c})
            elif isinstance(c, list):
                blocks += c
            m = dict(m, content=blocks)
            m.pop("reasoning_content", None)
            out.append(m)
        return out
    if family in ("gpt-oss", "lfm2", "lfm2.5"):
        out = []
        for m in messages:
            if isinstance(m.get("reasoning_content"), str):
                m = dict(m, thinking=m["reasoning_content"])
                if family == "gpt-oss" and m.get("tool_calls"):
                    m.pop("content", None)
            out.append(m)
        return out
    if family == "deepseek-v3.2" and "function_calls" not in src:
        return _deepseek_v4_sort_tool_results(messages)
    if family == "gemma4" and "{#- OpenAI Chat Completions:" not in src:
        return _gemma4_tool_responses(messages)
    return messages


def _deepseek_v4_sort_tool_results(messages):
    """Runs of tool results in the order of the calls that asked for them."""
    out = list(messages)
    order = {}
    i = 0
    while i < len(out):
        m = out[i]
        role = m.get("role", "")
        if role == "assistant" and m.get("tool_calls"):
            order = {tc.get("id", ""): k for k, tc in enumerate(m["tool_calls"]) if tc.get("id")}
            i += 1
            continue
        if role not in ("user", "tool"):
            i += 1
            continue
        end = i
        positions = []
        while end < len(out) and out[end].get("role", "") in ("user", "tool"):
            if out[end].get("role") == "tool":
                positions.append(end)
            end += 1
        if len(positions) > 1 and order:
            results = sorted((out[p] for p in positions),
                             key=lambda r: order.get(r.get("tool_call_id", ""), 0))
            for p, r in zip(positions, results):
                out[p] = r
        i = end
    return out


def _gemma4_tool_responses(messages):
    """assistant(tool calls) + tool results (+ final answer) as one assistant message."""
    out, i = [], 0
    while i < len(messages):
        m = messages[i]
        if m.get("role") != "assistant" or not m.get("tool_calls"):
            out.append(m)
            i += 1
            continue
        calls, responses = list(m["tool_calls"]), []
        reasoning = m.get("reasoning_content") if isinstance(m.get("reasoning_content"), str) \
            else None
        content = None
        i += 1
        while i < len(messages) and messages[i].get("role") == "tool":
            r = messages[i]
            resp = r.get("content")
            if isinstance(resp, str):
                try:
                    resp = jsonlimit.loads(resp)
                except ValueError:
                    pass
            name = ""
            if len(responses) < len(calls):
                name = calls[len(responses)].get("function", {}).get("name", "")
            responses.append({"name": name or r.get("tool_call_id", ""), "response": resp})
            i += 1
        if i < len(messages) and messages[i].get("role") == "assistant":
            nxt = messages[i]
            c = nxt.get("content")
            if not nxt.get("tool_calls") and c:
                content = c
                i += 1
        built = {"role": "assistant", "tool_calls": calls}
        if responses:
            built["tool_responses"] = responses
        if content is not None:
            built["content"] = content
        if reasoning is not None:
            built["reasoning_content"] = reasoning
        out.append(built)
    return out


# ---------------------------------------------------------------------------
# How replies look: reasoning markers and tool-call syntax
# ---------------------------------------------------------------------------

# (start, end) of a reasoning block, as the families write them
REASONING_MARKERS = [
    ("<think>", "</think>"),
    ("<seed:think>", "</seed:think>"),
    ("[THINK]", "[/THINK]"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),
    ("<|channel>thought", "<channel|>"),
    ("◁think▷", "◁/think▷"),
    ("<mm:think>", "</mm:think>"),
    ("<|open|>think<|sep|>", "<|close|>think<|sep|>"),
]


@dataclass
class ReplyFormat:
    """How to read a reply: where reasoning is, and which tool-call syntax to expect."""
    reasoning_markers: List[tuple] = field(default_factory=lambda: [REASONING_MARKERS[0]])
    starts_in_reasoning: bool = False   # the prompt ends inside an open reasoning block
    reasoning_end: str = "</think>"     # its end marker, when it does
    tool_syntax: str = "generic"        # hermes, llama3, mistral, harmony or generic
    parse_tools: bool = False           # tools were given and tool_choice is not "none"
    extract_reasoning: bool = True      # reasoning_format other than "none"
    keep_reasoning_inline: bool = False  # reasoning_format "deepseek-legacy"
    # the tools' names: a bare JSON call must name one (empty: any name, for
    # formats made by hand); they also bound how long a reply is held back
    tool_names: tuple = ()
    # a reply that is one bare JSON call ({"name", "arguments"}, maybe in a
    # ```json fence) is a call whatever the template's syntax: the tool-call
    # rescue (chat/rescue.py) held it to that form
    bare_calls: bool = False
    # with bare_calls: per tool [name, required keys, property keys], to read a
    # call whose "name" is no tool's by its arguments (chat/rescue.py)
    tool_args: tuple = ()
    # with bare_calls: rescue.call_key of each call the conversation already
    # has a result for; a rescued call identical to one stays text (rescue.py)
    finished_calls: tuple = ()
    # the family's call shape (a name in shapes.SHAPES, or a derived Shape's
    # fields), read instead of tool_syntax's reader
    call_shape: object = ""
    # each tool's parameters' schema by its name: tagged argument values are typed by it
    tool_schemas: dict = field(default_factory=dict)
    # the reasoning block the prompt opened, as written ("<think>\n"): given back
    # in the content with reasoning_format none
    reopened: str = ""
    # the family's markup around its answers, dropped from the content
    stray_markers: tuple = ()
    # a response format's JSON: a ```json fence around it is dropped
    json_fence: bool = False


# What opens a call (ECMAScript regexes), for the syntaxes whose call grammar
# starts with it: a lazy grammar is fed the output from its trigger's match on
# (from its first capture group, if any, hence gpt-oss's (?:...)).  Llama 3's
# calls are left free: its JSON form has no marker, and <|python_tag|> is for
# its built-in tools.
CALL_TRIGGERS = {
    "hermes": re.escape("<tool_call>"),
    "mistral": re.escape("[TOOL_CALLS]"),
    "harmony": r"<\|channel\|>(?:commentary|analysis) to=functions\.",
}


def tool_syntax_of(src):
    """The tool-call syntax a template teaches its model."""
    if "<|channel|>" in src:
        return "harmony"            # gpt-oss: its replies are channels, calls included
    if "<tool_call>" in src:
        return "hermes"
    if "[TOOL_CALLS]" in src:
        return "mistral"
    if "<|python_tag|>" in src or "<|start_header_id|>" in src:
        return "llama3"
    return "generic"


def call_form_of(src, syntax):
    """The grammar's form of a call: the syntax, or for Mistral which of its
    three: a JSON list (Nemo), name[ARGS]{...} (Devstral, Ministral 3), or
    name[CALL_ID]id[ARGS]{...} (Small 3.2)."""
    if syntax == "mistral" and "[ARGS]" in src:
        return "mistral-callid" if "[CALL_ID]" in src else "mistral-args"
    return syntax


def reasoning_markers_of(src):
    # Kimi K3 builds its markers from parts ('<|open|>' ~ 'think' ~ '<|sep|>')
    k3 = "<|open|>" in src and "<|close|>" in src and "'think'" in src
    found = [m for m in REASONING_MARKERS if m[0] in src or m[1] in src
             or (k3 and m[0] == "<|open|>think<|sep|>")]
    if REASONING_MARKERS[0] not in found:
        found.append(REASONING_MARKERS[0])
    return found


# ---------------------------------------------------------------------------
# The template
# ---------------------------------------------------------------------------

CHATML = ("{%- for message in messages -%}\n"
          "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n"
          "{%- endfor -%}\n"
          "{%- if add_generation_prompt -%}\n"
          "  {{- '<|im_start|>assistant\\n' -}}\n"
          "{%- endif -%}")


@dataclass
class ChatPrompt:
    """A rendered prompt and what is needed to read the reply to it."""
    text: str
    generation_prompt: str
    reply_format: ReplyFormat
    grammar: Optional[str] = None       # GBNF forcing a tool call (tool_choice required/named)
    # with tool_choice "auto": regexes that start ``grammar`` once the model opens a call
    grammar_triggers: tuple = ()


def _patch_source(src):
    """The two textual patches llama-server applies to known-broken templates."""
    if "<|channel|>" in src and "in message.content or" in src:
        src = src.replace('{%- if "<|channel|>analysis<|message|>" in message.content or '
                          '"<|channel|>final<|message|>" in message.content %}', "{%- if false %}")
    if "[TOOL_CALLS]" in src and "if (message['content'] is none or" in src:
        src = src.replace("{%- if (message['content'] is none or message['content'] == '' or "
                          "message['content']|length == 0) and (message['tool_calls'] is not "
                          "defined or message['tool_calls'] is none or "
                          "message['tool_calls']|length == 0) %}", "{%- if false %}")
    return src


class ChatTemplate:
    """A model's chat template, parsed and probed once; apply() may run on any thread."""

    def __init__(self, source, bos_token="", eos_token="", add_bos=False, add_eos=False):
        if not source or source == "chatml":
            source = CHATML
        try:
            self.template = jinja.Template(_patch_source(source))
        except jinja.TemplateError as e:
            raise ChatTemplateError("the chat template cannot be parsed: %s" % e)
        self.source = self.template.source
        self.bos_token, self.eos_token = bos_token, eos_token
        self.add_bos, self.add_eos = add_bos, add_eos
        budget = load_budget()
        self.caps = detect_caps(self.template, budget)
        self.renders_later_system = _renders_later_system(self.template, budget)
        self.family = template_family(self.source)
        self.tool_syntax = tool_syntax_of(self.source)
        self.call_form = call_form_of(self.source, self.tool_syntax)
        self.reasoning_markers = reasoning_markers_of(self.source)
        self.supports_thinking, self.reasoning_start, self.reasoning_end = \
            self._analyze_reasoning(budget)
        # the family's declared shape; a template in no entry whose calls no
        # other reader knows gets the shape its own renderings show (derive.py)
        self.call_shape = shape_of(self.source, self.family)
        if not self.call_shape and self.tool_syntax == "generic":
            derived = derive_shape(self.probe_renderer(budget))
            self.call_shape = dataclasses.asdict(derived) if derived else ""

    # -- rendering -------------------------------------------------------------
    def render(self, messages, tools=(), add_generation_prompt=True, enable_thinking=None,
               kwargs=None, now=None, json_schema=None):
        """The prompt text for these messages (what llama-server's /apply-template returns)."""
        return self._render(messages, tools, add_generation_prompt, enable_thinking, kwargs,
                            now, json_schema)

    def apply(self, messages, tools=(), add_generation_prompt=True, enable_thinking=None,
              kwargs=None, now=None, json_schema=None, tool_choice="auto",
              parallel_tool_calls=None, reasoning_format="auto", continue_final=None):
        """A ChatPrompt: the prompt, and how to read (and maybe constrain) the reply.

        ``continue_final`` (default: when the last message is the assistant's)
        continues that message instead of starting a new one, as llama-server's
        assistant prefill does.
        """
        if continue_final is None:
            continue_final = bool(messages) and messages[-1].role == "assistant"
        head, prefill = (messages[:-1], messages[-1]) if continue_final else (messages, None)
        agp = add_generation_prompt and not continue_final
        text = self._render(head, tools, agp, enable_thinking, kwargs, now, json_schema)
        with_gp = text if agp else self._render(head, tools, True, enable_thinking, kwargs,
                                                now, json_schema)
        without_gp = self._render(head, tools, False, enable_thinking, kwargs, now,
                                  json_schema) if agp else text
        i = 0
        n = min(len(with_gp), len(without_gp))
        while i < n and with_gp[i] == without_gp[i]:
            i += 1
        generation_prompt = with_gp[i:]
        if prefill is not None:
            generation_prompt = self._continued(generation_prompt, prefill)
            text = without_gp + generation_prompt
        fmt = self.reply_format(generation_prompt, tools, tool_choice, reasoning_format)
        if prefill is not None and (prefill.content or prefill.parts):
            # the reply goes on with the message's text, past any reasoning the
            # turn opened (DeepSeek's <think> in the header)
            fmt.starts_in_reasoning, fmt.reopened = False, ""
        grammar, triggers = None, ()
        if tools and tool_choice not in ("auto", "none"):
            # one forced call unless asked for more: a model that does not stop
            # on its own would otherwise repeat calls up to max_tokens
            grammar = tool_call_grammar(tools, self.call_form, tool_choice,
                                        bool(parallel_tool_calls))

        elif tools and tool_choice == "auto" and self.tool_syntax in CALL_TRIGGERS:
            # llama-server's lazy grammar: any text until the model opens a
            # call, then only a well-formed call to one of ``tools``
            grammar = tool_call_grammar(tools, self.call_form, "required",
                                        bool(parallel_tool_calls))
            triggers = (CALL_TRIGGERS[self.tool_syntax],)
        return ChatPrompt(text, generation_prompt, fmt, grammar, triggers)

    def _continued(self, generation_prompt, msg):
        """The start of the assistant's turn followed by the message being continued.

        As llama-server: for a thinking template the message's reasoning goes
        between the template's markers, closed when the message has content.
        """
        # text parts joined by a blank line here, as llama-server's render_content
        # (elsewhere a newline joins them)
        content = msg.content if msg.parts is None else "\n\n".join(msg.parts)
        reasoning_only = bool(msg.reasoning_content) and not content
        start, end = self.reasoning_start, self.reasoning_end
        out = generation_prompt
        if start:
            k = out.find(start)
            out = (out[:k] if k >= 0 else out) + start + msg.reasoning_content
            if not reasoning_only:
                out += end
        return out if reasoning_only else out + content

    def reply_format(self, generation_prompt, tools=(), tool_choice="auto",
                     reasoning_format="auto"):
        fmt = ReplyFormat(reasoning_markers=list(self.reasoning_markers),
                          tool_syntax=self.tool_syntax,
                          parse_tools=bool(tools) and tool_choice != "none",
                          extract_reasoning=reasoning_format != "none",
                          keep_reasoning_inline=reasoning_format == "deepseek-legacy",
                          tool_names=tuple(t.name for t in tools),
                          call_shape=self.call_shape,
                          stray_markers=stray_markers_of(self.source, self.family),
                          tool_schemas={t.name: t.parameters for t in tools})
        for start, end in fmt.reasoning_markers:
            s = generation_prompt.rfind(start)
            if s >= 0 and s > generation_prompt.rfind(end):
                fmt.starts_in_reasoning, fmt.reasoning_end = True, end
                # given back with reasoning_format none, except where llama.cpp's
                # reader for the family does not (Kimi K3, Ling 3)
                if self.family not in ("kimi-k3", "ling3"):
                    fmt.reopened = generation_prompt[s:]
                break
        return fmt

    def _render_probe(self, budget, *args):
        return self._render(*args, budget=budget)

    def probe_renderer(self, budget=None):
        """render(messages, tools, add_generation_prompt) for the probes of
        derive.py: the prompt, or None where the template refuses them."""
        def render(messages, tools, add_generation_prompt):
            try:
                return self._render_probe(budget, messages, tools, add_generation_prompt,
                                          None, None, None, None)
            except TemplateBudgetError:
                raise
            except ChatTemplateError:
                return None
        return render

    def _render(self, messages, tools, add_generation_prompt, enable_thinking, kwargs, now,
                json_schema, budget=None):
        src = self.source
        if enable_thinking is None:
            enable_thinking = self.supports_thinking
        # llama-server's default template kwargs, which a request's may override
        kwargs = dict({"preserve_reasoning": True}, **(kwargs or {}))
        if "enable_thinking" in kwargs and isinstance(kwargs["enable_thinking"], bool):
            enable_thinking = kwargs["enable_thinking"]
        if "You have access to the following functions in JSONSchema format" in src:
            messages = [_trimmed(m) for m in messages]
        msgs = [self._message_json(m) for m in messages]
        if "<|channel|>" not in src:
            for m in msgs:
                if m["role"] == "developer":
                    m["role"] = "system"
        msgs = _system_before_last_turn(msgs)
        if not self.renders_later_system:
            msgs = _leading_system(msgs)
        if not self.caps.supports_system_role and msgs and msgs[0]["role"] == "system":
            first = msgs.pop(0)
            if msgs:
                msgs[0]["content"] = _as_text(first["content"]) + "\n" + \
                    _as_text(msgs[0]["content"])
        if self.caps.supports_object_arguments:
            for m in msgs:
                for tc in m.get("tool_calls", ()):
                    args = tc["function"]["arguments"]
                    if isinstance(args, str):
                        try:
                            tc["function"]["arguments"] = jsonlimit.loads(args)
                        except ValueError as e:
                            raise ChatTemplateError("tool call arguments are not valid JSON: %s"
                                                    % e)
        msgs = _adjust_for_family(self.family, src, msgs)

        now = time.time() if now is None else now
        local = time.localtime(now)
        variables = {"messages": msgs, "bos_token": self.bos_token, "eos_token": self.eos_token,
                     "enable_thinking": bool(enable_thinking)}
        if tools:
            variables["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description,
                "parameters": json.loads(json.dumps(t.parameters))}} for t in tools]
        variables["datetime"] = time.strftime("%b %d %Y", local)
        variables["date_string"] = time.strftime("%d %b %Y", local)
        variables.update(kwargs)
        if self.family == "deepseek-v3.2" and "function_calls" not in src \
                and isinstance(json_schema, dict):
            variables["response_format"] = json_schema
        if add_generation_prompt:
            variables["add_generation_prompt"] = True
        if isinstance(kwargs.get("preserve_reasoning"), bool):
            for k, v in _preserve_reasoning_vars(kwargs["preserve_reasoning"]).items():
                variables.setdefault(k, v)
        effort = kwargs.get("reasoning_effort")
        if isinstance(effort, str) and effort:
            variables.setdefault("reasoning_strength", effort)
        try:
            text = self.template.render(variables, now=now, budget=budget)
        except jinja.BudgetExceeded as e:
            raise TemplateBudgetError("the chat template ran past its budget: %s" % e)
        except MemoryError:
            raise TemplateBudgetError("the chat template ran out of memory")
        except jinja.TemplateRaised as e:
            raise ChatTemplateError("the chat template refused these messages: %s" % e.message)
        except jinja.TemplateError as e:
            raise ChatTemplateError("the chat template failed: %s" % e)
        if self.add_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        if self.add_eos and self.eos_token and text.endswith(self.eos_token):
            text = text[:-len(self.eos_token)]
        if self.family == "gpt-oss" and not add_generation_prompt:
            k = text.rfind("<|return|>")
            if k >= 0:
                text = text[:k] + "<|end|>" + text[k + len("<|return|>"):]
        if self.family == "gemma4" and add_generation_prompt and text.endswith("<turn|>\n"):
            text += "<|turn>model\n"
        return text

    def _message_json(self, m):
        """A message as llama-server hands it to templates (common_chat_msg to JSON)."""
        j = {"role": m.role}
        if m.content:
            j["content"] = m.content
        elif m.parts:
            j["content"] = [{"type": "text", "text": p} for p in m.parts]
        else:
            j["content"] = ""
        if m.reasoning_content:
            j["reasoning_content"] = m.reasoning_content
        if m.name:
            j["name"] = m.name
        if m.tool_call_id:
            j["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = []
            for tc in m.tool_calls:
                c = {"type": "function", "function": {"name": tc.name, "arguments": tc.arguments}}
                if tc.id:
                    c["id"] = tc.id
                calls.append(c)
            j["tool_calls"] = calls
        caps = self.caps
        only_string = caps.supports_string_content and not caps.supports_typed_content
        only_typed = caps.supports_typed_content and not caps.supports_string_content
        c = j["content"]
        if only_typed and isinstance(c, str):
            j["content"] = [{"type": "text", "text": c}]
        elif only_string and isinstance(c, list):
            j["content"] = "\n".join(p["text"] for p in c)
        return j

    def _analyze_reasoning(self, budget=None):
        """(supports_thinking, start, end): whether llama-server calls this template
        thinking-capable, and the reasoning delimiters as the template writes them.

        llama-server decides by comparing renderings; this checks the same
        signals: a family it knows reasons, the assistant's reasoning_content
        written back between markers, or enable_thinking changing the end of
        the generation prompt by markers.  ``start`` and ``end`` include the
        whitespace around the markers ("<think>\n", "\n</think>\n\n").
        """
        src = self.source
        if "content.split('</think>')" in src and "reasoning_content" not in src \
                and "<SPECIAL_12>" not in src:
            return True, "<think>", "</think>"
        if "Write your thoughts between <think></think> and write your response between" in src:
            return True, "<think>", "</think>"
        known = self.family in ("ministral3", "gpt-oss", "muse-glimmer", "kimi-k2", "kimi-k3",
                                "ling3", "cohere2moe", "lfm2", "lfm2.5", "minimax-m3",
                                "deepseek-v3.2", "gemma4", "minicpm5")
        if self.family == "gigachat3":
            return False, "", ""
        user = Message("user", "U_USER_MSG Hello END_U")
        thought = "REASON_PART I am thinking END_R"
        try:
            with_r = self._render_probe(budget, [user, Message("assistant", "A_ASST_MSG I can help END_A",
                                                 reasoning_content=thought)],
                                  (), False, True, None, None, None)
            k = with_r.find(thought)
            after = _AFTER.match(with_r, k + len(thought)) if k >= 0 else None
            if after:                   # reasoning is written back between markers
                before = _BEFORE.search(with_r[:k])
                return True, before.group(0) if before else "", after.group(0)
            on = self._render_probe(budget, [user], (), True, True, None, None, None)
            off = self._render_probe(budget, [user], (), True, False, None, None, None)
        except TemplateBudgetError:
            raise
        except ChatTemplateError:
            return known, "", ""
        toggled, start = _toggle_adds_markers(off, on)
        return known or toggled, start, ""


_SPACES = " \t\n\r\v\f"
_MARKER = re.compile(r"<[^<>]*>|\[[^\[\]]*\]")
_AFTER = re.compile(r"[ \t\n\r\v\f]*(?:<[^<>]*>|\[[^\[\]]*\])[ \t\n\r\v\f]*")
_BEFORE = re.compile(r"(?:<[^<>]*>|\[[^\[\]]*\])[ \t\n\r\v\f]*$")


def _toggle_adds_markers(off, on):
    """Whether enable_thinking changes the end of the prompt by reasoning markers,
    and the start marker when turning it on opens one.

    Either one prompt is the other plus a tail (an opened ``<think>``, or a
    closed empty block), or, when more than the end changes, one ends with
    exactly two extra markers -- llama-server's tests, on characters.
    """
    if on == off:
        return False, ""
    p = 0
    while p < min(len(on), len(off)) and on[p] == off[p]:
        p += 1
    tail_on, tail_off = on[p:].strip(_SPACES), off[p:].strip(_SPACES)
    if not tail_off and tail_on and on.endswith(tail_on):
        return True, on[p:]
    if not tail_on and tail_off and off.endswith(tail_off):
        return True, ""
    for base, ext in ((on, off), (off, on)):
        anchor = base[-64:]
        pos = ext.rfind(anchor)
        if pos < 0 or pos + len(anchor) >= len(ext):
            continue
        extra = ext[pos + len(anchor):].strip(_SPACES)
        pieces = [x for x in re.split(r"(<[^<>]*>|\[[^\[\]]*\])", extra) if x.strip(_SPACES)]
        if len(pieces) == 2 and all(_MARKER.fullmatch(x) for x in pieces):
            return True, pieces[0]
    return False, ""


def _trimmed(m):
    return Message(m.role, m.content.strip(" \t\n\r\v\f"),
                   None if m.parts is None else [p.strip(" \t\n\r\v\f") for p in m.parts],
                   m.reasoning_content.strip(" \t\n\r\v\f"), m.tool_calls, m.tool_call_id,
                   m.name)


def _as_text(content):
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content


# ---------------------------------------------------------------------------
# Grammars that force a tool call
# ---------------------------------------------------------------------------

def tool_call_grammar(tools, syntax, tool_choice="required", parallel=False):
    """GBNF for one (or, with ``parallel``, several) calls in the template's syntax
    (``call_form_of``: a syntax, or one of Mistral's forms).

    ``tool_choice`` is "required" (any of ``tools``) or a function name.
    The JSON inside follows each tool's parameter schema, so the reply always
    parses, with arguments that validate.
    """
    if tool_choice not in ("required", "auto", "none"):
        chosen = [t for t in tools if t.name == tool_choice]
        if not chosen:
            raise InvalidRequest("tool_choice names a function that is not in 'tools': %s"
                                 % tool_choice)
        tools = chosen
    g = Grammar(strict=False)       # a tool's schema never fails the request
    args_key = "parameters" if syntax == "llama3" else "arguments"
    alts = []
    for i, t in enumerate(tools):
        params = t.parameters or {"type": "object"}
        g.root_schema = params
        g._refs = {}
        args = g.schema(params, "tool-%d-args" % i)
        if syntax == "harmony":
            # a message to the function: its name in the channel header, the
            # arguments as the message; <|call|> (end of generation) follows
            alts.append(g.add("tool-%d-call" % i,
                              '"<|channel|>" ("commentary" | "analysis") " to=functions." %s '
                              '(" " "<|constrain|>"? "json")? "<|message|>" %s'
                              % (literal(t.name), args)))
            continue
        if syntax in ("mistral-args", "mistral-callid"):
            call_id = ' "[CALL_ID]" [a-zA-Z0-9]{9}' if syntax == "mistral-callid" else ""
            alts.append(g.add("tool-%d-call" % i, '"[TOOL_CALLS]" %s%s "[ARGS]" %s'
                              % (literal(t.name), call_id, args)))
            continue
        alts.append(g.add("tool-%d-call" % i,
                          '"{" space %s space ":" space %s "," space %s space ":" space %s "}" space'
                          % (json_literal("name"), json_literal(t.name), json_literal(args_key),
                             args)))
    call = g.add("call", " | ".join(alts))
    if syntax == "harmony":
        # one call (it ends the turn), after at most one analysis message
        g.rules["root"] = ('("<|channel|>analysis<|message|>" ([^<] | "<" [^|])* '
                           '"<|end|><|start|>assistant")? %s' % call)
    elif syntax == "hermes":
        one = '"<tool_call>\\n" %s "</tool_call>"' % call
        g.rules["root"] = ('%s ("\\n" %s)*' % (one, one)) if parallel else one
    elif syntax == "mistral":
        more = ' ("," space %s)*' % call if parallel else ""
        g.rules["root"] = '"[TOOL_CALLS]" "[" space %s%s "]"' % (call, more)
    elif syntax in ("mistral-args", "mistral-callid"):
        g.rules["root"] = ("%s+" % call) if parallel else call
    else:
        if parallel:
            g.rules["root"] = '"[" space %s ("," space %s)* "]"' % (call, call)
        else:
            g.rules["root"] = call
    return g.text()


def generic_tool_prompt(tools):
    """A system prompt teaching a model without a tool-aware template to call tools."""
    listing = json.dumps([{"name": t.name, "description": t.description,
                           "parameters": t.parameters} for t in tools], indent=2)
    return ("You can call the following tools. To call one, reply with only a JSON object "
            'of the form {"name": <tool name>, "arguments": <arguments object>}.\n\n'
            "Tools:\n" + listing)


__all__ = ["ChatTemplate", "ChatPrompt", "ChatTemplateError", "Caps", "Message", "Tool",
           "ToolCall", "ReplyFormat", "detect_caps", "tool_call_grammar", "generic_tool_prompt",
           "new_tool_call_id"]
