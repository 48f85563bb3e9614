"""Grammars that force a tool call, in the form the template teaches its model.

``tool_choice`` "required" or a named function holds the reply to a GBNF
grammar for one call (or, with parallel calls, several); with "auto" the
same grammar is lazy, started by the call's opener (chat/template.py).
"""

import json

from ..errors import InvalidRequest
from .calls import schema_types
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


# ---------------------------------------------------------------------------
# Calls in a family's shape (chat/shapes.py): what its template renders
# ---------------------------------------------------------------------------

# How a template writes one call's JSON where its shape's body is "json"
# (chat/derive.py reads it from the template's rendering, needles in place):
# the name and the arguments are found by these values.
NAME_NEEDLE, ARGS_NEEDLE = "FN_NEEDLE", {"ARG_NEEDLE": "VAL_NEEDLE"}
DEFAULT_JSON_CALL = {"name": NAME_NEEDLE, "arguments": ARGS_NEEDLE}

# between the parts of a call, what the templates put there: nothing, a blank or a newline
_GAP = '("\\n" | " ")?'


def shape_grammar(tools, shape, tool_choice="required", parallel=False, json_call=None,
                  json_list=False, tokens=None):
    """GBNF for one (or, with ``parallel``, several) calls written in ``shape``
    (a chat/shapes.Shape), as the family's template renders a call, so the
    family's own reader (chat/calls.py) reads it back.

    ``json_call``/``json_list``: for a "json" body, the call object as the
    template writes it (DEFAULT_JSON_CALL's needles where the name and the
    arguments go) and whether the calls are one JSON list.  Arguments follow
    each tool's schema: JSON where the shape writes JSON, a tagged value as
    text where the schema allows a string (as llama.cpp's tagged grammars).
    """
    tools = _chosen(tools, tool_choice)
    g = Grammar(strict=False)           # a tool's schema never fails the request
    g.tokens = dict(tokens or {})
    g.rules["gap"] = _GAP
    alts = []
    for i, t in enumerate(tools):
        params = t.parameters if isinstance(t.parameters, dict) else {"type": "object"}
        g.root_schema = params
        g._refs = {}
        alts.append(_ShapeCall(g, shape, "tool-%d" % i).call(t.name, params, json_call))
    call = g.add("call", " | ".join(alts))
    g.rules["root"] = _shape_root(g, shape, call, parallel, json_list)
    return g.text()


def _chosen(tools, tool_choice):
    if tool_choice in ("required", "auto", "none"):
        return list(tools)
    chosen = [t for t in tools if t.name == tool_choice]
    if not chosen:
        raise InvalidRequest("tool_choice names a function that is not in 'tools': %s"
                             % tool_choice)
    return chosen


def _lit(text, g=None):
    """A marker: the vocabulary's own token where it is one (``g.tokens``),
    so a forced call writes it as the model was taught; else its text."""
    if not text:
        return ""
    tok = getattr(g, "tokens", {}).get(text)
    return "<[%d]>" % tok if tok is not None else literal(text)


def _seq(*parts):
    return " ".join(p for p in parts if p) or '""'


def _shape_root(g, shape, call, parallel, json_list):
    """The calls of a reply: the section's markers around them, each call in its own."""
    if shape.recipients:
        # a message to each tool: the prompt opened the first (">>>" of
        # Functionary v3.2; Muse's "<|start|>assistant"), the rest open their
        # own -- where no end of generation must come between (Muse's <|eom|> is one)
        more = parallel and len(shape.recipients) == 2
        return call + (' (%s %s)*' % (_lit(shape.recipients[0], g), call) if more else "")
    if shape.body == "python":
        one = call
        calls = '%s (", " %s)*' % (one, one) if parallel else one
        return _seq(_lit(shape.section[0], g), '"["', calls, '"]"', _lit(shape.section[1], g))
    one = g.add("wrapped-call", _seq(_lit(shape.call[0], g), "gap" if shape.call[0] else "", call,
                                     "gap" if shape.call[1] else "", _lit(shape.call[1], g)))
    if json_list:
        calls = '"[" space %s ("," space %s)* "]"' % (one, one) if parallel \
            else '"[" space %s "]"' % one
    else:
        calls = "%s (gap %s)*" % (one, one) if parallel else one
    if shape.section[0]:
        return _seq(_lit(shape.section[0], g), "gap", calls, "gap", _lit(shape.section[1], g))
    return calls


