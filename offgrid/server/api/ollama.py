"""Ollama's API (``/api/*``) on offgrid's port: shapes over the same typed requests.

Continue's ``ollama`` provider, Twinny, Open WebUI, LangChain's ChatOllama and
the ``ollama`` libraries speak this dialect.  Its requests become the same
GenerationParams, InfillRequest and Messages as every other endpoint's
(``params``), run through ``Service.generate`` (queueing, supersede, cancel
on disconnect), and come back in Ollama's shapes:

    GET  /api/version, /api/tags, /api/ps     what is served (the models of -m/--fim-model)
    POST /api/show                            one model: template outline, capabilities,
                                              GGUF metadata, parameters
    POST /api/generate                        prompt (through the chat template unless raw),
                                              or prompt + suffix: fill-in-the-middle
    POST /api/chat                            messages, tools, format, think
    POST /api/embed                           embeddings of a string or a list of them
                                              (normalized), ``truncate``, ``dimensions``
    POST /api/embeddings                      the older form: ``prompt`` -> ``embedding``
                                              (not normalized, as Ollama's)
    POST /api/pull                            success at once for a model offgrid serves,
                                              else an error: it never downloads models
    POST /api/push, create, copy, delete      501: offgrid never uploads or writes models

This module has the requests that generate, the embedding ones (through
``embeddings.py``'s worker call) and the refusals;
``ollama_models`` has what is served (tags, ps, show, version).

Streams are NDJSON (``stream`` defaults to true, as in Ollama): one object a
line, the last with ``done: true``, the reason and the counts, durations in
nanoseconds.  Errors are ``{"error": "..."}`` (the routes' dialect, see
``errors.error_body``); one that comes after the first line is the stream's
last line.

What differs from Ollama, on purpose:
  * a model name that matches no loaded model is served by the default one
    (as on /v1/*), so an editor configured with ``qwen2.5-coder:1.5b`` works;
  * ``options.num_ctx`` is read and ignored: each session's context is fixed
    at start (``-c``); /api/show says how large, and a prompt that does not
    fit is refused with 400;
  * ``suffix`` always means fill-in-the-middle, with ``raw`` too (Ollama
    drops the suffix in raw mode; editors that send both mean FIM);
  * /api/chat also takes ``tool_choice`` ("auto", "none", "required" or a
    function's name, as on /v1/chat/completions): Ollama has no way to make
    a model call a tool, and small models need one;
  * both also take ``id_slot`` (as on /completion): a newer request with the
    same one cancels the older, as editors need while typing;
  * (not a difference) ``keep_alive`` keeps the model loaded that long after
    the request, as Ollama's does: 0 unloads it as soon as the request ends,
    a negative value never (``Service.request_scope``, ``models/shelf.py``);
  * ``template`` (a Go template) and ``context`` (deprecated token memory)
    are refused with 400 rather than silently dropped;
  * (not a difference) ``images`` (base64) go before the message's text, as
    Ollama puts them; a model served without --mmproj answers them with a
    400 (server/api/media.py).
"""

import array
import datetime
import json
import time

from ... import jsonlimit
from ...request import MAX_MEDIA, FinishReason, InfillRequest, Message
from . import embeddings, media, openai_chat as chat, pipeline
from ..httpd.httperrors import BadRequest, NotImplementedByModel
from .chat_fields import chat_messages_from, tool_choice_from, tools_from
from .fields import Fields, generation_from, id_slot_from, output_schema_from
from .pipeline import Format, Generation, Prompt
from .prompts import infill_tokens

# Ollama's options -> how to read them -> offgrid's field (params.generation_from).
_OPTIONS = (
    ("num_predict", "int", "n_predict"),
    ("temperature", "float", "temperature"),
    ("top_k", "int", "top_k"),
    ("top_p", "float", "top_p"),
    ("min_p", "float", "min_p"),
    ("typical_p", "float", "typical_p"),
    ("repeat_penalty", "float", "repeat_penalty"),
    ("repeat_last_n", "int", "repeat_last_n"),
    ("presence_penalty", "float", "presence_penalty"),
    ("frequency_penalty", "float", "frequency_penalty"),
    ("seed", "int", "seed"),
)

THINK_LEVELS = ("low", "medium", "high", "max")


