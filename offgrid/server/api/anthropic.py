"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

    body --here--> Messages, Tools, tool_choice (offgrid/request.py)
         --chat.prepare--> the worker's "prepare_chat" (template, grammar)
         --Service.generate--> the reply ({"content", "reasoning_content",
                               "tool_calls"}; deltas while streaming)
         --here--> a Message object, or Anthropic's stream of named events

What maps to what:

    system (string or text blocks)        a "system" Message
    a "system" message in ``messages``    a "system" Message where it stands (Claude Code's
                                          mid-conversation system turns; the template
                                          renders it there, or joins it to the first)
    text blocks                           a Message's content (joined by newlines)
    image blocks (base64 source)          a media marker in it, the file on Message.media
    assistant tool_use {id,name,input}    a ToolCall (input as JSON text)
    user tool_result {tool_use_id,...}    a "tool" Message, before the user's own text
    assistant thinking {thinking}         reasoning_content
    tools {name,description,input_schema} Tool; one with ``defer_loading`` only once a
                                          tool_reference block in a tool_result names it
    tool_choice auto / any / tool / none  auto / required / the tool's name / none
    thinking {"type": "enabled"|"adaptive"|"disabled"}  enable_thinking for the template
    output_config.format json_schema      the output schema (a grammar)
    output_config.effort                  the template's reasoning_effort
    stop_sequences, max_tokens, temperature, top_p, top_k   GenerationParams

Accepted and ignored, with a debug line: ``metadata``, ``context_management``,
``cache_control`` (on any block), ``service_tier``, thinking's ``display``,
the ``?beta=true`` query and ``anthropic-beta`` headers (never read), and
any other top-level field.  Anthropic's server tools (web search, code
execution, ...) are skipped with a warning: nothing here runs them.

Errors are raised as everywhere; the routes' dialect ("anthropic") makes
``Handler._send_exception`` write them in Anthropic's shape.  Images and
documents in a user's message are refused with a 400 (in a tool result they
become a line saying they were left out).
"""

import json
import logging

from ... import jsonlimit
from ...request import FinishReason, Message, ToolCall
from . import formats, media, openai_chat as chat, pipeline
from ..httpd.httperrors import BadRequest
from .chat_fields import tool_of
from .fields import MAX_N_PREDICT, Fields, generation_from, id_slot_from
from .pipeline import Format, Generation, Prompt

log = logging.getLogger("offgrid.anthropic")

# The fields read below; any other is accepted and ignored (debug line).
_FIELDS = frozenset(("model", "messages", "system", "max_tokens", "stream", "stop_sequences",
                     "temperature", "top_p", "top_k", "tools", "tool_choice", "thinking",
                     "output_config", "id_slot", "seed"))
_IGNORED = frozenset(("metadata", "context_management", "service_tier", "container",
                      "mcp_servers", "betas", "inference_geo"))

# -- the request ------------------------------------------------------------------------


def _text_of(blocks, where):
    """The text of a string or of an array of text blocks."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise BadRequest("%s must be a string or an array of text blocks" % where)
    out = []
    for i, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise BadRequest("%s[%d] must be a text block ({\"type\": \"text\", \"text\": ...}); "
                             "only text is supported" % (where, i))
        out.append(b["text"])
    return "\n".join(out)


def _result_text(content, where, referenced):
    """A tool_result's content: a string, or blocks of text, tool_reference (a
    deferred tool the client has now loaded: noted in ``referenced``), or
    images and documents, which a text model cannot read (a line says so)."""
    if not isinstance(content, list):
        return _text_of(content, where)
    out = []
    for i, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "tool_reference" and isinstance(b.get("tool_name"), str):
            referenced.add(b["tool_name"])
            out.append("Tool %s is now available." % b["tool_name"])
        elif kind in ("image", "document"):
            out.append("[%s left out: this model reads text only]" % kind)
        else:
            out.append(_text_of([b], "%s[%d]" % (where, i)))
    return "\n".join(out)


