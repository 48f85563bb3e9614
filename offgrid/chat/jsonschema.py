"""JSON Schema to GBNF: grammars that make libllama's sampler emit valid JSON.

``schema_to_grammar(schema)`` returns GBNF text whose ``root`` matches exactly
the JSON texts that validate against ``schema`` (for the subset below), so a
request's ``response_format`` / ``json_schema`` holds every time, not most of
the time.  The chat layer also builds tool-call grammars from the tools'
parameter schemas with the same ``Grammar`` builder.

Supported: ``type`` (one or a list), ``enum``, ``const``, ``properties`` with
``required`` and ``additionalProperties``, ``items`` / ``prefixItems`` with
``minItems`` / ``maxItems``, ``minLength`` / ``maxLength``, string ``format``
date, time, date-time and uuid, integer ``minimum`` / ``maximum`` (and the
exclusive forms), ``anyOf`` / ``oneOf``, ``allOf`` of objects, ``$ref`` into
``#/$defs`` or ``#/definitions`` (recursion included).  Anything else that
constrains values (``pattern``, ``multipleOf``, number ranges, ...) raises
SchemaError naming it rather than producing output that might not validate.

As in llama.cpp, whitespace between tokens is bounded (a space, or up to two
newlines and 20 indentation characters) and numbers have at most 16 digits
per part, so a small model cannot wander off into endless blanks or digits;
properties come out in the schema's order, required ones first.
"""

import json
import re

from ..errors import InvalidRequest


class SchemaError(InvalidRequest):
    """A schema this converter cannot turn into a grammar."""


SPACE = '| " " | "\\n"{1,2} [ \\t]{0,20}'

PRIMITIVES = {
    "boolean": '("true" | "false") space',
    "null": '"null" space',
    "integral-part": '[0] | [1-9] [0-9]{0,15}',
    "decimal-part": '[0-9]{1,16}',
    "number": '("-"? integral-part) ("." decimal-part)? ([eE] [-+]? integral-part)? space',
    "integer": '("-"? integral-part) space',
    "char": '[^"\\\\\\x7F\\x00-\\x1F] | [\\\\] (["\\\\bfnrt] | "u" [0-9a-fA-F]{4})',
    "string": '"\\"" char* "\\"" space',
    "value": 'object | array | string | number | boolean | null',
    "object": '"{" space ( string ":" space value ("," space string ":" space value)* )? "}" space',
    "array": '"[" space ( value ("," space value)* )? "]" space',
    "uuid": '"\\"" [0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" '
            '[0-9a-fA-F]{4} "-" [0-9a-fA-F]{12} "\\"" space',
    "date": '[0-9]{4} "-" ( "0" [1-9] | "1" [0-2] ) "-" ( "0" [1-9] | [1-2] [0-9] | "3" [0-1] )',
    "time": '([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] '
            '( "." [0-9]{3} )? ( "Z" | ( "+" | "-" ) ( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )',
    "date-time": 'date "T" time',
    "date-string": '"\\"" date "\\"" space',
    "time-string": '"\\"" time "\\"" space',
    "date-time-string": '"\\"" date-time "\\"" space',
}
_DEPS = {
    "number": ("integral-part", "decimal-part"), "integer": ("integral-part",),
    "string": ("char",), "value": ("object", "array", "string", "number", "boolean", "null"),
    "object": ("string", "value"), "array": ("value",), "date-time": ("date", "time"),
    "date-string": ("date",), "time-string": ("time",), "date-time-string": ("date-time",),
}

# Keywords that only annotate; they never narrow what validates.
_ANNOTATIONS = {"title", "description", "$schema", "$id", "$comment", "examples", "default",
                "deprecated", "readOnly", "writeOnly", "$defs", "definitions", "strict",
                "additionalItems", "unevaluatedProperties"}
_HANDLED = {"type", "enum", "const", "properties", "required", "additionalProperties", "items",
            "prefixItems", "minItems", "maxItems", "minLength", "maxLength", "format",
            "anyOf", "oneOf", "allOf", "$ref", "minimum", "maximum", "exclusiveMinimum",
            "exclusiveMaximum", "nullable"}


def literal(text):
    """A GBNF string literal matching ``text`` exactly."""
    out = []
    for c in text:
        if c == '"':
            out.append('\\"')
        elif c == "\\":
            out.append("\\\\")
        elif c == "\n":
            out.append("\\n")
        elif c == "\r":
            out.append("\\r")
        elif c == "\t":
            out.append("\\t")
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append("\\x%02X" % ord(c))
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def json_literal(value):
    """A GBNF rule body matching the JSON text of ``value`` (compact, as json.dumps)."""
    return literal(json.dumps(value, ensure_ascii=False))