# -- the shared pieces (ollama_models uses the public ones) ---------------------------------------------------------------

def _now():
    """RFC 3339 in UTC, as Ollama's ``created_at``."""
    return rfc3339(time.time())


def rfc3339(t):
    """A POSIX time as Ollama writes times: RFC 3339, UTC; one past the calendar (a
    file's odd mtime, a far expiry) is its last second rather than an error."""
    try:
        d = datetime.datetime.fromtimestamp(t, datetime.timezone.utc)
    except (OverflowError, ValueError, OSError):
        return "9999-12-31T23:59:59Z" if t > 0 else "0001-01-01T00:00:00Z"
    return d.isoformat().replace("+00:00", "Z")


def model_name(f, required=True):
    """The model a request names (``model``, or the older ``name`` Continue still sends)."""
    name = f.str("model") or f.str("name")
    if not name and required:
        raise BadRequest("model is required")
    return name or ""


def entry_named(svc, name):
    """The entry for an Ollama name; ``x:latest`` is ``x``, an unknown name the default."""
    if name.endswith(":latest"):
        bare = name[:-len(":latest")]
        if any(e.answers_to(bare) for e in svc.entries):
            name = bare
    return svc.entry_for(name)


def _generation(f, entry, svc):
    """GenerationParams from Ollama's ``options`` (unknown and ignored ones pass)."""
    o = Fields(f.raw("options", {}), "'options' value")
    mapped = {}
    for name, kind, ours in _OPTIONS:
        v = getattr(o, kind)(name, None)
        if v is not None:
            mapped[ours] = v
    if mapped.get("n_predict", 0) < -1:
        mapped["n_predict"] = -1        # Ollama's -2, "fill the context", is offgrid's -1
    mapped["stop"] = o.stop_list("stop")
    # read for its type only: the session's context was fixed at start (see the docstring)
    o.int("num_ctx", None, lo=0)
    return generation_from(Fields(mapped), entry.n_vocab, svc.generation_default,
                           sampling_default=entry.sampling)


def _output_schema(f):
    """(json_schema, grammar) from Ollama's ``format``: "json" or a JSON schema."""
    fmt = f.raw("format")
    if fmt is None or fmt == "":
        schema = None
    elif fmt == "json":
        schema = {"type": "object"}
    elif isinstance(fmt, dict):
        schema = fmt
    else:
        raise BadRequest("invalid format: 'format' must be \"json\" or a JSON schema object")
    return output_schema_from(Fields({"json_schema": schema}))


def _thinking(f):
    """(enable_thinking, template kwargs) from ``think``: a bool or a level."""
    v = f.raw("think")
    if v is None or isinstance(v, bool):
        return v, {}
    if v in THINK_LEVELS:
        return True, {"reasoning_effort": "high" if v == "max" else v}
    raise BadRequest("'think' must be true, false or one of %s"
                     % ", ".join('"%s"' % t for t in THINK_LEVELS))


def _check_keep_alive(f):
    v = f.raw("keep_alive")
    if v is not None and (not isinstance(v, (int, float, str)) or isinstance(v, bool)):
        raise BadRequest("'keep_alive' must be a duration (\"5m\") or a number of seconds")


def _done_reason(c):
    if c.finish_reason is FinishReason.LENGTH:
        return "length"
    if c.finish_reason is FinishReason.CANCELLED:
        return "cancelled"
    return "stop"       # Ollama says "stop" after tool calls too


def _final(name, c, started, **fields):
    """The last object of a generation: done, why, and Ollama's counts (nanoseconds)."""
    u = c.usage
    out = {"model": name, "created_at": _now()}
    out.update(fields)
    out.update({
        "done": True, "done_reason": _done_reason(c),
        "total_duration": int((time.monotonic() - started) * 1e9),
        "load_duration": 0,         # the model was loaded when offgrid started
        "prompt_eval_count": u.prompt_tokens,
        "prompt_eval_duration": int(u.prompt_ms * 1e6),
        "eval_count": u.completion_tokens,
        "eval_duration": int(u.generation_ms * 1e6),
    })
    return out


def _loaded(name, **fields):
    """The answer to an empty request: Ollama's "load the model" call."""
    out = {"model": name, "created_at": _now()}
    out.update(fields)
    out.update(done=True, done_reason="load")
    return out


