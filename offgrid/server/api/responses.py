"""OpenAI's Responses API: POST /v1/responses, stateless.

    body --here--> Messages, Tools, tool_choice, output schema (offgrid/request.py)
         --chat.prepare--> the worker's "prepare_chat" (template, grammar)
         --Service.generate--> the reply (deltas while streaming)
         --here--> a Response object, or its stream of typed events

What maps to what:

    instructions                         a "system" Message first
    input: a string                      one "user" Message
    input: message items (input_text / output_text / text parts)   Messages
    input_image parts (data: URIs)       a media marker, the file on Message.media
    function_call {call_id,name,arguments}   a ToolCall of the assistant Message
    function_call_output {call_id,output}    a "tool" Message
    reasoning {content: reasoning_text}      the next assistant Message's reasoning_content
    tools [{type: function, name, ...}]  Tool;  tool_choice auto/none/required/{name}
    tools [{type: namespace, name, tools}]   its functions, each a Tool named as its
                                         function (or ``namespace__function`` where two
                                         would share a name); their calls come back
                                         with ``namespace`` and the function's name, as
                                         Codex reads them
    any other tool type (web_search, file_search, code_interpreter, computer_use,
    image_generation, local_shell, mcp, custom, ...)   skipped, with a warning: nothing
                                         here runs them
    text.format json_schema / json_object    the output schema (a grammar)
    max_output_tokens, temperature, top_p    GenerationParams

The output is a ``reasoning`` item (from the reply's reasoning split), a
``message`` item with one ``output_text`` part, and a ``function_call``
item per call.  Nothing is stored: ``previous_response_id`` and
``conversation`` get a 400, ``store`` is accepted and ignored, as are (with
a debug line) ``include``, ``prompt_cache_key``, ``client_metadata``,
``reasoning.summary`` and any other field.
"""

import json
import logging

from ...request import FinishReason, Message, ToolCall
from . import formats, media, openai_chat as chat, pipeline
from .errormap import to_http_error
from ..httpd.httperrors import BadRequest
from .pipeline import Format, Generation, Prompt
from .chat_fields import tool_choice_from, tool_of
from .fields import MAX_N_PREDICT, Fields, generation_from, id_slot_from

log = logging.getLogger("offgrid.responses")

_FIELDS = frozenset(("model", "input", "instructions", "tools", "tool_choice", "text",
                     "reasoning", "max_output_tokens", "temperature", "top_p", "stream",
                     "store", "parallel_tool_calls", "metadata", "background",
                     "previous_response_id", "conversation", "id_slot", "seed"))
# input items that carry nothing a local model can use: skipped (debug line)
_SKIPPED_ITEMS = ("web_search_call", "file_search_call", "computer_call",
                  "computer_call_output", "image_generation_call", "code_interpreter_call",
                  "local_shell_call", "local_shell_call_output", "mcp_list_tools",
                  "mcp_call", "mcp_approval_request", "mcp_approval_response",
                  "compaction", "compaction_summary", "item_reference")

# -- the request ------------------------------------------------------------------------

_TEXT_PARTS = ("input_text", "output_text", "text")


