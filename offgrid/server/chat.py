"""/v1/chat/completions and /apply-template: chat through the model's own template.

    body --params--> Messages, Tools, tool_choice, output schema
         --ChatTemplate.apply--> prompt text, ReplyFormat, tool-call grammar
         --Service.generate--> text (pieces while streaming)
         --chatreply--> content, reasoning_content, tool_calls --formats--> OpenAI JSON

Which template a model uses is settled once per model (``chat.select``).

Output constraints become a GBNF grammar for libllama's grammar sampler:
``tool_choice`` "required" or a named function (a call in the template's
syntax, arguments per the tool's schema), ``response_format`` json_object /
json_schema and llama.cpp's ``json_schema`` (chat.jsonschema), or a
``grammar`` given as is.  With ``tool_choice`` "auto" the call grammar is
lazy, as llama-server's: text is free until the model writes the template's
call opener (``<tool_call>``, ``[TOOL_CALLS]``, gpt-oss's ``to=functions.``),
and from there only a well-formed call follows.  A grammar libllama rejects is a 400 before anything is
generated.
"""

from ..chat import template as chat_engine
from ..chat.select import template_for
from ..chat.reply import ReplyStream, parse_reply
from ..chat.jsonschema import schema_to_grammar
from ..engine.sampling import check_grammar
from ..request import FinishReason
from . import formats
from .errors import BadRequest
from .params import (Fields, include_usage_from, chat_messages_from, generation_from, id_slot_from,
                     output_schema_from, tool_choice_from, tools_from)

# -- the request ------------------------------------------------------------------------

def _openai_checks(f):
    if f.int("n", 1) != 1:
        raise BadRequest("'n' must be 1: offgrid returns one choice per request")
    if f.int("best_of", 1) != 1:
        raise BadRequest("'best_of' must be 1: offgrid does not rank several completions")
    lp = f.raw("logprobs")
    if lp not in (None, False, 0):
        raise BadRequest("'logprobs' is not supported by offgrid yet")


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


def _prompt_from(f, entry, for_generation=True):
    """(ChatPrompt, tools, tool_choice, schema, grammar) of a chat request."""
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
    add_gp = f.bool("add_generation_prompt", True)
    tmpl = template_for(entry)
    try:
        prompt = tmpl.apply(messages, tools, add_generation_prompt=add_gp,
                            enable_thinking=enable_thinking, kwargs=kwargs,
                            json_schema=schema, tool_choice=tool_choice,
                            parallel_tool_calls=f.raw("parallel_tool_calls"),
                            reasoning_format=reasoning_format)
    except chat_engine.ChatTemplateError as e:
        raise BadRequest(str(e))
    return prompt, tools, tool_choice, schema, grammar


def apply_template(h, body):
    """POST /apply-template: the prompt the chat endpoint would evaluate, as llama-server's."""
    f = Fields(body)
    entry = h.service.entry_for(f.raw("model"))
    prompt = _prompt_from(f, entry, for_generation=False)[0]
    h.send_json(200, {"prompt": prompt.text})


def _grammar_of(prompt, schema, grammar):
    """(GBNF or None, lazy triggers) constraining the reply.

    A response format wins over tool_choice "auto"'s lazy call grammar (the
    reply is then the format's JSON), but not over a required call.
    """
    required_call = prompt.grammar is not None and not prompt.grammar_triggers
    if required_call and schema is not None:
        raise BadRequest("a required tool call and a response format cannot be combined")
    if schema is not None:
        return schema_to_grammar(schema), ()
    if prompt.grammar is not None:
        return prompt.grammar, prompt.grammar_triggers
    return grammar, ()


def _preserved_tokens(model, fmt):
    """Control tokens the reply must show as text for the markers to be read."""
    markers = [m for pair in fmt.reasoning_markers for m in pair]
    markers += ["<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]",
                "[CALL_ID]"]
    if fmt.tool_syntax == "harmony":
        markers += ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>"]
    out = set()
    for text in markers:
        toks = model.tokenize(text, add_special=False, parse_special=True)
        if len(toks) == 1 and not model.token_bytes(toks[0]):
            out.add(toks[0])
    return frozenset(out)