def messages_from(system, messages, referenced=None):
    """Anthropic's ``system`` and ``messages`` as our chat Messages; the tools
    tool_reference blocks name go into the set ``referenced``."""
    out = []
    referenced = set() if referenced is None else referenced
    if system is not None:
        out.append(Message("system", _text_of(system, "system")))
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: must be a non-empty array")
    for i, m in enumerate(messages):
        where = "messages.%d" % i
        if not isinstance(m, dict):
            raise BadRequest("%s: must be an object" % where)
        role = m.get("role")
        if role not in ("user", "assistant", "system"):
            raise BadRequest("%s.role: must be \"user\", \"assistant\" or \"system\"" % where)
        if "content" not in m:
            raise BadRequest("%s.content: Field required" % where)
        content = m["content"]
        if role == "system":
            # in place: the template renders it there (or joins it to the first)
            out.append(Message("system", _text_of(content, where + ".content")))
            continue
        if isinstance(content, str):
            out.append(Message(role, content))
            continue
        if not isinstance(content, list):
            raise BadRequest("%s.content: must be a string or an array of content blocks" % where)
        msg = Message(role)
        texts, thinking = [], []
        for j, b in enumerate(content):
            bw = "%s.content.%d" % (where, j)
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                if not isinstance(b.get("text"), str):
                    raise BadRequest("%s.text: must be a string" % bw)
                texts.append(b["text"])
            elif kind == "tool_use" and role == "assistant":
                name, args = b.get("name"), b.get("input", {})
                if not isinstance(name, str) or not isinstance(args, dict) \
                        or not isinstance(b.get("id", ""), str):
                    raise BadRequest("%s: a tool_use block needs a string 'id' and 'name' and an "
                                     "object 'input'" % bw)
                msg.tool_calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False),
                                               b.get("id", "")))
            elif kind == "tool_result" and role == "user":
                tid = b.get("tool_use_id")
                if not isinstance(tid, str):
                    raise BadRequest("%s.tool_use_id: must be a string" % bw)
                result = _result_text(b.get("content", ""), bw + ".content", referenced)
                if b.get("is_error") is True:
                    result = "Error: " + result
                out.append(Message("tool", result, tool_call_id=tid))
            elif kind == "thinking" and role == "assistant":
                if not isinstance(b.get("thinking"), str):
                    raise BadRequest("%s.thinking: must be a string" % bw)
                thinking.append(b["thinking"])
            elif kind == "redacted_thinking" and role == "assistant":
                pass        # opaque to offgrid: nothing to render
            elif kind == "image" and role == "user":
                msg.media.append(media.anthropic_image(b, bw))   # its marker among the text
                texts.append(media.MARKER)
            else:
                raise BadRequest("%s: content blocks of type %r are not supported in a %s "
                                 "message (text, image, tool_use, tool_result and thinking "
                                 "are)" % (bw, kind, role))
        msg.content = "\n".join(texts)
        msg.reasoning_content = "\n".join(thinking)
        if texts or msg.tool_calls or thinking or role == "assistant":
            out.append(msg)
    media.count_check(out)
    return out


def tools_from(v, referenced=()):
    """Anthropic's client ``tools`` ({name, description, input_schema}) as Tools.

    A server tool (a ``type`` other than "custom": web search, code
    execution, ...) is skipped with a warning; one with ``defer_loading``
    is left out until a tool_reference names it (``referenced``), as
    Anthropic's tool search does.
    """
    if v is None:
        return []
    if not isinstance(v, list):
        raise BadRequest("tools: must be an array")
    out = []
    for i, t in enumerate(v):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise BadRequest("tools.%d: must be a tool {\"name\": ..., \"input_schema\": "
                             "...}" % i)
        if t.get("type", "custom") != "custom":
            log.warning("tools.%d: Anthropic's server tool %r (%s) is skipped: offgrid runs "
                        "no server tools", i, t["name"], t.get("type"))
            continue
        if t.get("defer_loading") is True and t["name"] not in referenced:
            log.debug("tools.%d: %r is deferred (defer_loading) and not referenced yet",
                      i, t["name"])
            continue
        out.append(tool_of(t["name"], t.get("description"), t.get("input_schema"),
                           "tools.%d" % i, "input_schema"))
    return out