def _text_of(content, where, files=None):
    """The text of a string or of text parts; with ``files`` (a list) input_image parts
    too, each its media marker in the text and its base64 appended to ``files``."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest("'%s' must be a string or an array of text parts" % where)
    out = []
    for i, p in enumerate(content):
        if files is not None and isinstance(p, dict) and p.get("type") == "input_image":
            if p.get("image_url") is None:
                raise BadRequest("'%s[%d].image_url' is required: a data: URI (file ids are "
                                 "not kept by offgrid)" % (where, i))
            files.append(media.from_url(p.get("image_url"), "%s[%d].image_url" % (where, i)))
            out.append(media.MARKER)
            continue
        if not isinstance(p, dict) or p.get("type") not in _TEXT_PARTS \
                or not isinstance(p.get("text"), str):
            raise BadRequest("'%s[%d]' must be an input_text part; only text is supported"
                             % (where, i))
        out.append(p["text"])
    return "\n".join(out)


def _output_text(output, where):
    """A function_call_output's output: a string, or parts whose images a text
    model cannot see (a line says they were left out)."""
    if isinstance(output, list):
        output = [p if not (isinstance(p, dict) and p.get("type") in ("input_image",
                                                                        "input_file"))
                  else {"type": "input_text", "text": "[%s left out: this model reads text "
                        "only]" % p["type"][6:]} for p in output]
    return _text_of(output, where)


def messages_from(instructions, items, spaces=None):
    """``instructions`` and ``input`` (a string or items) as our chat Messages;
    ``spaces`` maps (namespace, function) back to the name the model knows."""
    spaces = spaces or {}
    out = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("'instructions' must be a string")
        out.append(Message("system", instructions))
    if isinstance(items, str):
        out.append(Message("user", items))
        return out
    if not isinstance(items, list) or not items:
        raise BadRequest("'input' must be a string or a non-empty array of items")

    def assistant(fresh):
        """The assistant Message to add to: the last one while it can take it, or a new one."""
        last = out[-1] if out else None
        if last is None or last.role != "assistant" or not fresh(last):
            last = Message("assistant")
            out.append(last)
        return last

    for i, it in enumerate(items):
        where = "input[%d]" % i
        if not isinstance(it, dict):
            raise BadRequest("'%s' must be an object" % where)
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise BadRequest("'%s.role' must be user, assistant, system or developer" % where)
            files = [] if role == "user" else None
            text = _text_of(it.get("content"), where + ".content", files)
            if role == "assistant":
                assistant(lambda m: not m.content and not m.tool_calls).content = text
            else:
                out.append(Message(role, text, media=files or []))
        elif kind == "function_call":
            name, args, call_id = it.get("name"), it.get("arguments", "{}"), it.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) \
                    or not isinstance(call_id, str):
                raise BadRequest("'%s' (function_call) needs string 'call_id', 'name' and "
                                 "'arguments'" % where)
            name = spaces.get((it.get("namespace"), name), name)
            assistant(lambda m: True).tool_calls.append(ToolCall(name, args, call_id))
        elif kind == "custom_tool_call":
            # a freeform tool's call (offgrid offers none, but history may hold one)
            name, call_id = it.get("name"), it.get("call_id")
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise BadRequest("'%s' (custom_tool_call) needs string 'call_id' and 'name'"
                                 % where)
            args = json.dumps({"input": it.get("input", "")}, ensure_ascii=False)
            assistant(lambda m: True).tool_calls.append(ToolCall(name, args, call_id))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = it.get("call_id")
            if not isinstance(call_id, str):
                raise BadRequest("'%s.call_id' must be a string" % where)
            out.append(Message("tool", _output_text(it.get("output", ""), where + ".output"),
                               tool_call_id=call_id))
        elif kind in _SKIPPED_ITEMS:
            log.debug("%s: a %s item is skipped", where, kind)
        elif kind == "reasoning":
            parts = it.get("content") or it.get("summary") or []
            if not isinstance(parts, list):
                raise BadRequest("'%s.content' must be an array" % where)
            text = "\n".join(p.get("text", "") for p in parts
                             if isinstance(p, dict) and isinstance(p.get("text"), str))
            out.append(Message("assistant", reasoning_content=text))
        else:
            raise BadRequest("'%s': items of type %r are not supported (message, function_call, "
                             "function_call_output and reasoning are)" % (where, kind))
    media.count_check(out)
    return out


def tools_from(v):
    """Responses' function tools as Tools: (tools, spaces).

    A namespace's functions are tools of their own, named as the function
    (``namespace__function`` if that name is taken); ``spaces`` maps each
    such tool's name to (namespace, function) and back.  Built-in tools are
    skipped with a warning.
    """
    if v is None:
        return [], {}
    if not isinstance(v, list):
        raise BadRequest("'tools' must be an array")
    found = []      # (namespace or None, the function's dict, where)
    for i, t in enumerate(v):
        where = "'tools[%d]'" % i
        kind = t.get("type") if isinstance(t, dict) else None
        if kind == "namespace" and isinstance(t.get("tools"), list):
            if not isinstance(t.get("name"), str) or not t["name"]:
                raise BadRequest("%s: a namespace needs a 'name'" % where)
            found += [(t["name"], f, "%s.tools[%d]" % (where[:-1], j) + "'")
                      for j, f in enumerate(t["tools"])]
        elif kind == "function":
            found.append((None, t, where))
        elif isinstance(kind, str):
            log.warning("%s: the built-in tool %r is skipped: offgrid runs no built-in tools",
                        where, kind)
        else:
            raise BadRequest("%s must be {\"type\": \"function\", \"name\": ..., "
                             "\"parameters\": ...}" % where)
    taken = {}
    for ns, f, where in found:
        name = f.get("name") if isinstance(f, dict) else None
        if not isinstance(name, str) or not name or \
                (isinstance(f, dict) and f.get("type", "function") != "function"):
            raise BadRequest("%s must be {\"type\": \"function\", \"name\": ..., "
                             "\"parameters\": ...}" % where)
        taken[name] = taken.get(name, 0) + 1
    tools, spaces = [], {}
    for ns, f, where in found:
        name = f["name"]
        if ns is not None:
            # Codex's flat form (ToolName::canonical_flat_name) where the plain name is taken
            shown = name if taken[name] == 1 else "%s__%s" % (ns.rstrip("_"), name.lstrip("_"))
            spaces[shown] = (ns, name)
            spaces[(ns, name)] = shown
            name = shown
        tools.append(tool_of(name, f.get("description"), f.get("parameters") or {}, where))
    return tools, spaces


def _tool_choice(v, tools):
    if isinstance(v, dict) and v.get("type") == "function":
        v = {"type": "function", "function": {"name": v.get("name")}}  # chat's form
    return tool_choice_from(v, tools)


def _schema_from(text):
    """The output schema of ``text.format``: None (free text) or a JSON schema."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise BadRequest("'text' must be an object")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise BadRequest("'text.format.schema' must be an object")
        return schema or {"type": "object"}
    raise BadRequest("'text.format.type' must be \"text\", \"json_object\" or \"json_schema\"")


