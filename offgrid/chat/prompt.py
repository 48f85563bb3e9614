"""A chat request made ready to generate: prompt text, the grammar on the reply, how to read it.

    Messages, Tools, tool_choice, output schema
        --ChatTemplate.apply--> prompt text, ReplyFormat, tool-call grammar
        --grammar_of-->         the one grammar the reply is held to (and its lazy triggers)
        --preserved_tokens-->   control tokens whose text the reply must keep

Output constraints become a GBNF grammar for libllama's grammar sampler:
``tool_choice`` "required" or a named function (a call in the template's
syntax, arguments per the tool's schema), ``response_format`` json_object /
json_schema and llama.cpp's ``json_schema`` (``jsonschema.py``), or a
``grammar`` given as is.  With ``tool_choice`` "auto" the call grammar is
lazy, as llama-server's: text is free until the model writes the template's
call opener (``<tool_call>``, ``[TOOL_CALLS]``, gpt-oss's ``to=functions.``),
and from there only a well-formed call follows.

With "auto", the reply is also watched for a bare JSON call (``rescue.py``),
unless the worker was started with ``--no-tool-call-rescue``.

Tool grammars never fail a request: their schemas are read leniently
(``jsonschema.py``), and a tool grammar that still fails the GBNF checks
(``gbnf.py``: too large, too costly to sample) is rebuilt with any object
as the arguments of every tool, with a debug line.

Runs in the model's worker (``engine/worker.py``); ``model`` is the loaded
Model, used to tokenize markers and to check grammars against its vocabulary.
"""

import dataclasses
import logging
from dataclasses import dataclass
from typing import FrozenSet, Optional

from .calls import as_shape
from .gbnf import GrammarError, check_grammar
from .jsonschema import schema_to_grammar
from .rescue import finished_calls, rescue_of, tool_args
from .shapes import shape_markers
from .caps import ChatTemplateError
from .forced import tool_call_grammar
from .replyformat import ReplyFormat

log = logging.getLogger("offgrid.chat")


@dataclass
class ChatPlan:
    """A rendered chat prompt and what generating and reading its reply needs."""
    text: str
    reply_format: ReplyFormat
    grammar: Optional[str]
    grammar_triggers: tuple
    preserved_tokens: FrozenSet[int]
    id_length: int                  # tool-call ids: Mistral's templates want 9 characters
    rescue: Optional[dict] = None   # rescue.rescue_of: watch the reply for a bare call


def prepare_chat(model, template, messages, tools=(), tool_choice="auto", schema=None,
                 grammar=None, add_generation_prompt=True, enable_thinking=None, kwargs=None,
                 parallel_tool_calls=None, reasoning_format="auto", rescue=True, check=True,
                 continuation=None):
    """Render ``messages`` with ``template`` and settle the reply's grammar; a ChatPlan.

    ``continuation``: which part of a last assistant message is continued
    ("content", "reasoning"; None: by the message, ChatTemplate.apply).

    ``check``: hold the grammars to the GBNF checks and find the preserved
    tokens (a request that will generate; /apply-template renders only, and
    ``model`` may then be None).
    """
    if tools and tool_choice != "none" and grammar:
        raise ChatTemplateError("cannot use custom grammar constraints with tools")
    prompt = template.apply(messages, tools, add_generation_prompt=add_generation_prompt,
                            enable_thinking=enable_thinking, kwargs=kwargs or {},
                            json_schema=schema, tool_choice=tool_choice,
                            parallel_tool_calls=parallel_tool_calls,
                            reasoning_format=reasoning_format, continuation=continuation)
    if check and prompt.grammar is not None and not prompt.grammar_triggers \
            and getattr(template, "call_shape", ""):
        # a forced call asks for the vocabulary's own tokens where its markers
        # are tokens (a lazy grammar cannot: it is fed its trigger as text)
        tokens = marker_tokens(model, shape_markers(as_shape(template.call_shape)))
        if tokens:
            prompt.grammar = template.call_grammar(tools, tool_choice, bool(parallel_tool_calls),
                                                   tokens)
    if check and prompt.grammar is not None:
        prompt.grammar = _checked_tool_grammar(model, prompt, template, tools, tool_choice,
                                               parallel_tool_calls)
    g, triggers = grammar_of(prompt, schema, grammar)
    if check and g is not None and g is not prompt.grammar:
        check_grammar(model, g)         # a response format's or the client's: a 400 if bad
    fmt = prompt.reply_format
    if schema is not None:
        fmt = dataclasses.replace(fmt, json_fence=True)
    watch = None
    if schema is None and grammar is None:
        watch = rescue_of(tools, tool_choice, rescue)
    if watch is not None and check:
        try:
            check_grammar(model, watch["grammar"])
        except GrammarError as e:
            log.debug("tool-call rescue off for this request: %s", e)
            watch = None
    if watch is not None:
        # where bare JSON is the template's own call form (Llama 3, generic) a
        # repeated call is the model's to make; elsewhere only the rescue reads it
        native = getattr(template, "tool_syntax", "generic") in ("llama3", "generic")
        fmt = dataclasses.replace(fmt, bare_calls=True, tool_args=tool_args(tools),
                                  finished_calls=() if native else finished_calls(messages))
    id_length = 9 if getattr(template, "tool_syntax", "") == "mistral" else 32
    # only a request that will generate needs them (the worker sends them with
    # its tokens); a render alone, or a reader's test, has no model to ask
    keep = preserved_tokens(model, fmt) if check else frozenset()
    return ChatPlan(prompt.text, fmt, g, tuple(triggers), keep, id_length, watch)


