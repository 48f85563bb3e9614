"""JSON Schema to GBNF: grammars that make libllama's sampler emit valid JSON.

``schema_to_grammar(schema)`` returns GBNF text whose ``root`` matches exactly
the JSON texts that validate against ``schema`` (for the subset below), so a
request's ``response_format`` / ``json_schema`` holds every time, not most of
the time.  The chat layer also builds tool-call grammars from the tools'
parameter schemas with the same ``Grammar`` builder.

Supported: ``type`` (one or a list), ``enum``, ``const``, ``properties`` with
``required``, ``additionalProperties`` and ``propertyNames``, ``items`` /
``prefixItems`` with ``minItems`` / ``maxItems``, ``minLength`` /
``maxLength``, ``pattern`` (``regex_gbnf.py``), string ``format`` date, time,
date-time and uuid, ``minimum`` / ``maximum`` (and the exclusive forms) on
integers, and on numbers where a grammar can hold them (see
``_number_range``), ``anyOf`` / ``oneOf``, ``allOf`` of objects, ``$ref``
into ``#/$defs`` or ``#/definitions`` (recursion included).

Two modes.  Strict (``response_format``, ``json_schema``): anything else that
constrains values (``multipleOf``, ``uniqueItems``, a lookahead in a
pattern, ...) raises SchemaError naming it rather than producing output that
might not validate.  Lenient (``strict=False``: a tool's parameters, which
must never fail a request): each constraint that cannot be expressed is
dropped with a debug log line and the rest kept; a sub-schema that cannot be
read at all becomes "any JSON value".

As in llama.cpp, whitespace between tokens is bounded (a space, or up to two
newlines and 20 indentation characters) and numbers have at most 16 digits
per part, so a small model cannot wander off into endless blanks or digits;
properties come out in the schema's order, required ones first.
"""

import json
import logging
import math
import re

from ..errors import InvalidRequest
from .gbnf import GrammarError, Limits, check
from .regex_gbnf import PatternError, pattern_body

log = logging.getLogger("offgrid.jsonschema")


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

# Bounds on what a schema may ask for.  Nesting is Python recursion here
# (about four frames per level); a repetition count is libllama's own
# MAX_REPETITION_THRESHOLD; numbers in the grammar have at most 16 digits, so
# a bound needing more cannot be met; the output is held to what the GBNF
# check accepts anyway, so that the failure names the schema.
MAX_SCHEMA_DEPTH = 64
MAX_COUNT = Limits.max_repetition
MAX_GRAMMAR_CHARS = Limits.max_chars

# In a rule's body: literals and classes (skipped), and the rule names left.
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]')
_NAME = re.compile(r"[a-zA-Z0-9-]+")

# Keywords that only annotate; they never narrow what validates.
_ANNOTATIONS = {"title", "description", "$schema", "$id", "$comment", "examples", "default",
                "deprecated", "readOnly", "writeOnly", "$defs", "definitions", "strict",
                "additionalItems", "unevaluatedProperties"}
_HANDLED = {"type", "enum", "const", "properties", "required", "additionalProperties", "items",
            "prefixItems", "minItems", "maxItems", "minLength", "maxLength", "format",
            "anyOf", "oneOf", "allOf", "$ref", "minimum", "maximum", "exclusiveMinimum",
            "exclusiveMaximum", "nullable", "pattern", "propertyNames"}


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
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, RecursionError) as e:
        raise SchemaError("a value in the schema cannot be written as JSON: %s" % e)
    return literal(text)


def _count(schema, key, default=None):
    """A non-negative integer keyword (minLength, maxItems, ...), or ``default``."""
    v = schema.get(key, default)
    if v is default:
        return v
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise SchemaError("'%s' must be a non-negative integer, got %s" % (key, _short(v)))
    return v


def _number(schema, key):
    """A numeric keyword (minimum, ...), or None; booleans and strings are refused."""
    v = schema.get(key)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or \
            (isinstance(v, float) and not math.isfinite(v)):
        raise SchemaError("'%s' must be a number, got %s" % (key, _short(v)))
    return v


def _short(v):
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _strings(value, key):
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise SchemaError("'%s' must be an array of strings" % key)
    return value