def _thinking_from(f):
    r = f.raw("reasoning")
    if r is None:
        return None, {}
    if not isinstance(r, dict):
        raise BadRequest("'reasoning' must be an object")
    effort = r.get("effort")
    if effort is None:
        return None, {}
    if not isinstance(effort, str):
        raise BadRequest("'reasoning.effort' must be a string")
    return (False, {}) if effort == "none" else (None, {"reasoning_effort": effort})


# -- the response -----------------------------------------------------------------------

class _Ids:
    """The ids of one response and its items."""

    def __init__(self):
        self.hex = formats.new_id("x")[2:]
        self.response = "resp_" + self.hex

    def item(self, prefix, index):
        """The id of output item ``index`` ("rs", "msg" or "fc")."""
        return "%s_%s_%d" % (prefix, self.hex, index)


def _reasoning_item(item_id, text, status="completed"):
    content = [{"type": "reasoning_text", "text": text}] if text is not None else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content,
            "status": status}


def _text_part(text):
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id, text, status="completed"):
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [_text_part(text)] if text is not None else []}


def _call_item(item_id, tc, status="completed", arguments=None, spaces=None):
    item = {"type": "function_call", "id": item_id, "call_id": tc["id"],
            "name": tc["name"], "status": status,
            "arguments": tc["arguments"] if arguments is None else arguments}
    space = (spaces or {}).get(tc["name"])
    if space is not None:
        item["namespace"], item["name"] = space      # as the client declared it
    return item