def _checked_tool_grammar(model, prompt, template, tools, tool_choice, parallel):
    """The tool-call grammar, checked; rebuilt with any object as every tool's
    arguments when the tools' schemas make one the checks refuse."""
    try:
        check_grammar(model, prompt.grammar, prompt.grammar_triggers)
        return prompt.grammar
    except GrammarError as e:
        log.debug("tool schemas make too costly a grammar (%s); arguments held to any "
                  "object", e)
    loose = [dataclasses.replace(t, parameters={"type": "object"}) for t in tools]
    choice = "required" if prompt.grammar_triggers else tool_choice
    if hasattr(template, "call_grammar"):
        g = template.call_grammar(loose, choice, bool(parallel))
    else:                           # a built-in template: bare JSON calls
        g = tool_call_grammar(loose, "generic", choice, bool(parallel))
    check_grammar(model, g, prompt.grammar_triggers)
    return g


def grammar_of(prompt, schema, grammar):
    """(GBNF or None, lazy triggers) constraining the reply.

    A response format wins over tool_choice "auto"'s lazy call grammar (the
    reply is then the format's JSON), but not over a required call.
    """
    required_call = prompt.grammar is not None and not prompt.grammar_triggers
    if required_call and schema is not None:
        raise ChatTemplateError("a required tool call and a response format cannot be combined")
    if schema is not None:
        return schema_to_grammar(schema), ()
    if prompt.grammar is not None:
        return prompt.grammar, prompt.grammar_triggers
    return grammar, ()


# Markers a reply is read by; where one is a control token, it renders as
# nothing unless generation keeps its text.
_CALL_MARKERS = ("<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]",
                 "[CALL_ID]")
_HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>")


def reply_markers(fmt):
    """The markers a reply in ``fmt`` is read by."""
    markers = [m for pair in fmt.reasoning_markers for m in pair] + list(_CALL_MARKERS)
    if fmt.tool_syntax == "harmony":
        markers += _HARMONY_MARKERS
    if fmt.call_shape:
        markers += shape_markers(as_shape(fmt.call_shape))
    return markers


def marker_tokens(model, markers):
    """{marker: token} for each of ``markers`` that is one token of the
    model's vocabulary (a control token, or one of its own words such as
    gemma-4's <|tool_call>)."""
    out = {}
    for text in markers:
        toks = model.tokenize(text, add_special=False, parse_special=True)
        if len(toks) == 1 and model.token_bytes(toks[0]) in (b"", text.encode("utf-8")):
            out[text] = toks[0]
    return out


def preserved_tokens(model, fmt):
    """Control tokens the reply must show as text for the markers to be read."""
    out = set()
    for text in reply_markers(fmt):
        toks = model.tokenize(text, add_special=False, parse_special=True)
        if len(toks) == 1 and not model.token_bytes(toks[0]):
            out.add(toks[0])
    return frozenset(out)