# -- /api/generate -------------------------------------------------------------------

def generate(h, body):
    """POST /api/generate: a prompt, through the chat template unless raw, or FIM with suffix."""
    started = time.monotonic()
    f = Fields(body)
    svc = h.service
    name = model_name(f)
    prompt = f.str("prompt", "")
    suffix = f.str("suffix", "")
    system = f.str("system", "")
    raw = f.bool("raw", False)
    _check_keep_alive(f)
    if f.str("template"):
        raise BadRequest("'template' is not supported: offgrid renders the model's own chat "
                         "template; send \"raw\": true with a prompt already formatted")
    if f.raw("context"):
        raise BadRequest("'context' is not supported: send the conversation to /api/chat")
    images = _images(f.raw("images"), "images")
    if images and suffix:
        raise BadRequest("'images' cannot go with 'suffix' (fill-in-the-middle is text)")
    # as Ollama: a message's images go before its text
    prompt = media.MARKER * len(images) + prompt
    if raw and system:
        raise BadRequest("raw mode does not support template, system, or context")
    schema, grammar = _output_schema(f)
    enable_thinking, kwargs = _thinking(f)
    entry = entry_named(svc, name)
    if not prompt and not suffix:
        h.send_json(200, _loaded(name, response=""))
        return
    what = "POST /api/generate"
    plan = None
    if suffix:
        if not entry.has_fim and svc.fim is not None:
            entry = svc.fim         # --fim-model, or the default model (none on a router)
        if not entry.has_fim:
            raise BadRequest("%s does not support insert: it has no fill-in-the-middle tokens"
                             % json.dumps(name))
        gen = _generation(f, entry, svc)
        gen.cache_reuse = svc.cache_reuse
        req = InfillRequest(input_prefix=prompt, input_suffix=suffix)
        tokens = infill_tokens(Fields({"json_schema": schema}), entry, req, gen, what)
    elif raw:
        gen = _generation(f, entry, svc)
        out = entry.call("prepare_completion", what, parts=[prompt], add_special=True,
                         schema=schema, grammar=grammar, **({"media": images} if images else {}))
        gen.sampling.grammar = out["grammar"]
        tokens = out["tokens"]
    else:
        # as Ollama: the prompt is one user message (after the system one) in the template
        messages = ([Message("system", system)] if system else []) \
            + [Message("user", prompt, media=images)]
        plan = chat.prepare(entry, messages, schema=schema, grammar=grammar,
                            enable_thinking=enable_thinking, kwargs=kwargs, what=what)
        gen = _generation(f, entry, svc)
        chat.apply_plan(gen, plan)
        tokens = plan["tokens"]
    g = Generation(entry, gen, [Prompt(tokens)], "api/generate", what, stream=f.bool("stream", True),
                   id_slot=id_slot_from(f), chat=plan["chat"] if plan is not None else None)
    pipeline.run(h, g, GenerateFormat(name, started))


class _OllamaFormat(Format):
    """Ollama's NDJSON lines: each with the model and its time, the last ``done``."""
    stream_kind = "ndjson"
    keepalive = None        # every line is a JSON object its clients parse: none to spare

    def __init__(self, name, started):
        self.name, self.started = name, started


class GenerateFormat(_OllamaFormat):
    """/api/generate's ``response`` lines (``thinking`` for reasoning)."""

    def piece(self, out, job, x, probs):
        if not isinstance(x, dict):
            line = {"response": x}
        elif "content" in x:
            line = {"response": x["content"]}
        elif "reasoning_content" in x:
            line = {"response": "", "thinking": x["reasoning_content"]}
        else:
            return True
        return out.send(dict({"model": self.name, "created_at": _now()}, done=False, **line))

    def choice_end(self, out, job, c):
        out.send(_final(self.name, c, self.started, response=""))

    def body(self, jobs, done):
        c = done[0]
        fields = {"response": c.text}
        if c.reply is not None:
            fields["response"] = c.reply["content"]
            if c.reply["reasoning_content"]:
                fields["thinking"] = c.reply["reasoning_content"]
        return _final(self.name, c, self.started, **fields)


# -- /api/chat -----------------------------------------------------------------------