class _ShapeCall:
    """The rules of one tool's call in a shape; ``call()`` gives its rule's name."""

    def __init__(self, g, shape, name):
        self.g, self.shape, self.name = g, shape, name

    def call(self, tool, params, json_call):
        sh, g = self.shape, self.g
        body = sh.body
        if sh.recipients and not (sh.section[0] or sh.call[0] or sh.name[0]):
            body = "recipient-json"
        rule = getattr(self, "_" + body.replace("-", "_"))(tool, params, json_call)
        if sh.recipients and sh.section[0]:
            rule = g.add(self.name + "-section", _seq(
                _lit(sh.section[0], g), "gap", rule, "gap", _lit(sh.section[1], g)))
        if sh.recipients:
            # " to=NAME<|message|>" (Muse) or "NAME\n" (Functionary v3.2) heads the message
            head = literal(tool) if sh.recipients[1] == "\n" else \
                '" to=" %s' % literal(tool)
            rule = g.add(self.name + "-message", "%s %s %s" % (
                head, _lit(sh.recipients[1], g), rule))
        return rule

    # -- the bodies, one method each (Shape.body)
    def _recipient_json(self, tool, params, json_call):
        return self.g.schema(params, self.name + "-args")

    def _json(self, tool, params, json_call):
        return self.g.add(self.name + "-call",
                          self._json_value(json_call or DEFAULT_JSON_CALL, tool, params))

    def _json_value(self, v, tool, params):
        g = self.g
        if v == NAME_NEEDLE:
            return json_literal(tool)
        if v == ARGS_NEEDLE:
            return g.schema(params, self.name + "-args")
        if isinstance(v, dict):
            parts = []
            for k, sub in v.items():
                key = json_literal(tool) if k == NAME_NEEDLE else json_literal(k)
                parts.append('%s space ":" space %s' % (key, self._json_value(sub, tool, params)))
            return '"{" space %s "}" space' % ' "," space '.join(parts)
        if isinstance(v, list) and v:
            return '"[" space %s "]" space' % self._json_value(v[0], tool, params)
        if isinstance(v, str) and v and (v.isdigit() or v.startswith("call")):
            # the call's id: an index (Command-R7B) or an id of its own
            return '"\\"" [0-9]{1,4} "\\"" space' if v.isdigit() else \
                '"\\"" [a-zA-Z0-9_-]{1,40} "\\"" space'
        return json_literal(v) + " space"

    def _name(self, tool, attrs=""):
        """The name between its markers; where the opening marker opens an
        attribute (name="), its quote closed after the family's attributes."""
        sh, g = self.shape, self.g
        text = tool
        if sh.name[0].endswith('"') and not sh.name[1].startswith('"'):
            text += '"'
        return _seq(_lit(sh.name[0], g), literal(text) + (" " + attrs if attrs else ""),
                    _lit(sh.name[1], g))

    def _name_json(self, tool, params, json_call):
        sh, g = self.shape, self.g
        name = literal(tool)
        if sh.indexed_name:
            name = '"functions." %s ":" [0-9]{1,3}' % literal(tool)    # Kimi K2's id is its name
        head = _seq(_lit(sh.name[0], g), name, _lit(sh.name[1], g))
        args = g.schema(params, self.name + "-args")
        if sh.fenced:
            args = '"```json\\n" %s "```"' % args
        return g.add(self.name + "-call", _seq(head, args, _lit(sh.close, g)))

    def _name_tagged(self, tool, params, json_call):
        sh, g = self.shape, self.g
        attrs = '" index=\\"" [1-9] [0-9]{0,2} "\\""' if "{index}" in sh.name_attr else ""
        head = self._name(tool, attrs)
        args = []
        for key, sub, required in _arguments(params):
            text = _is_text(sub)
            value = self._text_value(sub, sh.value[1], lines=sh.value_lines) if text \
                else g.schema(sub, "%s-%s" % (self.name, key))
            k = key
            if sh.key[0].endswith('"') and not sh.key[1].startswith('"'):
                k += '"' + sh.key_attr.format(string="true" if text else "false",
                                              type=_type_word(sub, text))
            if sh.value_lines:
                value = '"\\n" %s "\\n"' % value
            arg = g.add("%s-%s-arg" % (self.name, key), _seq(
                "gap", _lit(sh.key[0], g), literal(k), _lit(sh.key[1], g),
                "gap " + _lit(sh.value[0], g) if sh.value[0] else "", value,
                _lit(sh.value[1], g)))
            args.append(arg if required else "%s?" % arg)
        if not _has_properties(params):
            args.append(self._any_tagged() + "*")      # any object: any keys, text values
        return g.add(self.name + "-call", _seq(head, " ".join(args), "gap", _lit(sh.close, g)))

    def _any_tagged(self):
        sh, g = self.shape, self.g
        key = '[a-zA-Z_] [a-zA-Z0-9_.-]{0,63}'
        if sh.key[0].endswith('"') and not sh.key[1].startswith('"'):
            key += ' "\\""' + (" " + literal(sh.key_attr.format(string="true", type="string"))
                               if sh.key_attr else "")
        value = self._text_value({}, sh.value[1], lines=sh.value_lines)
        if sh.value_lines:
            value = '"\\n" %s "\\n"' % value
        return self.g.add(self.name + "-any-arg", _seq(
            "gap", _lit(sh.key[0], g), key, _lit(sh.key[1], g),
            "gap " + _lit(sh.value[0], g) if sh.value[0] else "", value, _lit(sh.value[1], g)))

    def _text_value(self, schema, end, lines=False):
        """A value written as text: one of the schema's words, else any text
        that does not hold the marker that ends it."""
        enum = schema.get("enum") if isinstance(schema, dict) else None
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            return "(%s)" % " | ".join(literal(v) for v in enum)
        if isinstance(schema, dict) and isinstance(schema.get("const"), str):
            return literal(schema["const"])
        return excluding(self.g, ("\n" if lines else "") + end)

    def _xml(self, tool, params, json_call):
        """MiniMax-M3: <KEY>VALUE</KEY> after the namespace token, an object
        nested elements, a list <item>s."""
        sh, g = self.shape, self.g
        body = self._xml_members(params, self.name, 0)
        return g.add(self.name + "-call", _seq(self._name(tool), body, "gap", _lit(sh.close, g)))

    def _xml_members(self, schema, name, depth):
        out = []
        for key, sub, required in _arguments(schema):
            el = self._xml_element(key, sub, "%s-%s" % (name, key), depth)
            out.append(el if required else el + "?")
        if not _has_properties(schema):
            out.append(self._xml_element(None, {}, name + "-any", depth) + "*")
        return " ".join(out)

    def _xml_element(self, key, sub, name, depth):
        sh, g = self.shape, self.g
        ns = sh.ns
        if key is None:
            tag = '[a-zA-Z_] [a-zA-Z0-9_.-]{0,63}'
            open_, close = '%s "<" %s ">"' % (literal(ns), tag), '%s "</" [a-zA-Z0-9_.-]{1,64} ">"' \
                % literal(ns)
        else:
            open_, close = literal(ns + "<" + key + ">"), literal(ns + "</" + key + ">")
        if _is_text(sub):
            value = self._text_value(sub, ns)
        elif depth < 4 and _has_properties(sub):
            value = self._xml_members(sub, name, depth + 1) + " gap"
        elif depth < 4 and isinstance(sub, dict) and isinstance(sub.get("items"), dict) \
                and sub.get("type") == "array":
            value = "%s* gap" % self._xml_element("item", sub["items"], name + "-item", depth + 1)
        else:
            value = g.schema(sub, name)
        return g.add(name + "-el", _seq("gap", open_, value, close))

    def _python(self, tool, params, json_call):
        """LFM2: NAME(key=value, ...), values as Python literals."""
        g = self.g
        parts = []
        for key, sub, required in _arguments(params):
            if _is_text(sub):
                value = _python_string(g, sub)
            else:
                value = g.schema(sub, "%s-%s" % (self.name, key))
            parts.append((g.add("%s-%s-kw" % (self.name, key), "%s %s" % (
                literal(key + "="), value)), required))
        return g.add(self.name + "-call", "%s \"(\" %s \")\"" % (
            literal(tool), _comma_list(parts, '", "')))

    def _gemma4(self, tool, params, json_call):
        """gemma-4: call:NAME{key:value,...}, strings between <|"|>."""
        g = self.g
        _gemma_generic(g)
        parts = []
        for key, sub, required in _arguments(params):
            value = _gemma_string(g, sub) if _is_text(sub) else \
                g.schema(sub, "%s-%s" % (self.name, key)) if _is_scalar(sub) else "gemma-value"
            parts.append((g.add("%s-%s-kv" % (self.name, key), "%s %s" % (
                literal(key + ":"), value)), required))
        if not _has_properties(params):
            return g.add(self.name + "-call", '"call:" %s gemma-dict' % literal(tool))
        return g.add(self.name + "-call", '"call:" %s "{" %s "}"' % (
            literal(tool), _comma_list(parts, '","')))