def tool_choice_from(v, tools):
    """(our tool_choice, parallel_tool_calls) from Anthropic's ``tool_choice``."""
    if v is None:
        return "auto", None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise BadRequest("tool_choice: must be {\"type\": \"auto\" | \"any\" | \"tool\" | "
                         "\"none\"}")
    parallel = v.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("tool_choice.disable_parallel_tool_use: must be a boolean")
    parallel = None if parallel is None else not parallel
    if kind == "tool":
        name = v.get("name")
        if name not in [t.name for t in tools]:
            raise BadRequest("tool_choice.name: %r is not one of 'tools'" % (name,))
        return name, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def _thinking_from(v):
    """enable_thinking for the template: True, False, or None (the template's default)."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise BadRequest("thinking: must be an object {\"type\": \"enabled\" | \"adaptive\" "
                         "| \"disabled\"}")
    kind = v.get("type")
    for k in v:
        if k not in ("type", "budget_tokens"):
            log.debug("thinking.%s is ignored", k)
    if kind not in ("enabled", "disabled", "adaptive"):
        log.debug("thinking type %r is not known here: the template's default", kind)
        return None
    return kind != "disabled"


def _budget_from(v):
    """thinking.budget_tokens of {"type": "enabled"}: the reasoning budget (None: the
    server's --reasoning-budget)."""
    if not isinstance(v, dict) or v.get("type") != "enabled" or v.get("budget_tokens") is None:
        return None
    n = v["budget_tokens"]
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < 2 ** 31:
        raise BadRequest("thinking.budget_tokens: must be a whole number, 0 or more")
    return n


def _effort_from(v):
    """output_config.effort as the template's reasoning_effort ({} when not given)."""
    effort = v.get("effort") if isinstance(v, dict) else None
    if effort is None:
        return {}
    if not isinstance(effort, str):
        raise BadRequest("output_config.effort: must be a string")
    return {"reasoning_effort": effort}


def _note_ignored(f):
    for k in f.body:
        if k in _IGNORED:
            log.debug("'%s' is accepted and ignored", k)
        elif k not in _FIELDS:
            log.debug("unknown field '%s' is ignored", k)


def _schema_from(v):
    """The JSON schema of ``output_config.format`` (structured outputs), or None."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise BadRequest("output_config: must be an object")
    fmt = v.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" \
            or not isinstance(fmt.get("schema"), dict):
        raise BadRequest("output_config.format: must be {\"type\": \"json_schema\", "
                         "\"schema\": {...}}")
    return fmt["schema"] or {"type": "object"}


def _prepare(f, entry, what, tokenize=True):
    _note_ignored(f)
    referenced = set()
    messages = messages_from(f.raw("system"), f.raw("messages"), referenced)
    tools = tools_from(f.raw("tools"), referenced)
    tool_choice, parallel = tool_choice_from(f.raw("tool_choice"), tools)
    return chat.prepare(entry, messages, tools, tool_choice,
                        schema=_schema_from(f.raw("output_config")) if tokenize else None,
                        enable_thinking=_thinking_from(f.raw("thinking")),
                        kwargs=_effort_from(f.raw("output_config")),
                        parallel_tool_calls=parallel, tokenize=tokenize, what=what)


# -- the response -----------------------------------------------------------------------

def stop_reason(c):
    """(stop_reason, stop_sequence) in Anthropic's words."""
    if c.reply and c.reply["tool_calls"] and c.finish_reason is FinishReason.STOP:
        return "tool_use", None
    if c.finish_reason is FinishReason.LENGTH:
        return "max_tokens", None
    if c.stop_type == "word":
        return "stop_sequence", c.stopping_word
    return "end_turn", None


def _tool_use(tc):
    try:
        args = jsonlimit.loads(tc["arguments"] or "{}")
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": tc["id"], "name": tc["name"],
            "input": args if isinstance(args, dict) else {}}


def content_blocks(reply):
    """A reply's content blocks: thinking, text, then one tool_use per call."""
    blocks = []
    if reply["reasoning_content"]:
        blocks.append({"type": "thinking", "thinking": reply["reasoning_content"],
                       "signature": ""})
    if reply["content"] or not reply["tool_calls"]:
        blocks.append({"type": "text", "text": reply["content"]})
    blocks += [_tool_use(tc) for tc in reply["tool_calls"]]
    return blocks


def _usage(c):
    return {"input_tokens": c.usage.prompt_tokens, "output_tokens": c.usage.completion_tokens,
            "cache_read_input_tokens": c.usage.cached_tokens,
            "cache_creation_input_tokens": 0}


def _message(mid, model, content, stop=(None, None), usage=None):
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
            "usage": usage or {"input_tokens": 0, "output_tokens": 0}}


# -- the endpoints ----------------------------------------------------------------------

