"""/v1/chat/completions and /apply-template: chat through the model's own template.

    body --params--> Messages, Tools, tool_choice, output schema
         --worker "prepare_chat"--> prompt tokens, grammar, how to read the reply
         --Service.generate--> the reply, read by the worker's chat layer
                               (deltas while streaming) --formats--> OpenAI JSON

The template, the grammar and the reading of the reply are the worker's
(``chat/prompt.py``, ``chat/reply.py``); this module parses and formats.
"""

import functools

from ..protocol import encode_messages, encode_tools
from ..request import FinishReason, PromptProgress
from . import budget, formats
from .errors import BadRequest
from .params import (MAX_N_CMPL, Fields, include_usage_from, chat_messages_from,
                     chat_probs_from, generation_from, id_slot_from, output_schema_from,
                     text_tokenizer, tool_choice_from, tools_from)

REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")

# -- the request ------------------------------------------------------------------------

def _n_choices(f):
    """OpenAI's ``n`` (llama-server's ``n_cmpl``): choices to generate, at once where they can."""
    if f.int("best_of", 1) != 1:
        raise BadRequest("'best_of' must be 1: offgrid does not rank several completions")
    name = "n" if f.has("n") else "n_cmpl"
    return f.int(name, 1, lo=1, hi=MAX_N_CMPL)


def _continuation(f, messages):
    """llama-server's checks of ``continue_final_message`` and assistant prefill.

    A last assistant message is continued (prefill); two at the end, both a
    continuation and a generation prompt, or continuing a tool call are 400s.
    """
    cfm = f.raw("continue_final_message")
    if cfm is not None and not isinstance(cfm, (bool, str)):
        raise BadRequest("'continue_final_message' must be true or false")
    last_is_assistant = bool(messages) and messages[-1].role == "assistant"
    agp = f.bool("add_generation_prompt", True)
    if not cfm and last_is_assistant:
        if len(messages) >= 2 and messages[-2].role == "assistant":
            raise BadRequest("Cannot have 2 or more assistant messages at the end of the list.")
        return False        # the prefill: continued, no generation prompt
    if cfm and agp:
        raise BadRequest("Cannot set both add_generation_prompt and continue_final_message "
                         "to true.")
    if cfm and last_is_assistant and messages[-1].tool_calls:
        raise BadRequest("Cannot continue an assistant message that contains tool calls.")
    return agp


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
    add_generation_prompt = _continuation(f, messages)
    tools = tools_from(f.raw("tools"))
    tool_choice = tool_choice_from(f.raw("tool_choice"), tools)
    reasoning_format = f.str("reasoning_format")       # None: the server's --reasoning-format
    if reasoning_format is not None and reasoning_format not in REASONING_FORMATS:
        raise BadRequest("'reasoning_format' must be one of %s" % ", ".join(REASONING_FORMATS))
    schema, grammar = output_schema_from(f) if for_generation else (None, None)
    if tools and tool_choice != "none" and f.has("grammar"):
        raise BadRequest("cannot use custom grammar constraints with tools")
    kwargs, enable_thinking = _template_kwargs(f)
    return prepare(entry, messages, tools, tool_choice, schema=schema, grammar=grammar,
                   add_generation_prompt=add_generation_prompt,
                   enable_thinking=enable_thinking, kwargs=kwargs,
                   parallel_tool_calls=f.raw("parallel_tool_calls"),
                   reasoning_format=reasoning_format, tokenize=for_generation)


