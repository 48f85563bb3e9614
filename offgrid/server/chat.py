"""/v1/chat/completions and /apply-template: chat through the model's own template.

    body --params--> Messages, Tools, tool_choice, output schema
         --worker "prepare_chat"--> prompt tokens, grammar, how to read the reply
         --Service.generate--> the reply, read by the worker's chat layer
                               (deltas while streaming) --formats--> OpenAI JSON

The template, the grammar and the reading of the reply are the worker's
(``chat/prompt.py``, ``chat/reply.py``); this module parses and formats.
"""

from ..protocol import encode_messages, encode_tools
from ..request import FinishReason
from . import formats
from .errors import BadRequest
from .params import (Fields, include_usage_from, chat_messages_from, chat_probs_from,
                     generation_from, id_slot_from, output_schema_from, tool_choice_from,
                     tools_from)

REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")

# -- the request ------------------------------------------------------------------------

def _openai_checks(f):
    if f.int("n", 1) != 1:
        raise BadRequest("'n' must be 1: offgrid returns one choice per request")
    if f.int("best_of", 1) != 1:
        raise BadRequest("'best_of' must be 1: offgrid does not rank several completions")


def _template_kwargs(f):
    kwargs = f.raw("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadRequest("'chat_template_kwargs' must be an object")
    kwargs = dict(kwargs)
    enable_thinking = None
    if "enable_thinking" in kwargs:
        if not isinstance(kwargs["enable_thinking"], bool):
            raise BadRequest("invalid type for \"enable_thinking\" (expected boolean)")
        enable_thinking = kwargs["enable_thinking"]
    effort = f.str("reasoning_effort")
    if effort == "none":
        enable_thinking = False
        kwargs.pop("reasoning_effort", None)
    elif effort:
        kwargs["reasoning_effort"] = effort
    return kwargs, enable_thinking


def _prepare(f, entry, for_generation=True):
    """The worker's "prepare_chat" answer for an OpenAI chat request's fields."""
    messages = chat_messages_from(f.raw("messages"))
    tools = tools_from(f.raw("tools"))
    tool_choice = tool_choice_from(f.raw("tool_choice"), tools)
    reasoning_format = f.str("reasoning_format", "auto")
    if reasoning_format not in REASONING_FORMATS:
        raise BadRequest("'reasoning_format' must be one of %s" % ", ".join(REASONING_FORMATS))
    schema, grammar = output_schema_from(f) if for_generation else (None, None)
    if tools and tool_choice != "none" and f.has("grammar"):
        raise BadRequest("cannot use custom grammar constraints with tools")
    kwargs, enable_thinking = _template_kwargs(f)
    return prepare(entry, messages, tools, tool_choice, schema=schema, grammar=grammar,
                   add_generation_prompt=f.bool("add_generation_prompt", True),
                   enable_thinking=enable_thinking, kwargs=kwargs,
                   parallel_tool_calls=f.raw("parallel_tool_calls"),
                   reasoning_format=reasoning_format, tokenize=for_generation)


def prepare(entry, messages, tools=(), tool_choice="auto", schema=None, grammar=None,
            add_generation_prompt=True, enable_thinking=None, kwargs=None,
            parallel_tool_calls=None, reasoning_format="auto", tokenize=True,
            what="POST /v1/chat/completions"):
    """"prepare_chat" for already-typed Messages and Tools: what every chat dialect shares.

    Returns the worker's plan: ``tokens``, ``grammar``, ``grammar_triggers``,
    ``preserved_tokens``, ``chat`` (how to read the reply) and ``text``.
    """
    return entry.call("prepare_chat", what,
                      messages=encode_messages(messages), tools=encode_tools(list(tools)),
                      tool_choice=tool_choice, schema=schema, grammar=grammar,
                      add_generation_prompt=add_generation_prompt,
                      enable_thinking=enable_thinking, kwargs=kwargs or {},
                      parallel_tool_calls=parallel_tool_calls,
                      reasoning_format=reasoning_format, tokenize=tokenize)


def apply_plan(gen, plan):
    """Set a prepared chat's grammar, its triggers and preserved tokens on GenerationParams."""
    gen.sampling.grammar = plan["grammar"]
    gen.sampling.grammar_triggers = tuple(plan["grammar_triggers"])
    gen.preserved_tokens = frozenset(plan["preserved_tokens"])


def apply_template(h, body):
    """POST /apply-template: the prompt the chat endpoint would evaluate, as llama-server's."""
    f = Fields(body)
    entry = h.service.entry_for(f.raw("model"))
    h.send_json(200, {"prompt": _prepare(f, entry, for_generation=False)["text"]})


def _message(reply):
    msg = {"role": "assistant", "content": reply["content"]}
    if reply["reasoning_content"]:
        msg["reasoning_content"] = reply["reasoning_content"]
    if reply["tool_calls"]:
        if not reply["content"]:
            msg["content"] = None
        msg["tool_calls"] = [_tool_call_json(tc) for tc in reply["tool_calls"]]
    return msg


def _tool_call_json(tc, index=None):
    out = {"id": tc["id"], "type": "function",
           "function": {"name": tc["name"], "arguments": tc["arguments"]}}
    if index is not None:
        out = dict({"index": index}, **out)
    return out


def _finish(c):
    if c.reply and c.reply["tool_calls"] and c.finish_reason is FinishReason.STOP:
        return FinishReason.TOOL_CALLS.value
    return formats.finish_reason(c)


def _delta_json(d):
    if "tool_call" in d:
        index, tc = d["tool_call"]
        return {"tool_calls": [_tool_call_json(tc, index)]}
    return d


def chat_completions(h, body):
    """POST /v1/chat/completions (and /chat/completions)."""
    f = Fields(body)
    svc = h.service
    _openai_checks(f)
    entry = svc.entry_for(f.raw("model"))
    plan = _prepare(f, entry)
    tokens = plan["tokens"]
    gen = generation_from(f, entry.n_vocab, svc.n_predict_default,
                          ("max_completion_tokens", "max_tokens", "n_predict"),
                          svc.sampling_default)
    apply_plan(gen, plan)
    chat_probs_from(f, gen)
    post = gen.post_sampling_probs
    chat = plan["chat"]
    svc.metrics.request("v1/chat/completions")
    stream = f.bool("stream", False)
    id_slot = id_slot_from(f)
    cid, created = formats.new_id("chatcmpl"), formats.now()
    what = "POST /v1/chat/completions"

    if not stream:
        c = svc.generate(entry, tokens, gen, id_slot, sock=h.connection, chat=chat, what=what)
        out = formats.oai_chat(c, entry.id, cid, created, message=_message(c.reply),
                               finish=_finish(c), post=post)
        # "verbose" (default: the server's -v): the native result too, with the prompt text
        if f.bool("verbose", h.verbose):
            out["__verbose"] = formats.native_final(c, entry.id, gen, entry.n_ctx, id_slot,
                                                    plan["text"])
        h.send_json(200, out)
        return

    include_usage = include_usage_from(f)
    es = h.event_stream()
    opened = []

    def open_stream():
        # The role chunk goes out with the first piece, not before generate():
        # a request refused there (503 shutting down, 400 too long) must get
        # its real status, not an error event inside a 200 stream.
        if not opened:
            opened.append(True)
            es.send(formats.oai_chat_chunk({"role": "assistant", "content": None}, entry.id,
                                           cid, created))

    def on_delta(d, probs=None):
        open_stream()
        return es.send(formats.oai_chat_chunk(_delta_json(d), entry.id, cid, created,
                                              probs=probs, post=post))

    c = svc.generate(entry, tokens, gen, id_slot, on_delta, sock=h.connection, chat=chat,
                     what=what)
    open_stream()
    es.send(formats.oai_chat_chunk({}, entry.id, cid, created, _finish(c)))
    if include_usage:
        es.send(formats.oai_usage_chunk(c, "chat.completion.chunk", entry.id, cid, created))
    es.send(b"[DONE]")
    es.end()