class Grammar:
    """A set of GBNF rules being built; ``text()`` gives the grammar.

    ``strict`` False: what cannot be expressed is dropped (see the module's
    docstring), not refused.
    """

    def __init__(self, root_schema=None, strict=True):
        self.rules = {"space": SPACE}
        self.strict = strict
        self.root_schema = root_schema if isinstance(root_schema, dict) else {}
        self._refs = {}
        self._depth = 0
        self._size = len(SPACE)
        self._keys = {}         # (name, body) -> the key add() gave them
        self._next = {}         # name -> the last number add() appended to it

    # -- rules ----------------------------------------------------------------
    def add(self, name, body):
        """Add a rule; a different rule of the same name gets a numbered name.

        Names are held to 64 characters and numbered from a counter, so a
        schema with thousands of similar names stays linear.
        """
        name = (re.sub(r"[^a-zA-Z0-9-]+", "-", name) or "r")[:64]
        for key in (name, self._keys.get((name, body))):
            if key is not None and self.rules.get(key) == body:
                return key
        key, i = name, self._next.get(name, 0)
        while key in self.rules:
            i += 1
            key = "%s%d" % (name, i)
        self._next[name] = i
        self._size += len(key) + len(body) + 6
        if self._size > MAX_GRAMMAR_CHARS:
            raise SchemaError("the schema's grammar would exceed %d characters"
                              % MAX_GRAMMAR_CHARS)
        self._keys[(name, body)] = key
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
    def unsupported(self, what):
        """A constraint that cannot be expressed: SchemaError when strict, else
        a debug line (the constraint is dropped and the caller goes on without it)."""
        if self.strict:
            raise SchemaError(what)
        log.debug("tool schema: %s; dropped", what)

    def schema(self, schema, name):
        """The name of a rule matching JSON valid against ``schema`` (plus trailing space)."""
        self._depth += 1
        saved = None if self.strict else self._snapshot()
        try:
            if self._depth > MAX_SCHEMA_DEPTH:
                raise SchemaError("the schema nests more than %d levels deep" % MAX_SCHEMA_DEPTH)
            return self._schema(schema, name)
        except SchemaError as e:
            if saved is None:
                raise
            # lenient: this part of the schema becomes "any value", and what it
            # added is taken back (a rule may be half built)
            self._restore(saved)
            log.debug("tool schema: %s; any value accepted there", e)
            return self.primitive("value")
        finally:
            self._depth -= 1

    def _snapshot(self):
        # rules and refs are only ever added inside a schema() call (a ref's own
        # reserved rule is filled in there too), and dicts keep insertion order:
        # what a failed part added is the tail, taken back in its own length of
        # time, not the whole table's (a schema of thousands of parts stays linear)
        return len(self.rules), len(self._refs), self._size

    def _restore(self, saved):
        n_rules, n_refs, self._size = saved
        while len(self.rules) > n_rules:
            self.rules.popitem()
        while len(self._refs) > n_refs:
            self._refs.popitem()

    def _schema(self, schema, name):
        if schema is True or schema == {} or schema is None:
            return self.primitive("value")
        if schema is False:
            raise SchemaError("a schema of false matches nothing")
        if not isinstance(schema, dict):
            raise SchemaError("a schema must be an object, got %r" % (schema,))
        for key in schema:
            if key not in _HANDLED and key not in _ANNOTATIONS:
                self.unsupported("JSON schema keyword %r is not supported" % key)

        if "$ref" in schema:
            return self._ref(schema["$ref"])
        if "const" in schema:
            return self.add(name, json_literal(schema["const"]) + " space")
        if "enum" in schema:
            values = schema["enum"]
            if isinstance(values, list) and len(values) > MAX_GRAMMAR_CHARS // 4:
                raise SchemaError("'enum' has %d values; the limit is %d"
                                  % (len(values), MAX_GRAMMAR_CHARS // 4))
            if not isinstance(values, list) or not values:
                raise SchemaError("'enum' must be a non-empty array")
            texts = [json_literal(v)[1:-1] for v in values]     # escaped, unquoted
            return self.add(name, "(%s) space" % self._choice(texts, name + "-enum"))
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
        if types is not None and not isinstance(types, str):
            if not isinstance(types, list) or not types or \
                    not all(isinstance(t, str) for t in types):
                raise SchemaError("'type' must be a string or a non-empty array of strings")
        if not isinstance(schema.get("nullable", False), bool):
            raise SchemaError("'nullable' must be true or false")
        if isinstance(types, list):
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
            return self._number(schema, name)
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
            if isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
                continue
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
        parts = schema["allOf"]
        if not isinstance(parts, list) or not parts:
            raise SchemaError("'allOf' must be a non-empty array")
        for part in parts:
            if not isinstance(part, dict) or part.get("type", "object") != "object":
                raise SchemaError("'allOf' is supported only for object schemas")
            props = part.get("properties", {})
            if not isinstance(props, dict):
                raise SchemaError("'properties' must be an object")
            merged["properties"].update(props)
            merged["required"] += [r for r in _strings(part.get("required", []), "required")
                                   if r not in merged["required"]]
        return merged

    def _object(self, schema, name):
        props = schema.get("properties")
        props = {} if props is None else props
        required = schema.get("required")
        required = [] if required is None else required
        additional = schema.get("additionalProperties")
        if not isinstance(props, dict):
            raise SchemaError("'properties' must be an object")
        _strings(required, "required")
        if not isinstance(additional, (bool, dict)) and additional is not None:
            raise SchemaError("'additionalProperties' must be a boolean or a schema")
        key_schema = self._property_names(schema.get("propertyNames"), props)
        if key_schema is False:
            key_schema, additional = None, False
        elif key_schema is not None and additional is None:
            additional = True               # why else say what the other names look like
        if not props and additional is None:
            return self.primitive("object")         # any object
        missing = [k for k in required if k not in props]
        if missing:
            if self.strict:
                raise SchemaError("required properties %s have no schema in 'properties'"
                                  % missing)
            props = dict(props, **{k: {} for k in missing})     # required, of any value
        kv = {}
        for key, sub in props.items():
            value = self.schema(sub, "%s-%s" % (name, key))
            kv[key] = self.add("%s-%s-kv" % (name, key), "%s space \":\" space %s"
                               % (json_literal(key), value))
        req = [k for k in props if k in required]
        opt = [kv[k] for k in props if k not in required]
        if additional not in (None, False):
            value = self.primitive("value") if additional is True else \
                self.schema(additional, name + "-additional-value")
            if key_schema is not None:
                key_rule = self.schema(key_schema, name + "-additional-k")
            elif props:
                key_rule = self._not_strings(list(props), name + "-additional-k")
            else:
                key_rule = self.primitive("string")
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

    def _property_names(self, names, props):
        """The schema other keys are held to (``propertyNames``), None for any
        key, False for none but the declared properties.

        Keys are strings, so it is read as a string schema.  Declared
        properties are not checked against it, and apart from an ``enum``
        (whose declared names are taken out) the other keys it allows may
        repeat a declared one.
        """
        if names is None or names is True or names == {}:
            return None
        if not isinstance(names, dict):
            raise SchemaError("'propertyNames' must be a schema (an object)")
        if names.get("type", "string") != "string":
            self.unsupported("'propertyNames' of type %r is not supported (keys are strings)"
                             % (names.get("type"),))
            return None
        names = dict(names, type="string")
        if isinstance(names.get("enum"), list):
            left = [v for v in names["enum"] if isinstance(v, str) and v not in props]
            if not left:
                return False                # no name but the declared ones
            names["enum"] = left
        return names

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

    def _choice(self, texts, name):
        """GBNF for exactly one of ``texts`` (GBNF-escaped literal bodies), as a
        radix tree: one rule per branch point, so libllama keeps one parse stack
        per distinct next character, not one per value.  A flat ``"a" | "b" |
        ...`` of 2,000 values costs it 25 s a token; this, well under one.
        """
        trie = {}
        for t in texts:
            node = trie
            for c in _escaped_chars(t):
                node = node.setdefault(c, {})
            node[""] = {}
        nodes, edges = [trie], []
        for node in nodes:
            out = []
            for c in sorted(k for k in node if k):
                label, child = c, node[c]
                while len(child) == 1 and "" not in child:     # a chain: one literal
                    (k, child), = child.items()
                    label += k
                if any(child):
                    nodes.append(child)
                out.append((label, child, len(nodes) - 1 if any(child) else None))
            edges.append(out)
        names = {}
        for k in range(len(nodes) - 1, -1, -1):
            alts = []
            for label, child, cid in edges[k]:
                alt = '"%s"' % label
                if cid is not None:
                    alt += " %s%s" % (names[cid], "?" if "" in child else "")
                alts.append(alt)
            body = " | ".join(alts)
            if k == 0:
                return body
            names[k] = self.add("%s-%d" % (name, k), body)

    def _not_strings(self, words, name):
        """A JSON string that is none of ``words`` (keys of additional properties).

        The words form a trie; each node is its own rule (``name-N``), so a
        long key makes many small rules, never deep nesting or deep recursion.
        """
        char = self.primitive("char")
        trie = {}
        for w in words:
            node = trie
            for c in w:
                node = node.setdefault(c, {})
            node[""] = {}
        # number the nodes breadth-first, then write them deepest first
        nodes, ids = [trie], {id(trie): 0}
        for node in nodes:
            for c, child in node.items():
                if c != "":
                    ids[id(child)] = len(nodes)
                    nodes.append(child)
        names = {}
        for k in range(len(nodes) - 1, -1, -1):
            node = nodes[k]
            alts, rejects = [], ""
            for c, child in sorted(node.items()):
                if c == "":
                    continue
                rejects += c
                cls = _class_char(c)
                if any(x != "" for x in child):
                    inner = names[ids[id(child)]]
                    alts.append("[%s] %s%s" % (cls, inner, "?" if "" in child else ""))
                else:
                    alts.append("[%s] %s+" % (cls, char))
            neg = "".join(_class_char(c) for c in rejects)
            alts.append('[^"%s] %s*' % (neg, char))
            if k:
                names[k] = self.add("%s-%d" % (name, k), " | ".join(alts))
            else:
                top = " | ".join(alts)
        body = '"\\"" ( %s )%s "\\"" space' % (top, "" if "" in trie else "?")
        return self.add(name, body)

    def _array(self, schema, name):
        lo, hi = self._counts(schema, "minItems", "maxItems")
        items = schema.get("items")
        prefix = schema.get("prefixItems")
        if prefix is not None and not isinstance(prefix, list):
            raise SchemaError("'prefixItems' must be an array of schemas")
        if isinstance(items, list):
            prefix, items = items, None
        if prefix is not None:
            rules = [self.schema(s, "%s-%d" % (name, i)) for i, s in enumerate(prefix)]
            body = '"[" space ' + ' "," space '.join(rules) + ' "]" space'
            return self.add(name, body)
        item = self.schema(items, name + "-item") if items not in (None, True, {}) \
            else self.primitive("value")
        if hi == 0:
            return self.add(name, '"[" space "]" space')
        more = _repeat('"," space %s' % item, max(lo - 1, 0), None if hi is None else hi - 1)
        seq = "%s %s" % (item, more)
        body = '"[" space %s "]" space' % (seq if lo > 0 else "( %s )?" % seq)
        return self.add(name, body)

    def _string(self, schema, name):
        fmt = schema.get("format")
        if fmt is not None and not isinstance(fmt, str):
            raise SchemaError("'format' must be a string")
        lengths = "minLength" in schema or "maxLength" in schema
        if "pattern" in schema:
            rule = self._pattern(schema, name, fmt in ("date", "time", "date-time", "uuid")
                                 or lengths)
            if rule is not None:
                return rule
        if fmt in ("date", "time", "date-time"):
            return self.primitive(fmt + "-string")
        if fmt == "uuid":
            return self.primitive("uuid")
        lo, hi = self._counts(schema, "minLength", "maxLength")
        if lo == 0 and hi is None:
            return self.primitive("string")
        if hi is not None and hi > MAX_STRING_REPEAT >= lo:
            # held lower than other counts: libllama expands char{0,n} into n
            # nested rules, and sampling under n = 2000 grew the worker by
            # over 200 MB (tests/test_hostile.py); shorter strings still validate
            hi = MAX_STRING_REPEAT
        char = self.primitive("char")
        return self.add(name, '"\\"" %s "\\"" space' % _repeat(char, lo, hi))

    def _pattern(self, schema, name, also_constrained):
        """The rule of a string held to its ``pattern``, or None when the pattern
        is dropped (lenient) for the string's other keywords to apply."""
        pattern = schema["pattern"]
        try:
            if also_constrained:
                # a regular language intersected with a length or a format is
                # not something this builder writes
                raise PatternError("with a format, minLength or maxLength too")
            body = pattern_body(pattern, self)
        except PatternError as e:
            self.unsupported("JSON schema 'pattern' %s is not supported: %s"
                             % (_short(pattern), e))
            return None
        # the pattern alone, checked as a grammar: a pattern that would make
        # the whole grammar fail libllama's limits fails here, by name
        rule = self.add(name, '"\\"" %s "\\"" space' % body)
        try:
            check(self._excerpt(rule))
        except GrammarError as e:
            self.unsupported("JSON schema 'pattern' %s makes too large a grammar: %s"
                             % (_short(pattern), e))
            del self.rules[rule]
            return None
        return rule

    def _excerpt(self, rule):
        """The grammar of one rule and those it uses, as text (for a check)."""
        seen, todo = {}, [rule]
        while todo:
            r = todo.pop()
            if r in seen or r not in self.rules:
                continue
            seen[r] = self.rules[r]
            todo += _NAME.findall(_QUOTED.sub(" ", seen[r]))
        text = "root ::= %s\n" % rule
        return text + "".join("%s ::= %s\n" % kv for kv in seen.items())

    @staticmethod
    def _counts(schema, low_key, high_key):
        """(min, max or None) of a minLength/maxLength-style pair, checked.

        A maximum above libllama's repetition limit is held to it (every
        output still validates); a minimum above it cannot be met.
        """
        lo = _count(schema, low_key, 0)
        hi = _count(schema, high_key)
        if hi is not None and hi < lo:
            raise SchemaError("'%s' is below '%s'" % (high_key, low_key))
        if lo > MAX_COUNT:
            raise SchemaError("'%s' above %d is not supported" % (low_key, MAX_COUNT))
        if hi is not None:
            hi = min(hi, MAX_COUNT)
        return lo, hi

    def _number(self, schema, name):
        """A number within its bounds, where a grammar can hold them exactly
        (``_number_range``); without any bound, any JSON number."""
        if isinstance(schema.get("exclusiveMinimum"), bool) or \
                isinstance(schema.get("exclusiveMaximum"), bool):
            self.unsupported("boolean exclusiveMinimum/exclusiveMaximum (draft 4) is not "
                             "supported")
            return self.primitive("number")
        bounds = [_number(schema, k) for k in ("minimum", "exclusiveMinimum", "maximum",
                                               "exclusiveMaximum")]
        if all(b is None for b in bounds):
            return self.primitive("number")
        lo, xlo, hi, xhi = bounds
        # the tighter of each pair; equal ones: the exclusive
        low = max([(v, k) for v, k in ((lo, 0), (xlo, 1)) if v is not None], default=None)
        high = min([(v, -k) for v, k in ((hi, 0), (xhi, 1)) if v is not None], default=None)
        body = _number_range(low and (low[0], bool(low[1])), high and (high[0], bool(-high[1])))
        if body is None:
            self.unsupported("number bounds %s are not supported (a grammar holds a number "
                             "to whole-number bounds, and a range at least 1 wide)"
                             % ", ".join("'%s'" % k for k, v in zip(
                                 ("minimum", "exclusiveMinimum", "maximum",
                                  "exclusiveMaximum"), bounds) if v is not None))
            return self.primitive("number")
        if body is False:
            raise SchemaError("the number bounds leave no number")
        self.primitive("decimal-part")
        return self.add(name, "(%s) space" % body)

    def _integer(self, schema, name):
        xlo, xhi = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
        if isinstance(xlo, bool) or isinstance(xhi, bool):
            self.unsupported("boolean exclusiveMinimum/exclusiveMaximum (draft 4) is not "
                             "supported")
            return self.primitive("integer")
        lo, hi = _number(schema, "minimum"), _number(schema, "maximum")
        xlo, xhi = _number(schema, "exclusiveMinimum"), _number(schema, "exclusiveMaximum")
        for v in (lo, hi, xlo, xhi):
            if v is not None and abs(v) >= _LIMIT:
                self.unsupported("integer bounds beyond %d digits are not supported"
                                 % _MAX_DIGITS)
                return self.primitive("integer")
        # an exclusive bound on a fraction: the nearest whole number inside it
        if xlo is not None:
            xlo = math.floor(xlo)
        if xhi is not None:
            xhi = math.ceil(xhi)
        if xlo is not None:
            lo = max(lo, xlo + 1) if lo is not None else xlo + 1
        if xhi is not None:
            hi = min(hi, xhi - 1) if hi is not None else xhi - 1
        if lo is None and hi is None:
            return self.primitive("integer")
        lo = None if lo is None else math.ceil(lo)
        hi = None if hi is None else math.floor(hi)
        if lo is not None and hi is not None and lo > hi:
            raise SchemaError("'minimum' is above 'maximum'")
        return self.add(name, "(%s) space" % _int_range(lo, hi))


def _escaped_chars(body):
    """The characters of a GBNF literal body, each escape kept whole."""
    out, i = [], 0
    while i < len(body):
        j = i + (4 if body.startswith("\\x", i) else 2 if body[i] == "\\" else 1)
        out.append(body[i:j])
        i = j
    return out


def _class_char(c):
    return "\\" + c if c in "]\\^-" else c


# The longest maxLength a string is held to (see _string).
MAX_STRING_REPEAT = 1000


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
_LIMIT = 10 ** _MAX_DIGITS


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


# -- number ranges: a whole-number part and a fraction --------------------------------

_ANY_FRACTION = '("." decimal-part)?'
_ZERO_FRACTION = '("." [0]{1,16})?'
_SOME_FRACTION = '"." [0-9]{0,15} [1-9]'


def _number_range(low, high):
    """GBNF for JSON numbers (no exponent) between ``low`` and ``high``, each
    (value, exclusive) or None; None if the range cannot be held exactly
    enough, False if it is empty.

    A number is its whole part and a fraction.  Every number written
    validates; some valid ones cannot be written: with a bound that is not a
    whole number the part between it and the next whole number inward is
    left out, and a range with no whole number in it (0.2 to 0.8) is None.
    """
    if low is not None and high is not None:
        if low[0] > high[0] or (low[0] == high[0] and (low[1] or high[1])):
            return False
    for bound in (low, high):
        if bound is not None and abs(bound[0]) >= _LIMIT:
            return None
    alts = []
    # x >= 0 (or > 0 when the low bound is 0 exclusive)
    if high is None or high[0] > 0 or (high[0] == 0 and not high[1]):
        plow = low if low is not None and low[0] >= 0 else (0, False)
        part = _magnitude(plow, high)
        if part:
            alts.append(part)
    # x < 0: its magnitude m = -x, from (0 or -high) up to -low
    if low is None or low[0] < 0:
        mlow = (-high[0], high[1]) if high is not None and high[0] < 0 else (0, True)
        mhigh = None if low is None else (-low[0], low[1])
        part = _magnitude(mlow, mhigh)
        if part:
            alts.append('"-" (%s)' % part)
    if not alts:
        return None
    return " | ".join(alts)


def _magnitude(low, high):
    """GBNF for non-negative numbers m with low <= m <= high (low = (value,
    exclusive), value >= 0; high None: unbounded), or "" if it cannot be held."""
    a, a_excl = low
    whole_a = float(a).is_integer()
    first = int(math.ceil(a))               # the smallest whole part
    # the whole part ``first`` itself with any fraction, unless a excluded it
    # (then only with a fraction that is not zero)
    first_any = not (whole_a and a_excl)
    if high is None:
        last_any, top = None, None              # unbounded: any whole part from first on
    else:
        b, b_excl = high
        if float(b).is_integer():
            b = int(b)
            last_any = b - 1                    # whole parts below b: any fraction
            top = None if b_excl else b         # b itself: only with a zero fraction
        else:
            last_any = int(math.floor(b)) - 1
            top = int(math.floor(b))            # below b: with a zero fraction
        if top is not None and (top < first or (top == first and not first_any)):
            top = None
    alts = []
    lo_any = first if first_any else first + 1
    if not first_any and (last_any is None or first <= last_any):
        alts.append("%s %s" % (literal(str(first)), _SOME_FRACTION))
    if last_any is None or lo_any <= last_any:
        alts.append("(%s) %s" % (_nonneg_range(lo_any, last_any), _ANY_FRACTION))
    if top is not None:
        alts.append("%s %s" % (literal(str(top)), _ZERO_FRACTION))
    return " | ".join(alts)


def schema_to_grammar(schema, strict=True):
    """GBNF text for JSON that validates against ``schema`` (a dict, True or {});
    ``strict`` False drops what cannot be expressed (see the module's docstring)."""
    g = Grammar(schema, strict)
    g.rules["root"] = g.schema(schema, "root-value") if schema not in (True, {}) else None
    if g.rules["root"] is None:
        g.rules["root"] = g.primitive("object")
    return g.text()