class Grammar:
    """A set of GBNF rules being built; ``text()`` gives the grammar."""

    def __init__(self, root_schema=None):
        self.rules = {"space": SPACE}
        self.root_schema = root_schema if isinstance(root_schema, dict) else {}
        self._refs = {}

    # -- rules ----------------------------------------------------------------
    def add(self, name, body):
        """Add a rule; a different rule of the same name gets a numbered name."""
        name = re.sub(r"[^a-zA-Z0-9-]+", "-", name) or "r"
        key, i = name, 0
        while key in self.rules and self.rules[key] != body:
            i += 1
            key = "%s%d" % (name, i)
        self.rules[key] = body
        return key

    def primitive(self, name):
        if name not in self.rules:
            self.rules[name] = PRIMITIVES[name]
            for dep in _DEPS.get(name, ()):
                self.primitive(dep)
        return name

    def text(self):
        order = ["root"] + sorted(k for k in self.rules if k != "root")
        return "".join("%s ::= %s\n" % (k, self.rules[k]) for k in order if k in self.rules)

    # -- schemas ----------------------------------------------------------------
    def schema(self, schema, name):
        """The name of a rule matching JSON valid against ``schema`` (plus trailing space)."""
        if schema is True or schema == {} or schema is None:
            return self.primitive("value")
        if schema is False:
            raise SchemaError("a schema of false matches nothing")
        if not isinstance(schema, dict):
            raise SchemaError("a schema must be an object, got %r" % (schema,))
        for key in schema:
            if key not in _HANDLED and key not in _ANNOTATIONS:
                raise SchemaError("JSON schema keyword %r is not supported" % key)

        if "$ref" in schema:
            return self._ref(schema["$ref"])
        if "const" in schema:
            return self.add(name, json_literal(schema["const"]) + " space")
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise SchemaError("'enum' must be a non-empty array")
            body = " | ".join(json_literal(v) for v in values)
            return self.add(name, "(" + body + ") space")
        for key in ("anyOf", "oneOf"):
            if key in schema:
                alts = schema[key]
                if not isinstance(alts, list) or not alts:
                    raise SchemaError("'%s' must be a non-empty array" % key)
                rules = [self.schema(s, "%s-%d" % (name, i)) for i, s in enumerate(alts)]
                return self.add(name, " | ".join(rules))
        if "allOf" in schema:
            return self.schema(self._merge_all_of(schema), name)

        types = schema.get("type")
        if isinstance(types, list):
            if not types:
                raise SchemaError("'type' must not be an empty list")
            rules = [self.schema(dict(schema, type=t), "%s-%s" % (name, t)) for t in types]
            return self.add(name, " | ".join(rules))
        if schema.get("nullable") is True and types is not None:
            sub = dict(schema)
            del sub["nullable"]
            return self.add(name, "%s | %s" % (self.schema(sub, name + "-value"),
                                               self.primitive("null")))
        if types is None:
            if "properties" in schema or "additionalProperties" in schema:
                types = "object"
            elif "items" in schema or "prefixItems" in schema:
                types = "array"
            else:
                return self.primitive("value")
        if types == "object":
            return self._object(schema, name)
        if types == "array":
            return self._array(schema, name)
        if types == "string":
            return self._string(schema, name)
        if types == "integer":
            return self._integer(schema, name)
        if types == "number":
            for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                if key in schema:
                    raise SchemaError("'%s' on a number is not supported (use an integer)" % key)
            return self.primitive("number")
        if types in ("boolean", "null"):
            return self.primitive(types)
        raise SchemaError("JSON schema type %r is not supported" % (types,))

    def _ref(self, ref):
        if not isinstance(ref, str) or not ref.startswith("#/"):
            raise SchemaError("only local $ref ('#/...') is supported, got %r" % (ref,))
        if ref in self._refs:
            return self._refs[ref]
        target = self.root_schema
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise SchemaError("unresolved $ref %r" % ref)
            target = target[part]
        name = self.add("ref-" + ref[2:], "")       # reserve the name: refs may recurse
        self._refs[ref] = name
        body_rule = self.schema(target, name + "-body")
        self.rules[name] = body_rule
        return name

    @staticmethod
    def _merge_all_of(schema):
        merged = {"type": "object", "properties": {}, "required": []}
        for part in schema["allOf"]:
            if not isinstance(part, dict) or part.get("type", "object") != "object":
                raise SchemaError("'allOf' is supported only for object schemas")
            merged["properties"].update(part.get("properties", {}))
            merged["required"] += [r for r in part.get("required", [])
                                   if r not in merged["required"]]
        return merged

    def _object(self, schema, name):
        props = schema.get("properties") or {}
        required = schema.get("required") or []
        additional = schema.get("additionalProperties")
        if not isinstance(props, dict) or not isinstance(required, list):
            raise SchemaError("'properties' must be an object and 'required' an array")
        if not props and additional is None:
            return self.primitive("object")         # any object
        kv = {}
        for key, sub in props.items():
            value = self.schema(sub, "%s-%s" % (name, key))
            kv[key] = self.add("%s-%s-kv" % (name, key), "%s space \":\" space %s"
                               % (json_literal(key), value))
        req = [k for k in props if k in required]
        missing = [k for k in required if k not in props]
        if missing:
            raise SchemaError("required properties %s have no schema in 'properties'" % missing)
        opt = [kv[k] for k in props if k not in required]
        if additional not in (None, False):
            value = self.primitive("value") if additional is True else \
                self.schema(additional, name + "-additional-value")
            key_rule = self._not_strings(list(props), name + "-additional-k") if props \
                else self.primitive("string")
            opt.append(self.add(name + "-additional-kv",
                                "%s \":\" space %s" % (key_rule, value)) + "*")
        body = '"{" space '
        body += ' "," space '.join(kv[k] for k in req)
        if opt:
            tails = self._optional_tails(opt, name)
            if req:
                body += " " + tails[0]
            else:
                body += " " + self._optional_first(opt, tails, name)
        body += ' "}" space'
        return self.add(name, body)

    def _optional_tails(self, opt, name):
        """tails[i]: any in-order selection of opt[i:], each preceded by a comma."""
        tails = [""] * (len(opt) + 1)
        for i in range(len(opt) - 1, -1, -1):
            item = opt[i]
            repeat = item.endswith("*")
            kv = item[:-1] if repeat else item
            part = '( "," space %s )%s' % (kv, "*" if repeat else "?")
            tails[i] = self.add("%s-tail-%d" % (name, i), (part + " " + tails[i + 1]).strip())
        return tails

    def _optional_first(self, opt, tails, name):
        alts = []
        for i, item in enumerate(opt):
            repeat = item.endswith("*")
            kv = item[:-1] if repeat else item
            first = '%s ( "," space %s )*' % (kv, kv) if repeat else kv
            alts.append((first + " " + tails[i + 1]).strip())
        return "( " + self.add(name + "-first", " | ".join(alts)) + " )?"

    def _not_strings(self, words, name):
        """A JSON string that is none of ``words`` (keys of additional properties)."""
        char = self.primitive("char")
        trie = {}
        for w in words:
            node = trie
            for c in w:
                node = node.setdefault(c, {})
            node[""] = {}

        def visit(node):
            alts, rejects = [], ""
            for c, child in sorted(node.items()):
                if c == "":
                    continue
                rejects += c
                cls = _class_char(c)
                if any(k != "" for k in child):
                    inner = visit(child)
                    if "" in child:
                        alts.append("[%s] (%s)?" % (cls, inner))
                    else:
                        alts.append("[%s] (%s)" % (cls, inner))
                else:
                    alts.append("[%s] %s+" % (cls, char))
            neg = "".join(_class_char(c) for c in rejects)
            alts.append('[^"%s] %s*' % (neg, char))
            return " | ".join(alts)

        body = '"\\"" ( %s )%s "\\"" space' % (visit(trie), "" if "" in trie else "?")
        return self.add(name, body)

    def _array(self, schema, name):
        lo = schema.get("minItems", 0)
        hi = schema.get("maxItems")
        if not isinstance(lo, int) or (hi is not None and not isinstance(hi, int)):
            raise SchemaError("'minItems' and 'maxItems' must be integers")
        items = schema.get("items")
        prefix = schema.get("prefixItems")
        if isinstance(items, list):
            prefix, items = items, None
        if prefix is not None:
            rules = [self.schema(s, "%s-%d" % (name, i)) for i, s in enumerate(prefix)]
            body = '"[" space ' + ' "," space '.join(rules) + ' "]" space'
            return self.add(name, body)
        item = self.schema(items, name + "-item") if items not in (None, True, {}) \
            else self.primitive("value")
        if hi is not None and hi < lo:
            raise SchemaError("'maxItems' is below 'minItems'")
        if hi == 0:
            return self.add(name, '"[" space "]" space')
        more = _repeat('"," space %s' % item, max(lo - 1, 0), None if hi is None else hi - 1)
        seq = "%s %s" % (item, more)
        body = '"[" space %s "]" space' % (seq if lo > 0 else "( %s )?" % seq)
        return self.add(name, body)

    def _string(self, schema, name):
        fmt = schema.get("format")
        if fmt in ("date", "time", "date-time"):
            return self.primitive(fmt + "-string")
        if fmt == "uuid":
            return self.primitive("uuid")
        if "pattern" in schema:
            raise SchemaError("JSON schema 'pattern' is not supported")
        lo = schema.get("minLength", 0)
        hi = schema.get("maxLength")
        if lo == 0 and hi is None:
            return self.primitive("string")
        char = self.primitive("char")
        return self.add(name, '"\\"" %s "\\"" space' % _repeat(char, lo, hi))

    def _integer(self, schema, name):
        lo = schema.get("minimum")
        hi = schema.get("maximum")
        xlo, xhi = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
        if isinstance(xlo, bool) or isinstance(xhi, bool):
            raise SchemaError("boolean exclusiveMinimum/exclusiveMaximum (draft 4) is not supported")
        if xlo is not None:
            lo = max(lo, xlo + 1) if lo is not None else xlo + 1
        if xhi is not None:
            hi = min(hi, xhi - 1) if hi is not None else xhi - 1
        if lo is None and hi is None:
            return self.primitive("integer")
        for v in (lo, hi):
            if v is not None and (not isinstance(v, (int, float)) or v != int(v)):
                raise SchemaError("integer bounds must be whole numbers")
        lo = None if lo is None else int(lo)
        hi = None if hi is None else int(hi)
        if lo is not None and hi is not None and lo > hi:
            raise SchemaError("'minimum' is above 'maximum'")
        return self.add(name, "(%s) space" % _int_range(lo, hi))