def _comma_list(parts, comma):
    """``parts`` ((rule, required), in order) joined by ``comma``: an optional
    part may be left out, and a comma stands only between parts that are there."""
    if not parts:
        return '""'
    (first, required), rest = parts[0], parts[1:]
    tail = " ".join('(%s %s)%s' % (comma, r, "" if q else "?") for r, q in rest)
    with_first = _seq(first, tail)
    if required:
        return with_first
    return "(%s | %s)" % (with_first, _comma_list(rest, comma))


def _arguments(schema):
    """(key, schema, required) of each property, in the schema's order."""
    if not isinstance(schema, dict):
        return []
    props = schema.get("properties")
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    if not isinstance(props, dict):
        return []
    return [(k, v if isinstance(v, dict) else {}, k in required) for k, v in props.items()]


def _has_properties(schema):
    return isinstance(schema, dict) and isinstance(schema.get("properties"), dict) \
        and bool(schema["properties"])


def _is_text(schema):
    """Whether a tagged value is written as text: the schema allows a string
    (or says nothing), as llama.cpp's tagged grammars and readers take it."""
    types = schema_types(schema)
    return not types or "string" in types


def _is_scalar(schema):
    types = schema_types(schema)
    return bool(types) and types <= {"integer", "number", "boolean", "null"}