def _images(v, where):
    """Ollama's ``images``: an array of base64 strings (each checked), or none."""
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise BadRequest("'%s' must be an array of base64 strings" % where)
    if len(v) > MAX_MEDIA:
        raise BadRequest("a request may hold at most %d images, not %d" % (MAX_MEDIA, len(v)))
    return [media.checked_b64(x, "%s[%d]" % (where, j)) for j, x in enumerate(v)]


def _messages_from(v):
    """Ollama's messages as Messages (through the OpenAI reader's checks)."""
    if not isinstance(v, list):
        raise BadRequest("'messages' must be an array")
    out, files = [], []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise BadRequest("messages[%d] must be an object" % i)
        images = _images(m.get("images"), "messages[%d].images" % i)
        files.append(images)
        o = {"role": m.get("role"), "content": m.get("content")}
        if o["content"] is None:
            o["content"] = ""           # Ollama's content may be absent (a tool call only)
        elif not isinstance(o["content"], str):
            raise BadRequest("messages[%d].content must be a string" % i)
        # as Ollama: a message's images go before its text
        o["content"] = media.MARKER * len(images) + o["content"]
        for ours, theirs in (("reasoning_content", "thinking"), ("name", "tool_name"),
                             ("tool_call_id", "tool_call_id")):
            if m.get(theirs) is not None:
                o[ours] = m[theirs]
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise BadRequest("messages[%d].tool_calls must be an array" % i)
            o["tool_calls"] = [dict(tc, type="function") if isinstance(tc, dict) else tc
                               for tc in calls]
        out.append(o)
    messages = chat_messages_from(out)      # one Message per item, in order
    for msg, images in zip(messages, files):
        msg.media = images
    media.count_check(messages)
    return messages


def _tools_from(v):
    """Ollama's tools: OpenAI's, with ``type`` optional."""
    if isinstance(v, list):
        v = [dict(t, type=t.get("type") or "function") if isinstance(t, dict) else t
             for t in v]
    return tools_from(v)


def _arguments(text):
    """A tool call's arguments as an object (Ollama's shape), from the reply's JSON text."""
    try:
        args = jsonlimit.loads(text or "{}")
    except ValueError:
        args = None
    return args if isinstance(args, dict) else {}


def _tool_calls(calls):
    return [{"id": tc["id"], "function": {"index": i, "name": tc["name"],
                                          "arguments": _arguments(tc["arguments"])}}
            for i, tc in enumerate(calls)]


def _message(reply):
    msg = {"role": "assistant", "content": reply["content"]}
    if reply["reasoning_content"]:
        msg["thinking"] = reply["reasoning_content"]
    if reply["tool_calls"]:
        msg["tool_calls"] = _tool_calls(reply["tool_calls"])
    return msg


def chat_(h, body):
    """POST /api/chat: messages, tools, format and think, through the model's template."""
    started = time.monotonic()
    f = Fields(body)
    svc = h.service
    name = model_name(f)
    _check_keep_alive(f)
    schema, grammar = _output_schema(f)
    enable_thinking, kwargs = _thinking(f)
    entry = entry_named(svc, name)
    if not f.raw("messages"):
        if f.has("messages") and not isinstance(f.raw("messages"), list):
            raise BadRequest("'messages' must be an array")
        h.send_json(200, _loaded(name, message={"role": "assistant", "content": ""}))
        return
    messages = _messages_from(f.raw("messages"))
    tools = _tools_from(f.raw("tools"))
    # not Ollama's (it has no way to force a call): offgrid's extension, OpenAI's values
    tool_choice = tool_choice_from(f.raw("tool_choice"), tools)
    what = "POST /api/chat"
    plan = chat.prepare(entry, messages, tools, tool_choice, schema=schema, grammar=grammar,
                        enable_thinking=enable_thinking, kwargs=kwargs, what=what)
    gen = _generation(f, entry, svc)
    chat.apply_plan(gen, plan)
    g = Generation(entry, gen, [Prompt(plan["tokens"])], "api/chat", what,
                   stream=f.bool("stream", True), id_slot=id_slot_from(f), chat=plan["chat"])
    pipeline.run(h, g, ChatFormat(name, started))