def _message(reply, c, id_length):
    msg = {"role": "assistant", "content": reply.content}
    if reply.reasoning_content:
        msg["reasoning_content"] = reply.reasoning_content
    if reply.tool_calls:
        if not reply.content:
            msg["content"] = None
        msg["tool_calls"] = [_tool_call_json(tc, id_length) for tc in reply.tool_calls]
    return msg


def _tool_call_json(tc, id_length, index=None):
    if not tc.id:
        tc.id = chat_engine.new_tool_call_id(id_length)
    out = {"id": tc.id, "type": "function",
           "function": {"name": tc.name, "arguments": tc.arguments}}
    if index is not None:
        out = dict({"index": index}, **out)
    return out


def _finish(c, reply):
    if reply.tool_calls and c.finish_reason is FinishReason.STOP:
        return FinishReason.TOOL_CALLS.value
    return formats.finish_reason(c)


def _delta_json(d, id_length):
    if d.reasoning_content is not None:
        return {"reasoning_content": d.reasoning_content}
    if d.content is not None:
        return {"content": d.content}
    index, tc = d.tool_call
    return {"tool_calls": [_tool_call_json(tc, id_length, index)]}


def chat_completions(h, body):
    """POST /v1/chat/completions (and /chat/completions)."""
    f = Fields(body)
    svc = h.service
    _openai_checks(f)
    entry = svc.entry_for(f.raw("model"))
    model = entry.model
    prompt, tools, tool_choice, schema, grammar = _prompt_from(f, entry)
    tokens = model.tokenize(prompt.text, add_special=True, parse_special=True)
    gen = generation_from(f, model.n_vocab, svc.n_predict_default,
                          ("max_completion_tokens", "max_tokens", "n_predict"))
    gen.sampling.grammar, gen.sampling.grammar_triggers = _grammar_of(prompt, schema, grammar)
    if gen.sampling.grammar is not None:
        check_grammar(model, gen.sampling.grammar, gen.sampling.grammar_triggers)
    fmt = prompt.reply_format
    gen.preserved_tokens = _preserved_tokens(model, fmt)
    id_length = 9 if getattr(template_for(entry), "tool_syntax", "") == "mistral" else 32
    svc.metrics.request("v1/chat/completions")
    stream = f.bool("stream", False)
    id_slot = id_slot_from(f)
    cid, created = formats.new_id("chatcmpl"), formats.now()

    if not stream:
        c = svc.generate(entry, tokens, gen, id_slot, sock=h.connection)
        reply = parse_reply(c.text, fmt)
        h.send_json(200, formats.oai_chat(c, entry.id, cid, created,
                                          message=_message(reply, c, id_length),
                                          finish=_finish(c, reply)))
        return

    include_usage = include_usage_from(f)
    es = h.event_stream()
    rs = ReplyStream(fmt, id_length)
    opened = []

    def open_stream():
        # The role chunk goes out with the first piece, not before generate():
        # a request refused there (503 shutting down, 400 too long) must get
        # its real status, not an error event inside a 200 stream.
        if not opened:
            opened.append(True)
            es.send(formats.oai_chat_chunk({"role": "assistant", "content": None}, entry.id,
                                           cid, created))

    def send(deltas):
        open_stream()
        for d in deltas:
            chunk = formats.oai_chat_chunk(_delta_json(d, id_length), entry.id, cid, created)
            if es.send(chunk) is False:
                return False
        return True

    def on_piece(text):
        return send(rs.add(text))

    c = svc.generate(entry, tokens, gen, id_slot, on_piece, sock=h.connection)
    open_stream()
    deltas, reply = rs.finish()
    if c.finish_reason is not FinishReason.CANCELLED:
        send(deltas)
    es.send(formats.oai_chat_chunk({}, entry.id, cid, created, _finish(c, reply)))
    if include_usage:
        es.send(formats.oai_usage_chunk(c, "chat.completion.chunk", entry.id, cid, created))
    es.send(b"[DONE]")
    es.end()