def prepare(entry, messages, tools=(), tool_choice="auto", schema=None, grammar=None,
            add_generation_prompt=True, enable_thinking=None, kwargs=None,
            parallel_tool_calls=None, reasoning_format=None, tokenize=True,
            what="POST /v1/chat/completions"):
    """"prepare_chat" for already-typed Messages and Tools: what every chat dialect shares.

    Returns the worker's plan: ``tokens``, ``grammar``, ``grammar_triggers``,
    ``preserved_tokens``, ``chat`` (how to read the reply) and ``text``.
    ``enable_thinking`` and ``reasoning_format`` None: the server's defaults
    (``--reasoning``, ``--reasoning-format``), which the worker holds.
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


def input_tokens(h, body):
    """POST /chat/completions/input_tokens: the prompt's length through the template, as
    llama-server's (a chat request's body; nothing is generated)."""
    f = Fields(body)
    entry = h.service.entry_for(f.raw("model"))
    plan = _prepare(f, entry)
    h.send_json(200, {"input_tokens": len(plan["tokens"]), "object": "response.input_tokens"})


def chat_completions(h, body):
    """POST /v1/chat/completions (and /chat/completions)."""
    f = Fields(body)
    svc = h.service
    n = _n_choices(f)
    entry = svc.entry_for(f.raw("model"))
    plan = _prepare(f, entry)
    tokens = plan["tokens"]
    gen = generation_from(f, entry.n_vocab, svc.n_predict_default,
                          ("max_completion_tokens", "max_tokens", "n_predict"),
                          svc.sampling_default, tokenize=text_tokenizer(entry))
    apply_plan(gen, plan)
    chat_probs_from(f, gen)
    post = gen.post_sampling_probs
    chat = plan["chat"]
    svc.metrics.request("v1/chat/completions")
    stream = f.bool("stream", False)
    budget.check_probs(gen, n, entry.n_ctx, stream)
    gen.return_progress = stream and f.bool("return_progress", False)
    timings_per_token = f.bool("timings_per_token", False)
    id_slot = id_slot_from(f)
    cid, created = formats.new_id("chatcmpl"), formats.now()
    what = "POST /v1/chat/completions"
    base_seed = gen.sampling.seed

    def gen_for(index):
        # each further choice its own seed, as llama-server's child tasks; its
        # own copy, since choices run at once (Service.run_choices)
        g = gen.copy()
        if base_seed is not None:
            g.sampling.seed = base_seed + index
        return g

    if not stream:
        done = svc.run_choices(entry, [
            functools.partial(svc.generate, entry, tokens, gen_for(index), id_slot,
                              sock=h.connection, chat=chat, what=what)
            for index in range(n)], id_slot)
        out = formats.oai_chat(done[0], entry.id, cid, created, message=_message(done[0].reply),
                               finish=_finish(done[0]), post=post)
        for index, c in enumerate(done[1:], 1):
            out["choices"].append(formats.oai_chat_choice(c, index, _message(c.reply),
                                                          _finish(c), post))
        if len(done) > 1:
            out["usage"] = formats.usage_of_choices(done)
        # "verbose" (default: the server's -v): the native result too, with the prompt text
        if f.bool("verbose", h.verbose):
            out["__verbose"] = formats.native_final(done[0], entry.id, gen, entry.n_ctx, id_slot,
                                                    plan["text"])
        h.send_json(200, out)
        return

    include_usage = include_usage_from(f)
    es = h.event_stream()

    def choice(index):
        opened = []

        def open_stream(index=index, opened=opened):
            # The role chunk goes out with the first piece, not before generate():
            # a request refused there (503 shutting down, 400 too long) must get
            # its real status, not an error event inside a 200 stream.
            if not opened:
                opened.append(True)
                es.send(formats.oai_chat_chunk({"role": "assistant", "content": None}, entry.id,
                                               cid, created, index=index))

        def on_delta(d, probs=None, index=index, opened=opened):
            if isinstance(d, PromptProgress):
                # llama-server's progress chunk: the role delta, with prompt_progress
                opened.append(True)
                chunk = formats.oai_chat_chunk({"role": "assistant", "content": None}, entry.id,
                                               cid, created, index=index)
                chunk["prompt_progress"] = formats.progress_json(d)
                if timings_per_token:
                    chunk["timings"] = formats.progress_timings(d)
                return es.send(chunk)
            open_stream()
            return es.send(formats.oai_chat_chunk(_delta_json(d), entry.id, cid, created,
                                                  probs=probs, post=post, index=index))

        c = svc.generate(entry, tokens, gen_for(index), id_slot, on_delta, sock=h.connection,
                         chat=chat, what=what)
        open_stream()
        es.send(formats.oai_chat_chunk({}, entry.id, cid, created, _finish(c), index=index))
        return c

    done = svc.run_choices(entry, [functools.partial(choice, i) for i in range(n)], id_slot)
    if include_usage:
        chunk = formats.oai_usage_chunk(done[0], "chat.completion.chunk", entry.id, cid, created)
        if len(done) > 1:
            chunk["usage"] = formats.usage_of_choices(done)
        es.send(chunk)
    es.send(b"[DONE]")
    es.end()