def messages(h, body):
    """POST /v1/messages."""
    f = Fields(body)
    svc = h.service
    if not f.has("max_tokens"):
        raise BadRequest("max_tokens: Field required")
    f.int("max_tokens", 0, lo=1, hi=MAX_N_PREDICT)
    entry = svc.entry_for(f.raw("model"))
    what = "POST /v1/messages"
    plan = _prepare(f, entry, what)
    gen = generation_from(f, entry.n_vocab, svc.generation_default, ("max_tokens",),
                          entry.sampling)
    gen.stop = f.stop_list("stop_sequences")
    chat.apply_plan(gen, plan)
    gen.reasoning_budget = _budget_from(f.raw("thinking"))
    g = Generation(entry, gen, [Prompt(plan["tokens"])], "v1/messages", what,
                   stream=f.bool("stream", False), id_slot=id_slot_from(f), chat=plan["chat"])
    pipeline.run(h, g, MessagesFormat(entry.id, len(plan["tokens"])))


class MessagesFormat(Format):
    """A Message object, or Anthropic's stream of named events (``_Stream``)."""

    def __init__(self, model, n_prompt):
        self.model, self.n_prompt = model, n_prompt
        self.mid = "msg_" + formats.new_id("x")[2:]
        self._stream = None

    def _st(self, out):
        if self._stream is None:
            self._stream = _Stream(out, self.mid, self.model, self.n_prompt)
        return self._stream

    # Anthropic's own keep-alive event, which its clients read and skip
    keepalive = b'event: ping\ndata: {"type":"ping"}\n\n'

    def open(self, out):
        self._st(out).start()

    def piece(self, out, job, d, probs):
        return self._st(out).delta(d)

    def choice_end(self, out, job, c):
        self._st(out).finish(c)

    def body(self, jobs, done):
        c = done[0]
        return _message(self.mid, self.model, content_blocks(c.reply), stop_reason(c), _usage(c))


class _Stream:
    """Anthropic's event sequence from reply deltas.

    message_start, then per block content_block_start, its deltas,
    content_block_stop (a new kind of delta closes the open block), then
    message_delta (stop_reason, usage) and message_stop.  message_start goes
    out as the stream opens (``MessagesFormat.open``), before the prompt is
    evaluated.
    """

    def __init__(self, es, mid, model, n_prompt):
        self.es, self.mid, self.model, self.n_prompt = es, mid, model, n_prompt
        self.started = False
        self.index = -1         # the open block's index
        self.kind = None        # the open block's type, None when none is open

    def _send(self, obj):
        return self.es.send(obj, obj["type"])

    def start(self):
        if not self.started:
            self.started = True
            self._send({"type": "message_start", "message": _message(
                self.mid, self.model, [], usage={"input_tokens": self.n_prompt,
                                                  "output_tokens": 0})})

    def _open(self, kind, block):
        self._close()
        self.index += 1
        self.kind = kind
        return self._send({"type": "content_block_start", "index": self.index,
                           "content_block": block})

    def _close(self):
        if self.kind is not None:
            self._send({"type": "content_block_stop", "index": self.index})
            self.kind = None

    def _delta(self, delta):
        return self._send({"type": "content_block_delta", "index": self.index, "delta": delta})

    def delta(self, d):
        self.start()
        if "tool_call" in d:
            _, tc = d["tool_call"]
            self._open("tool_use", {"type": "tool_use", "id": tc["id"], "name": tc["name"],
                                    "input": {}})
            args = json.dumps(_tool_use(tc)["input"], ensure_ascii=False)
            ok = self._delta({"type": "input_json_delta", "partial_json": args})
            self._close()
            return ok
        if "reasoning_content" in d:
            if self.kind != "thinking":
                self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            return self._delta({"type": "thinking_delta", "thinking": d["reasoning_content"]})
        if self.kind != "text":
            self._open("text", {"type": "text", "text": ""})
        return self._delta({"type": "text_delta", "text": d.get("content", "")})

    def finish(self, c):
        self.start()
        if self.index < 0:
            self._open("text", {"type": "text", "text": ""})     # never an empty content list
        self._close()
        reason, seq = stop_reason(c)
        self._send({"type": "message_delta", "delta": {"stop_reason": reason,
                                                       "stop_sequence": seq},
                    "usage": {"output_tokens": c.usage.completion_tokens}})
        self._send({"type": "message_stop"})


def count_tokens(h, body):
    """POST /v1/messages/count_tokens: the prompt's length through the model's template."""
    f = Fields(body)
    entry = h.service.entry_for(f.raw("model"))
    plan = _prepare(f, entry, "POST /v1/messages/count_tokens")
    h.send_json(200, {"input_tokens": len(plan["tokens"])})