def _class_char(c):
    return "\\" + c if c in "]\\^-" else c


def _repeat(item, lo, hi):
    """``item`` repeated lo..hi times (hi None: unbounded), in GBNF."""
    if hi is None:
        if lo == 0:
            return "(%s)*" % item
        if lo == 1:
            return "(%s)+" % item
        return "(%s){%d,}" % (item, lo)
    if lo == hi:
        return "(%s){%d}" % (item, lo) if lo else ""
    return "(%s){%d,%d}" % (item, lo, hi)


# -- integer ranges as digit patterns -------------------------------------------

_MAX_DIGITS = 16


def _int_range(lo, hi):
    """GBNF for the decimal integers in [lo, hi]; either bound may be None (open)."""
    alts = []
    if lo is None or lo < 0:
        # negative part: "-" followed by magnitudes in [max(1, -hi), -lo]
        neg_lo = 1 if hi is None or hi >= 0 else -hi
        neg_hi = None if lo is None else -lo
        if neg_hi is None or neg_hi >= neg_lo:
            alts.append('"-" (%s)' % _nonneg_range(neg_lo, neg_hi))
    if hi is None or hi >= 0:
        alts.append(_nonneg_range(max(lo or 0, 0), hi))
    return " | ".join(alts)


def _nonneg_range(lo, hi):
    """GBNF for the integers in [lo, hi] with lo >= 0, no leading zeros; hi None: open."""
    if hi is None:
        hi_digits = _MAX_DIGITS
        parts = []
        if lo <= 10 ** (len(str(lo))) - 1:
            parts.append(_range_same_len(str(lo), "9" * len(str(lo))))
        for n in range(len(str(lo)) + 1, hi_digits + 1):
            parts.append(_range_same_len("1" + "0" * (n - 1), "9" * n))
        return " | ".join(p for p in parts if p)
    parts = []
    a = lo
    while a <= hi:
        n = len(str(a))
        top = min(hi, 10 ** n - 1)
        parts.append(_range_same_len(str(a), str(top)))
        a = top + 1
    return " | ".join(parts)


