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
template families get their own adjustments (chat/adjust.py).

Tool calls and reasoning in the reply are read by chat.reply; this
module decides the format from the template (``ReplyFormat``,
chat/replyformat.py) and asks chat/forced.py for the grammar that forces a
tool call when ``tool_choice`` requires one.
"""

import dataclasses
import json
import random
import re
import string
import time
from dataclasses import dataclass
from typing import Optional

from . import jinja
from .. import jsonlimit
from ..request import Message, Tool, ToolCall  # noqa: F401  (the typed chat request)
from .adjust import (adjust_for_family, as_text, continued_turn, leading_system,
                     system_before_last_turn, template_family, trimmed)
from .caps import (Caps, ChatTemplateError, TemplateBudgetError, detect_caps,  # noqa: F401
                   load_budget, preserve_reasoning_vars, renders_later_system)
from .calls import as_shape
from .derive import derive_shape, json_call_of, reads_own_call
from .forced import generic_tool_prompt, shape_grammar, tool_call_grammar  # noqa: F401
from .replyformat import (CALL_TRIGGERS, ReplyFormat, call_form_of, reasoning_markers_of,
                          tool_syntax_of)
from .shapes import shape_of, stray_markers_of


def regex_literal(text):
    """An ECMAScript regex matching ``text``: only its syntax characters
    escaped (libllama compiles a trigger with std::regex, and an escape it
    does not know would throw through the C API)."""
    return "".join("\\" + c if c in "^$\\.*+?()[]{}|/" else c for c in text)


def new_tool_call_id(length=32):
    """A random id for a tool call (llama-server's form; Mistral templates want 9 characters)."""
    alphabet = string.ascii_letters + string.digits
    return "".join(random.choice(alphabet) for _ in range(length))


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
        self.renders_later_system = renders_later_system(self.template, budget)
        self.family = template_family(self.source)
        self.tool_syntax = tool_syntax_of(self.source)
        self.call_form = call_form_of(self.source, self.tool_syntax)
        self.reasoning_markers = reasoning_markers_of(self.source)
        self.supports_thinking, self.reasoning_start, self.reasoning_end = \
            self._analyze_reasoning(budget)
        # the family's declared shape; a template in no entry whose calls no
        # other reader knows gets the shape its own renderings show (derive.py)
        self.call_shape = shape_of(self.source, self.family)
        if not self.call_shape and self._own_calls_unread(budget):
            derived = derive_shape(self.probe_renderer(budget))
            self.call_shape = dataclasses.asdict(derived) if derived else ""
        # how its JSON calls look, where the shape writes JSON (forced calls write the same)
        self.call_json, self.call_json_list = None, False
        if self.call_shape and as_shape(self.call_shape).body == "json" \
                and not as_shape(self.call_shape).recipients:
            found = json_call_of(self.probe_renderer(budget))
            if found:
                self.call_json, self.call_json_list = found

    def _own_calls_unread(self, budget):
        """Whether the syntax's reader misses the calls this template renders
        (a template in no entry: GLM's <arg_key> after a hermes <tool_call>),
        so that its own renderings must show how to read them; the generic
        reader always asks them."""
        if self.tool_syntax == "generic":
            return True
        if self.tool_syntax == "harmony":
            return False
        from .reply import parse_reply      # reply.py imports this module

        def read(text, names):
            fmt = ReplyFormat(tool_syntax=self.tool_syntax, parse_tools=True, tool_names=names)
            return parse_reply(text, fmt).tool_calls
        return reads_own_call(self.probe_renderer(budget), read) is False

    # -- rendering -------------------------------------------------------------
    def render(self, messages, tools=(), add_generation_prompt=True, enable_thinking=None,
               kwargs=None, now=None, json_schema=None):
        """The prompt text for these messages (what llama-server's /apply-template returns)."""
        return self._render(messages, tools, add_generation_prompt, enable_thinking, kwargs,
                            now, json_schema)

    def apply(self, messages, tools=(), add_generation_prompt=True, enable_thinking=None,
              kwargs=None, now=None, json_schema=None, tool_choice="auto",
              parallel_tool_calls=None, reasoning_format="auto", continue_final=None,
              continuation=None):
        """A ChatPrompt: the prompt, and how to read (and maybe constrain) the reply.

        ``continue_final`` (default: when the last message is the assistant's)
        continues that message instead of starting a new one, as llama-server's
        assistant prefill does.  ``continuation``: which part of it goes on,
        "content" or "reasoning" (llama-server's continue_final_message
        "content" / "reasoning_content"); None: its reasoning where it has
        nothing else, else its content (llama-server's ``true``).
        """
        if continue_final is None:
            continue_final = bool(messages) and messages[-1].role == "assistant"
        head, prefill = (messages[:-1], messages[-1]) if continue_final else (messages, None)
        if prefill is not None and continuation is None:
            continuation = "reasoning" if prefill.reasoning_content and not (
                prefill.content or prefill.parts) else "content"
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
            generation_prompt = self._continued(generation_prompt, prefill,
                                                continuation == "reasoning")
            text = without_gp + generation_prompt
        fmt = self.reply_format(generation_prompt, tools, tool_choice, reasoning_format)
        if prefill is not None and continuation == "content":
            # the reply goes on with the message's text, past any reasoning the
            # turn opened (DeepSeek's <think> in the header)
            fmt.starts_in_reasoning, fmt.reopened = False, ""
        if prefill is not None:
            fmt.reasoning_lead = ""         # llama.cpp's continued reasoning has none
            if continuation == "reasoning" and not fmt.starts_in_reasoning \
                    and self.reasoning_end.strip(_SPACES):
                # a continued reasoning goes on as reasoning, whatever marks it
                # (Apriel 1.6's block opens with its turn's header)
                fmt.starts_in_reasoning = True
                fmt.reasoning_end = self.reasoning_end.strip(_SPACES)
        grammar, triggers = None, ()
        if tools and tool_choice not in ("auto", "none"):
            # one forced call unless asked for more: a model that does not stop
            # on its own would otherwise repeat calls up to max_tokens
            grammar = self.call_grammar(tools, tool_choice, bool(parallel_tool_calls))
        elif tools and tool_choice == "auto" and self.call_trigger:
            # llama-server's lazy grammar: any text until the model opens a
            # call, then only a well-formed call to one of ``tools``
            grammar = self.call_grammar(tools, "required", bool(parallel_tool_calls))
            triggers = (self.call_trigger,)
        return ChatPrompt(text, generation_prompt, fmt, grammar, triggers)

    @property
    def call_trigger(self):
        """What opens a call (an ECMAScript regex), where a lazy grammar can start
        there: the shape's first opener, or the syntax's (CALL_TRIGGERS); "" where
        none (a call written as bare JSON, or as a message to a recipient)."""
        if self.call_shape:
            shape = as_shape(self.call_shape)
            opener = shape.openers[0] if shape.openers and not shape.recipients else ""
            # a word (FireFunction's "functools") may come in the model's
            # text too, in code: only markup starts a grammar there
            if not any(c in opener for c in "<[|｜"):
                return ""
            return regex_literal(opener)
        return CALL_TRIGGERS.get(self.tool_syntax, "")

    def call_grammar(self, tools, tool_choice="required", parallel=False, tokens=None):
        """GBNF for a call to one of ``tools`` (or the one ``tool_choice`` names)
        as this template writes it: in its family's shape where it has one
        (chat/shapes.py, read back by chat/calls.py), else in its syntax.
        ``tokens``: the shape's markers that are one token of the model's
        vocabulary, asked for as that token (chat/forced.py)."""
        if self.call_shape:
            return shape_grammar(tools, as_shape(self.call_shape), tool_choice, parallel,
                                 self.call_json, self.call_json_list, tokens)
        return tool_call_grammar(tools, self.call_form, tool_choice, parallel)

    def _continued(self, generation_prompt, msg, reasoning_only):
        """The start of the assistant's turn followed by the message being continued.

        As llama-server: the message's reasoning goes between the family's
        markers (chat/adjust.py's CONTINUED_TURNS where its reader declares
        them, else the template's own), closed when its content is continued
        (``reasoning_only`` False).
        """
        # text parts joined by a blank line here, as llama-server's render_content
        # (elsewhere a newline joins them)
        content = msg.content if msg.parts is None else "\n\n".join(msg.parts)
        declared = continued_turn(self.family, self.source)
        if declared is None:
            # the template's own markers, as llama.cpp's auto-parser finds them
            out, start, end = generation_prompt, self.reasoning_start, self.reasoning_end
            if not start:
                return out if reasoning_only else out + content
            k = out.find(start)
            out = out[:k] if k >= 0 else out
        else:
            head, start, end = declared
            out = generation_prompt if head is None else head
            if start is None:
                return out + end + content
        out += start + msg.reasoning_content
        return out if reasoning_only else out + end + content

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
                if start[:1] not in "<[◁":
                    fmt.reasoning_lead = generation_prompt[s:]
                break
        fmt.open_header = self._open_header(generation_prompt)
        return fmt

    def _open_header(self, generation_prompt):
        """The header of the message a continued turn's prompt ends inside, where
        the reply is a run of messages (ReplyFormat.open_header); else ""."""
        if self.tool_syntax == "harmony":
            sep, name_end, ends = "<|start|>", "<|message|>", ("<|end|>", "<|call|>")
        elif self.call_shape and as_shape(self.call_shape).recipients:
            sep, name_end, *ends = as_shape(self.call_shape).recipients
        else:
            return ""
        s = generation_prompt.rfind(sep)
        e = generation_prompt.find(name_end, s + len(sep)) if s >= 0 else -1
        if e < 0 or any(m in generation_prompt[e:] for m in ends):
            return ""
        return generation_prompt[s + len(sep):e + len(name_end)]

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
            messages = [trimmed(m) for m in messages]
        msgs = [self._message_json(m) for m in messages]
        if "<|channel|>" not in src:
            for m in msgs:
                if m["role"] == "developer":
                    m["role"] = "system"
        msgs = system_before_last_turn(msgs)
        if not self.renders_later_system:
            msgs = leading_system(msgs)
        if not self.caps.supports_system_role and msgs and msgs[0]["role"] == "system":
            first = msgs.pop(0)
            if msgs:
                msgs[0]["content"] = as_text(first["content"]) + "\n" + \
                    as_text(msgs[0]["content"])
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
        msgs = adjust_for_family(self.family, src, msgs)

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
            for k, v in preserve_reasoning_vars(kwargs["preserve_reasoning"]).items():
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

__all__ = ["ChatTemplate", "ChatPrompt", "ChatTemplateError", "Caps", "Message", "Tool",
           "ToolCall", "ReplyFormat", "detect_caps", "tool_call_grammar", "generic_tool_prompt",
           "new_tool_call_id"]