def _item_status(c):
    """A finished reply's status: cut at max_output_tokens, its text item is "incomplete"."""
    return "incomplete" if c.finish_reason is FinishReason.LENGTH else "completed"


def output_items(ids, reply, status="completed", spaces=None):
    out = []
    if reply["reasoning_content"]:
        out.append(_reasoning_item(ids.item("rs", len(out)), reply["reasoning_content"],
                                   status if not reply["content"] else "completed"))
    if reply["content"] or not reply["tool_calls"]:
        out.append(_message_item(ids.item("msg", len(out)), reply["content"], status))
    for tc in reply["tool_calls"]:
        out.append(_call_item(ids.item("fc", len(out)), tc, spaces=spaces))
    return out


class _Request:
    """What the response object echoes of the request."""

    def __init__(self, f, gen, tool_choice, raw_tools, spaces=None):
        self.spaces = spaces or {}
        self.instructions = f.raw("instructions")
        self.max_output_tokens = gen.n_predict if gen.n_predict >= 0 else None
        self.temperature = gen.sampling.temperature
        self.top_p = gen.sampling.top_p
        self.tool_choice = tool_choice if isinstance(tool_choice, str) and tool_choice in (
            "auto", "none", "required") else {"type": "function", "name": tool_choice}
        self.tools = raw_tools or []
        self.text = f.raw("text") or {"format": {"type": "text"}}
        self.parallel_tool_calls = f.raw("parallel_tool_calls", True)
        self.metadata = f.raw("metadata") or {}
        self.timings_per_token = gen.timings_per_token


def response_object(ids, model, req, created, output, c=None):
    """A Response: in progress (``c`` None) or finished with ``c``'s usage and status."""
    status, incomplete = "in_progress", None
    usage = None
    if c is not None:
        status = "completed"
        if c.finish_reason is FinishReason.LENGTH:
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        u = c.usage
        usage = {"input_tokens": u.prompt_tokens,
                 "input_tokens_details": {"cached_tokens": u.cached_tokens},
                 "output_tokens": u.completion_tokens,
                 "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": u.prompt_tokens + u.completion_tokens}
    return {"id": ids.response, "object": "response", "created_at": created, "status": status,
            "error": None, "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": req.temperature, "text": req.text, "tool_choice": req.tool_choice,
            "tools": req.tools, "top_p": req.top_p, "truncation": "disabled", "usage": usage,
            "metadata": req.metadata, "user": None}


# -- the endpoint -----------------------------------------------------------------------

def _prepare(h, f, what):
    """(entry, the worker's chat plan, tool_choice) of a Responses body: its checks,
    its conversation through the model's template."""
    for name in ("previous_response_id", "conversation"):
        if f.has(name):
            raise BadRequest("'%s' is not supported: offgrid stores no responses; send the "
                             "whole conversation in 'input'" % name)
    if f.bool("background", False):
        raise BadRequest("'background' is not supported: offgrid stores no responses")
    f.bool("store", False)          # accepted and ignored: nothing is stored
    for k in f.body:
        if k not in _FIELDS:
            log.debug("'%s' is accepted and ignored", k)
    if not f.has("input"):
        raise BadRequest("'input' is required")
    f.int("max_output_tokens", 0, lo=1, hi=MAX_N_PREDICT)
    entry = h.service.entry_for(f.raw("model"))
    tools, spaces = tools_from(f.raw("tools"))
    messages = messages_from(f.raw("instructions"), f.raw("input"), spaces)
    tool_choice = _tool_choice(f.raw("tool_choice"), tools)
    enable_thinking, kwargs = _thinking_from(f)
    parallel = f.bool("parallel_tool_calls", None)
    plan = chat.prepare(entry, messages, tools, tool_choice, schema=_schema_from(f.raw("text")),
                        enable_thinking=enable_thinking, kwargs=kwargs,
                        parallel_tool_calls=parallel, what=what)
    return entry, plan, tool_choice, spaces