class ChatFormat(_OllamaFormat):
    """/api/chat's ``message`` lines; tool calls go out whole, from the parsed reply."""

    def line(self, message):
        return {"model": self.name, "created_at": _now(), "message": message, "done": False}

    def piece(self, out, job, d, probs):
        if "content" in d:
            return out.send(self.line({"role": "assistant", "content": d["content"]}))
        if "reasoning_content" in d:
            return out.send(self.line({"role": "assistant", "content": "",
                                       "thinking": d["reasoning_content"]}))
        return True     # tool calls go out whole, from the parsed reply, at the end

    def choice_end(self, out, job, c):
        if c.reply and c.reply["tool_calls"]:
            out.send(self.line({"role": "assistant", "content": "",
                                "tool_calls": _tool_calls(c.reply["tool_calls"])}))
        out.send(_final(self.name, c, self.started,
                        message={"role": "assistant", "content": ""}))

    def body(self, jobs, done):
        return _final(self.name, done[0], self.started, message=_message(done[0].reply))


# -- /api/embed, /api/embeddings ----------------------------------------------------

def _embed_entry(f, svc):
    name = model_name(f)
    _check_keep_alive(f)
    Fields(f.raw("options", {}), "'options' value")     # accepted: nothing in it applies
    entry = entry_named(svc, name)
    embeddings.check_served(svc, entry)
    if entry.info.pooling == "none":
        raise BadRequest("the server pools none (a vector per token); Ollama's embeddings "
                         "are one vector per input: start it with --pooling last, mean or cls")
    return name, entry


def embed(h, body):
    """POST /api/embed: ``input`` a string or a list of strings -> ``embeddings``, each of
    unit length; ``truncate`` (default true) cuts an input to what the context takes."""
    started = time.monotonic()
    f = Fields(body)
    svc = h.service
    name, entry = _embed_entry(f, svc)
    v = f.raw("input", "")
    if isinstance(v, str):
        texts = [v] if v else []
    elif isinstance(v, list) and all(isinstance(t, str) for t in v):
        texts = v
    else:
        raise BadRequest("invalid input type: 'input' must be a string or a list of strings")
    if len(texts) > embeddings.MAX_INPUTS:
        raise BadRequest("'input' has %d strings; at most %d are allowed in one request"
                         % (len(texts), embeddings.MAX_INPUTS))
    truncate = f.bool("truncate", True)
    dims = f.int("dimensions", 0, lo=0)
    if not texts:
        # as Ollama: nothing to embed loads the model and answers empty
        h.send_json(200, {"model": name, "embeddings": []})
        return
    svc.metrics.request("api/embed")
    vectors, counts, _ = embeddings.embed(h, entry, [[t] for t in texts], "POST /api/embed",
                                          truncate=truncate)
    if 0 < dims < entry.info.n_embd_out:
        # Ollama's dimensions: the leading components, made unit length again
        vectors = [_unit(v[:dims]) for v in vectors]
    h.send_json(200, {
        "model": name, "embeddings": [embeddings.floats(v) for v in vectors],
        "total_duration": int((time.monotonic() - started) * 1e9), "load_duration": 0,
        "prompt_eval_count": sum(counts)})


def _unit(vec):
    size = sum(x * x for x in vec) ** 0.5
    k = 1.0 / size if size > 0 else 0.0
    return array.array("f", [x * k for x in vec])


def embeddings_(h, body):
    """POST /api/embeddings, Ollama's older call: ``prompt`` -> ``embedding``, as the model
    gives it (not normalized: Ollama normalizes only /api/embed's)."""
    f = Fields(body)
    svc = h.service
    _, entry = _embed_entry(f, svc)
    prompt = f.str("prompt", "")
    if not prompt:
        h.send_json(200, {"embedding": []})
        return
    svc.metrics.request("api/embeddings")
    vectors, _, _ = embeddings.embed(h, entry, [[prompt]], "POST /api/embeddings",
                                     normalize=-1, truncate=True)
    h.send_json(200, {"embedding": embeddings.floats(vectors[0])})


# -- what offgrid does not do --------------------------------------------------------


def manage(h, _body):
    raise NotImplementedByModel(
        "offgrid serves the models given on its command line (-m, --fim-model); it never "
        "downloads, uploads, creates, copies or deletes models")