def _type_word(schema, text):
    if text:
        return "string"
    types = schema_types(schema) - {"null"}
    t = next(iter(types)) if len(types) == 1 else "object"
    return "number" if t == "integer" else t


def excluding(g, end):
    """A rule matching any text that does not hold ``end`` (the marker after
    it): the states of a matcher for ``end``, every state accepting, the one
    that would complete it never reached (as llama.cpp's until-grammars)."""
    key = ("", end)                 # add() never makes an empty name: no clash
    if key in g._keys:
        return g._keys[key]
    n = len(end)
    fail = [0] * (n + 1)            # KMP: the longest proper border of each prefix
    k = 0
    for i in range(1, n):
        while k and end[i] != end[k]:
            k = fail[k]
        if end[i] == end[k]:
            k += 1
        fail[i + 1] = k
    base = "until-%d" % len(g.rules)
    names = ["%s-%d" % (base, q) for q in range(n)]
    for q in range(n):
        by_dest, seen = {}, []
        for c in sorted(set(end)):
            d = q
            while d and end[d] != c:
                d = fail[d]
            d = d + 1 if end[d] == c else 0
            if d:                   # d == n would complete the marker: no way on
                seen.append(c)
                if d < n:
                    by_dest.setdefault(d, []).append(c)
        alts = ["%s %s" % (_char_class(cs), names[d]) for d, cs in sorted(by_dest.items())]
        alts.append("%s %s" % (_char_class(seen, negated=True), names[0]))
        g.rules[names[q]] = "| " + " | ".join(alts)
    g._keys[key] = names[0]
    return names[0]


def _char_class(chars, negated=False):
    body = "".join(_class_char(c) for c in chars)
    return "[%s%s]" % ("^" if negated else "", body)


def _class_char(c):
    if c in "\\]^-[":
        return "\\" + c
    if c == "\n":
        return "\\n"
    if c == "\r":
        return "\\r"
    if c == "\t":
        return "\\t"
    return c


def _python_string(g, schema):
    enum = schema.get("enum") if isinstance(schema, dict) else None
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return "(%s)" % " | ".join(literal(repr(v)) for v in enum)
    g.rules.setdefault("py-string", "\"'\" ([^'\\\\\\n] | \"\\\\\" [^\\n])* \"'\"")
    return "py-string"


def _gemma_string(g, schema):
    enum = schema.get("enum") if isinstance(schema, dict) else None
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        q = _lit('<|"|>', g)
        return "(%s)" % " | ".join("%s %s %s" % (q, literal(v), q) for v in enum)
    return "gemma-string"


def _gemma_generic(g):
    """gemma-4's notation for any value (llama.cpp's gemma4 rules)."""
    if "gemma-value" in g.rules:
        return
    q = _lit('<|"|>', g)
    g.rules["gemma-string"] = "%s %s %s" % (q, excluding(g, '<|"|>'), q)
    g.rules["gemma-key"] = '[a-zA-Z_] [a-zA-Z0-9_.-]{0,63}'
    g.rules["gemma-dict"] = ('"{" ( gemma-key ":" gemma-value ("," gemma-key ":" gemma-value)* )? '
                             '"}"')
    g.rules["gemma-array"] = '"[" ( gemma-value ("," gemma-value)* )? "]"'
    g.primitive("number")
    g.primitive("boolean")
    g.primitive("null")
    g.rules["gemma-value"] = ("gemma-string | gemma-dict | gemma-array | number | boolean "
                              "| null")