def responses(h, body):
    """POST /v1/responses (and /responses)."""
    f = Fields(body)
    svc = h.service
    what = "POST /v1/responses"
    entry, plan, tool_choice, spaces = _prepare(h, f, what)
    gen = generation_from(f, entry.n_vocab, svc.generation_default, ("max_output_tokens",),
                          entry.sampling)
    gen.stop = []       # the Responses API has no stop strings
    chat.apply_plan(gen, plan)
    stream = f.bool("stream", False)
    # llama-server's telemetry: prompt progress as response.in_progress events,
    # timings on the deltas (both asked for), and on the final event
    gen.return_progress = stream and f.bool("return_progress", False)
    gen.timings_per_token = stream and f.bool("timings_per_token", False)
    req = _Request(f, gen, tool_choice, f.raw("tools"), spaces)
    g = Generation(entry, gen, [Prompt(plan["tokens"])], "v1/responses", what,
                   stream=stream, id_slot=id_slot_from(f), chat=plan["chat"])
    pipeline.run(h, g, ResponsesFormat(entry.id, req))


def input_tokens(h, body):
    """POST /v1/responses/input_tokens (and /responses/input_tokens): the length of
    the request's prompt through the template, as llama-server's and OpenAI's; nothing
    is generated."""
    entry, plan, _, _ = _prepare(h, Fields(body), "POST /v1/responses/input_tokens")
    h.send_json(200, {"object": "response.input_tokens", "input_tokens": len(plan["tokens"])})


class ResponsesFormat(Format):
    """A Response object, or the Responses event sequence (``_Stream``)."""

    def __init__(self, model, req):
        self.model, self.req = model, req
        self.ids, self.created = _Ids(), formats.now()
        self._stream = None

    def _st(self, out):
        if self._stream is None:
            self._stream = _Stream(out, self.ids, self.model, self.req, self.created)
        return self._stream

    def open(self, out):
        self._st(out).start()

    def progress(self, out, job, p):
        return self._st(out).progress(p, self.req.timings_per_token)

    def piece(self, out, job, d, probs, usage=None):
        return self._st(out).delta(d, usage)

    def choice_end(self, out, job, c):
        self._st(out).finish(c)

    def fail(self, out, exc):
        st = self._st(out)
        if not st.ended:
            err = to_http_error(exc)
            st.fail("server_error" if err.status >= 500 else "invalid_prompt", err.message)
        out.end()

    def body(self, jobs, done):
        c = done[0]
        return response_object(self.ids, self.model, self.req, self.created,
                               output_items(self.ids, c.reply, _item_status(c),
                                            self.req.spaces), c)


