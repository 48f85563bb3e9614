"""/v1/chat/completions and /apply-template: chat through the model's own template.

    body --params--> Messages, Tools, tool_choice, output schema
         --worker "prepare_chat"--> prompt tokens, grammar, how to read the reply
         --Service.generate--> the reply, read by the worker's chat layer
                               (deltas while streaming) --formats--> OpenAI JSON

The template, the grammar and the reading of the reply are the worker's
(``chat/prompt.py``, ``chat/reply.py``); this module parses and formats.
"""

from ...protocol import encode_messages, encode_tools
from ...request import REASONING_FORMATS, FinishReason
from ..httpd.httperrors import BadRequest
from . import formats, pipeline
from .chat_fields import chat_messages_from, tool_choice_from, tools_from
from .fields import (Fields, include_usage_from, chat_probs_from, choices_from, generation_from,
                     id_slot_from, output_schema_from, reasoning_budget_from, text_tokenizer)
from .pipeline import Format, Generation, Prompt


# -- the request ------------------------------------------------------------------------

# continue_final_message's strings (llama.cpp's common_chat_continuation_parse):
# the part of the last message that goes on; ``true``: by the message
_CONTINUED_PARTS = {"content": "content", "reasoning_content": "reasoning"}


def _continuation(f, messages):
    """(add_generation_prompt, continuation): llama-server's checks of
    ``continue_final_message`` and assistant prefill.

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
        return False, None  # the prefill: continued, no generation prompt
    if cfm and agp:
        raise BadRequest("Cannot set both add_generation_prompt and continue_final_message "
                         "to true.")
    if cfm and last_is_assistant and messages[-1].tool_calls:
        raise BadRequest("Cannot continue an assistant message that contains tool calls.")
    return agp, _CONTINUED_PARTS.get(cfm) if isinstance(cfm, str) else None


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
    add_generation_prompt, continuation = _continuation(f, messages)
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
                   reasoning_format=reasoning_format, tokenize=for_generation,
                   continuation=continuation)


def prepare(entry, messages, tools=(), tool_choice="auto", schema=None, grammar=None,
            add_generation_prompt=True, enable_thinking=None, kwargs=None,
            parallel_tool_calls=None, reasoning_format=None, tokenize=True,
            what="POST /v1/chat/completions", continuation=None):
    """"prepare_chat" for already-typed Messages and Tools: what every chat dialect shares.

    Returns the worker's plan: ``tokens``, ``grammar``, ``grammar_triggers``,
    ``preserved_tokens``, ``chat`` (how to read the reply) and ``text``.
    ``enable_thinking`` and ``reasoning_format`` None: the server's defaults
    (``--reasoning``, ``--reasoning-format``), which the worker holds.
    ``continuation``: the part of a last assistant message continued
    ("content", "reasoning"; None: by the message).
    """
    return entry.call("prepare_chat", what,
                      messages=encode_messages(messages), tools=encode_tools(list(tools)),
                      tool_choice=tool_choice, schema=schema, grammar=grammar,
                      add_generation_prompt=add_generation_prompt,
                      enable_thinking=enable_thinking, kwargs=kwargs or {},
                      parallel_tool_calls=parallel_tool_calls,
                      reasoning_format=reasoning_format, tokenize=tokenize,
                      continuation=continuation)


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
    n = choices_from(f)
    entry = svc.entry_for(f.raw("model"))
    plan = _prepare(f, entry)
    gen = generation_from(f, entry.n_vocab, svc.generation_default,
                          sampling_default=entry.sampling, tokenize=text_tokenizer(entry))
    apply_plan(gen, plan)
    gen.reasoning_budget = reasoning_budget_from(f)
    gen.reasoning_budget_message = f.str("reasoning_budget_message")
    gen.reasoning_control = f.bool("reasoning_control", False)
    chat_probs_from(f, gen)
    stream = f.bool("stream", False)
    gen.return_progress = stream and f.bool("return_progress", False)
    gen.timings_per_token = stream and f.bool("timings_per_token", False)
    g = Generation(entry, gen, [Prompt(plan["tokens"], plan["text"])], "v1/chat/completions",
                   "POST /v1/chat/completions", n=n, stream=stream, id_slot=id_slot_from(f),
                   chat=plan["chat"])
    pipeline.run(h, g, ChatFormat(g, include_usage_from(f), f.bool("timings_per_token", False),
                                  f.bool("verbose", h.verbose)))


def control(h, body):
    """POST /v1/chat/completions/control: {"id": a running chat completion's id,
    "action": "reasoning_end"}, as llama-server's: its thinking ends now (a request
    that set reasoning_control).  200 {"success": ...}, with a "message" where not."""
    f = Fields(body)
    cid, action = f.str("id") or "", f.str("action") or ""
    if not cid:
        raise BadRequest("missing completion id")
    if action != "reasoning_end":
        raise BadRequest("unknown control action")
    h.send_json(200, h.service.control(cid, action))


class ChatFormat(Format):
    """OpenAI's chat.completion and its chunks; a choice per job.

    The stream opens with the first choice's role chunk (the pipeline has
    checked what would refuse the request); a further choice's goes out
    with its first piece.
    """

    def __init__(self, g, include_usage, timings_per_token, verbose):
        self.g, self.include_usage = g, include_usage
        self.timings_per_token, self.verbose = timings_per_token, verbose
        self.post = g.gen.post_sampling_probs
        self.cid, self.created = formats.new_id("chatcmpl"), formats.now()
        self.opened = set()     # job indexes whose role chunk went out

    def _chunk(self, delta, job, finish=None, probs=None):
        return formats.oai_chat_chunk(delta, self.g.entry.id, self.cid, self.created, finish,
                                      probs=probs, post=self.post, index=job.index)

    def _open(self, out, job):
        if job.index not in self.opened:
            self.opened.add(job.index)
            out.send(self._chunk({"role": "assistant", "content": None}, job))

    def open(self, out):
        self._open(out, pipeline.Job(0, self.g.prompts[0], 0))

    def progress(self, out, job, p):
        # llama-server's progress chunk: the role delta, with prompt_progress
        self.opened.add(job.index)
        chunk = self._chunk({"role": "assistant", "content": None}, job)
        chunk["prompt_progress"] = formats.progress_json(p)
        if self.timings_per_token:
            chunk["timings"] = formats.progress_timings(p)
        return out.send(chunk)

    def piece(self, out, job, d, probs, usage=None):
        self._open(out, job)
        chunk = self._chunk(_delta_json(d), job, probs=probs)
        if usage is not None:       # timings_per_token
            chunk["timings"] = formats.timings(usage)
        return out.send(chunk)

    def choice_end(self, out, job, c):
        self._open(out, job)
        out.send(self._chunk({}, job, _finish(c)))

    def end(self, out, done):
        if self.include_usage:
            chunk = formats.oai_usage_chunk(done[0], "chat.completion.chunk", self.g.entry.id,
                                            self.cid, self.created)
            if len(done) > 1:
                chunk["usage"] = formats.usage_of_choices(done)
            out.send(chunk)
        out.send(b"[DONE]")

    def body(self, jobs, done):
        g, c0 = self.g, done[0]
        out = formats.oai_chat(c0, g.entry.id, self.cid, self.created,
                               message=_message(c0.reply), finish=_finish(c0), post=self.post)
        for index, c in enumerate(done[1:], 1):
            out["choices"].append(formats.oai_chat_choice(c, index, _message(c.reply),
                                                          _finish(c), self.post))
        if len(done) > 1:
            out["usage"] = formats.usage_of_choices(done)
        # "verbose" (default: the server's -v): the native result too, with the prompt text
        if self.verbose:
            out["__verbose"] = formats.native_final(c0, g.entry.id, g.gen, g.entry.n_ctx,
                                                    g.id_slot, g.prompts[0].text)
        return out
