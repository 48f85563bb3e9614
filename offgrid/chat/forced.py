"""Grammars that force a tool call, in the form the template teaches its model.

``tool_choice`` "required" or a named function holds the reply to a GBNF
grammar for one call (or, with parallel calls, several); with "auto" the
same grammar is lazy, started by the call's opener (chat/template.py).
"""

import json

from ..errors import InvalidRequest
from .jsonschema import Grammar, json_literal, literal


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