class _Stream:
    """The Responses event sequence from reply deltas.

    response.created and response.in_progress go out as the stream opens
    (``ResponsesFormat.open``), before the prompt is evaluated; each output
    item is added, gets its content part and deltas, and is done when a
    delta of another kind arrives or the reply ends; then
    response.completed (or response.incomplete at max_output_tokens) carries
    the whole response.  Every event has a ``sequence_number``.
    """

    def __init__(self, es, ids, model, req, created):
        self.es, self.ids, self.model, self.req, self.created = es, ids, model, req, created
        self.seq = 0
        self.started = False
        self.ended = False      # its terminal event went out
        self.output = []        # finished items
        self.kind = None        # the open item's type: "reasoning", "message" or None
        self.item_id = None     # the open item's id
        self.text = ""          # the open item's text so far

    def _send(self, kind, _extra=None, **fields):
        obj = dict({"type": kind, "sequence_number": self.seq}, **fields)
        if _extra:
            obj.update(_extra)      # llama-server's telemetry, beside OpenAI's fields
        self.seq += 1
        return self.es.send(obj, kind)

    def _response(self, c=None):
        return response_object(self.ids, self.model, self.req, self.created, list(self.output), c)

    def start(self):
        if not self.started:
            self.started = True
            self._send("response.created", response=self._response())
            self._send("response.in_progress", response=self._response())

    def progress(self, p, with_timings):
        """Prompt progress (return_progress): a response.in_progress event carrying
        llama-server's ``prompt_progress`` (and ``timings``, with timings_per_token)."""
        self.start()
        extra = {"prompt_progress": formats.progress_json(p)}
        if with_timings:
            extra["timings"] = formats.progress_timings(p)
        return self._send("response.in_progress", extra, response=self._response())

    def _where(self):
        return {"item_id": self.item_id, "output_index": len(self.output), "content_index": 0}

    def _open(self, kind):
        self._close()
        self.kind, self.text = kind, ""
        if kind == "reasoning":
            self.item_id = self.ids.item("rs", len(self.output))
            item, part = _reasoning_item(self.item_id, None, "in_progress"), \
                {"type": "reasoning_text", "text": ""}
        else:
            self.item_id = self.ids.item("msg", len(self.output))
            item, part = _message_item(self.item_id, None, "in_progress"), _text_part("")
        self._send("response.output_item.added", output_index=len(self.output), item=item)
        self._send("response.content_part.added", part=part, **self._where())

    def _close(self, status="completed"):
        if self.kind is None:
            return
        w = self._where()
        if self.kind == "reasoning":
            item = _reasoning_item(self.item_id, self.text, status)
            self._send("response.reasoning_text.done", text=self.text, **w)
        else:
            item = _message_item(self.item_id, self.text, status)
            self._send("response.output_text.done", text=self.text, logprobs=[], **w)
        self._send("response.content_part.done", part=item["content"][0], **w)
        self._send("response.output_item.done", output_index=w["output_index"], item=item)
        self.output.append(item)
        self.kind = None

    def delta(self, d, usage=None):
        self.start()
        # timings_per_token: the counts so far go on this piece's last event
        extra = {"timings": formats.timings(usage)} if usage is not None else None
        if "tool_call" in d:
            self._close()
            _, tc = d["tool_call"]
            i = len(self.output)
            fid = self.ids.item("fc", i)
            spaces = self.req.spaces
            self._send("response.output_item.added", output_index=i,
                       item=_call_item(fid, tc, "in_progress", "", spaces))
            self._send("response.function_call_arguments.delta", item_id=fid,
                       output_index=i, delta=tc["arguments"])
            item = _call_item(fid, tc, spaces=spaces)
            self._send("response.function_call_arguments.done", item_id=fid, output_index=i,
                       name=item["name"], arguments=tc["arguments"])
            self.output.append(item)
            return self._send("response.output_item.done", extra, output_index=i, item=item)
        if "reasoning_content" in d:
            if self.kind != "reasoning":
                self._open("reasoning")
            self.text += d["reasoning_content"]
            return self._send("response.reasoning_text.delta", extra,
                              delta=d["reasoning_content"], **self._where())
        if self.kind != "message":
            self._open("message")
        text = d.get("content", "")
        self.text += text
        return self._send("response.output_text.delta", extra, delta=text, logprobs=[],
                          **self._where())

    def finish(self, c):
        if c.finish_reason is FinishReason.CANCELLED:
            # superseded, or the server stopping: cut short, not complete
            self.fail("server_error", "the response was cancelled before it finished (a "
                      "newer request on its slot, or the server shutting down)", c)
            return
        self.start()
        if not self.output and self.kind is None:
            self._open("message")       # a response always has its message
        self._close(_item_status(c))
        self.ended = True
        done = self._response(c)
        # llama-server's final event carries the request's timings
        self._send("response.completed" if done["status"] == "completed"
                   else "response.incomplete", {"timings": formats.timings(c.usage)},
                   response=done)

    def fail(self, code, message, c=None):
        """The terminal event of a response that could not finish: the open item
        closes "incomplete", then response.failed carries the output so far and the
        error (OpenAI's ResponseError: ``code``, ``message``)."""
        self.start()
        self._close("incomplete")
        self.ended = True
        failed = self._response(c)
        failed.update(status="failed", error={"code": code, "message": message})
        self._send("response.failed", response=failed)