def _range_same_len(a, b):
    """Numbers from a to b, both strings of the same length (a <= b)."""
    if a == b:
        return literal(a)
    if len(a) == 1:
        return "[%s-%s]" % (a, b)
    if a[0] == b[0]:
        return "%s (%s)" % (literal(a[0]), _range_same_len(a[1:], b[1:]))
    parts = []
    rest = len(a) - 1
    # from a up to a[0] followed by all nines
    if a[1:] == "0" * rest:
        low_first = a[0]
    else:
        parts.append("%s (%s)" % (literal(a[0]), _range_same_len(a[1:], "9" * rest)))
        low_first = str(int(a[0]) + 1)
    if b[1:] == "9" * rest:
        high_first = b[0]
    else:
        high_first = str(int(b[0]) - 1)
    if low_first <= high_first:
        parts.append("[%s-%s] [0-9]{%d}" % (low_first, high_first, rest))
    if b[1:] != "9" * rest:
        parts.append("%s (%s)" % (literal(b[0]), _range_same_len("0" * rest, b[1:])))
    return " | ".join(parts)


def schema_to_grammar(schema):
    """GBNF text for JSON that validates against ``schema`` (a dict, True or {})."""
    g = Grammar(schema)
    g.rules["root"] = g.schema(schema, "root-value") if schema not in (True, {}) else None
    if g.rules["root"] is None:
        g.rules["root"] = g.primitive("object")
    return g.text()


def json_object_grammar():
    """GBNF for any JSON object (``response_format: {"type": "json_object"}``)."""
    return schema_to_grammar({"type": "object"})
