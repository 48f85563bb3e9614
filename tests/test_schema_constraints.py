"""JSON schema constraints as grammar: ``pattern``, number bounds, ``propertyNames``,
and the lenient mode tool schemas get (offgrid/chat/jsonschema.py, regex_gbnf.py).

The grammars are checked for exactness by reading them back as Python regular
expressions (the subset they use: literals, classes, groups, repetition) and
comparing, string by string, with what the schema means: a JSON text is in
the grammar exactly when its value validates.
"""

import json
import random
import re

import pytest

from offgrid.chat.gbnf import check
from offgrid.chat.jsonschema import SchemaError, schema_to_grammar
from offgrid.chat.regex_gbnf import PatternError, pattern_body


# -- GBNF (the subset these grammars use) read back as a Python regex --------------------

_TOKEN = re.compile(r'\s*(?:("(?:[^"\\]|\\.)*")|(\[(?:[^\]\\]|\\.)*\])|([a-zA-Z0-9-]+)'
                    r'|(\{\d*,?\d*\})|([()|*+?]))')


def _unescape(body):
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        n = body[i + 1]
        if n in "xuU":
            k = {"x": 2, "u": 4, "U": 8}[n]
            out.append(chr(int(body[i + 2:i + 2 + k], 16)))
            i += 2 + k
        else:
            out.append({"n": "\n", "t": "\t", "r": "\r"}.get(n, n))
            i += 2
    return "".join(out)


def _class(text):
    inner = text[1:-1]
    neg = inner.startswith("^")
    if neg:
        inner = inner[1:]
    out, i = [], 0
    while i < len(inner):
        c = inner[i]
        if c == "\\":
            n = inner[i + 1]
            if n in "xuU":
                k = {"x": 2, "u": 4, "U": 8}[n]
                cp = int(inner[i + 2:i + 2 + k], 16)
                out.append("\\U%08X" % cp)
                i += 2 + k
                continue
            out.append(re.escape({"n": "\n", "t": "\t", "r": "\r"}.get(n, n)))
            i += 2
            continue
        out.append("-" if c == "-" else re.escape(c))
        i += 1
    return "[" + ("^" if neg else "") + "".join(out) + "]"


def to_regex(expr, rules, depth=0):
    assert depth < 30
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        assert m and m.end() > pos, expr[pos:]
        pos = m.end()
        lit, cls, name, count, op = m.groups()
        if lit is not None:
            out.append(re.escape(_unescape(lit[1:-1])))
        elif cls is not None:
            out.append(_class(cls))
        elif name == "VALUE":
            out.append("(?:%s)" % _VALUE)
        elif name is not None:
            out.append("(?:%s)" % to_regex(rules[name], rules, depth + 1))
        elif count is not None:
            out.append(count)
        else:
            out.append(op if op != "(" else "(?:")
    return "".join(out)


# Any JSON value (recursive in the grammar): scalars and flat arrays and objects here.
_VALUE = r'"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?|true|false|null|\[[^\[\]{}]*\]|\{[^\[\]{}]*\}'


def grammar_regex(grammar):
    rules = dict(line.split(" ::= ", 1) for line in grammar.strip().splitlines())
    rules["space"] = r'" "?'          # one space or none: what these tests write
    rules["value"] = "VALUE"
    return re.compile(to_regex(rules["root"], rules), re.S)


def py_search(pattern, s):
    """ECMAScript's search with Python's re (named groups spelt its way)."""
    pattern = re.sub(r"\(\?<([A-Za-z_]\w*)>", r"(?P<\1>", pattern)
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1] + r"\Z"      # Python's $ also matches before a last newline
    return re.search(pattern, s) is not None


def json_text(value):
    return json.dumps(value, ensure_ascii=False)


# -- pattern -------------------------------------------------------------------------

PATTERNS = [
    ("^wf_[a-z0-9-]{6,}$", ["wf_abcdef", "wf_abc-de-1", "wf_abc", "xwf_abcdef", "wf_ABCDEF"]),
    ("^[A-Z]{2}\\d{3}$", ["AB123", "ab123", "AB12", "AB1234", "A1234"]),
    ("\\d", ["a1b", "abc", "1", ""]),
    ("^abc", ["abc", "abcdef", "xabc"]),
    ("xyz$", ["xyz", "axyz", "xyza"]),
    ("^(red|green)(-dark)?$", ["red", "green-dark", "blue", "red-"]),
    ("^[^,]+$", ["a b", 'say "hi"', "back\\slash", "a,b", "new\nline", ""]),
    ("^.+$", ["x", "two words", "a\nb", 'q"uote', ""]),
    ("^\\S+@\\S+\\.\\w{2,}$", ["a@b.com", "a @b.com", "a@b.c"]),
    ("^(?:\\+|-)?\\d+(?:\\.\\d+)?$", ["+1.5", "-3", "1.", "abc"]),
    ("^\\\\d\\$$", ["\\d$", "d$"]),
    ("^[\\u00e0-\\u00ff]*$", ["\u00e9t\u00e9", "ete"]),
    ("^$", ["", "a"]),
    ("^(?<year>\\d{4})-\\d{2}$", ["2024-01", "24-01"]),
    ("^a{2}?b*?$", ["aa", "aabbb", "ab"]),
]


@pytest.mark.parametrize("pattern, samples", PATTERNS, ids=[p for p, _ in PATTERNS])
def test_pattern_grammar_is_exactly_the_pattern(pattern, samples):
    grammar = schema_to_grammar({"type": "string", "pattern": pattern})
    check(grammar)
    rx = grammar_regex(grammar)
    for s in samples:
        want = py_search(pattern, s)
        assert bool(rx.fullmatch(json_text(s))) == want, (pattern, s)


def test_pattern_random_strings_agree():
    """Random strings over a small alphabet, quotes and escapes included."""
    rng = random.Random(7)
    alphabet = 'ab1 ,."\\\n-_'
    for pattern in ("^[ab]+,[^,]*$", "^a.b$", "\\d-", '^"?[^"]+"?$', "^(a|bb|1)*\\.$"):
        rx = grammar_regex(schema_to_grammar({"type": "string", "pattern": pattern}))
        for _ in range(400):
            s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
            assert bool(rx.fullmatch(json_text(s))) == py_search(pattern, s), \
                (pattern, s)


@pytest.mark.parametrize("pattern, why", [
    ("^(?=a)a$", "lookaround"),
    ("^(a)\\1$", "escape \\1"),
    ("^a\\bb$", "escape \\b"),
    ("^a|b$", "one alternative"),
    ("^a^b$", "anchor"),
    ("^[]$", "class"),
    ("^(a$", "parenthesis"),
    ("^a{3000}$", "count"),
    ("^" + "(" * 30 + "a" + ")" * 30 + "$", "deeper"),
])
def test_inexpressible_patterns_say_why(pattern, why):
    with pytest.raises(PatternError) as e:
        pattern_body(pattern)
    assert why in str(e.value)
    with pytest.raises(SchemaError) as e:
        schema_to_grammar({"type": "string", "pattern": pattern})
    assert "pattern" in str(e.value)


def test_pattern_with_a_length_is_refused_strict_and_dropped_lenient():
    schema = {"type": "string", "pattern": "^[a-z]+$", "maxLength": 5}
    with pytest.raises(SchemaError, match="pattern"):
        schema_to_grammar(schema)
    rx = grammar_regex(schema_to_grammar(schema, strict=False))
    assert rx.fullmatch(json_text("abcde")) and not rx.fullmatch(json_text("abcdef"))
    assert rx.fullmatch(json_text("A1"))        # the pattern went, the length stayed


# -- number bounds ------------------------------------------------------------------

NUMBERS = ["0", "0.5", "1", "1.0", "1.25", "2", "-0.5", "-1", "-1.5", "-2", "10", "99.9",
           "100", "100.5", "-100", "0.000", "3.14159", "7", "-7.25"]


@pytest.mark.parametrize("bounds", [
    {"minimum": 0, "maximum": 1},
    {"exclusiveMinimum": 0},
    {"minimum": -1.5, "exclusiveMaximum": 2.5},
    {"maximum": 100},
    {"exclusiveMinimum": -2, "maximum": 10},
    {"minimum": 0.5},
    {"exclusiveMaximum": -1},
])
def test_number_bounds_hold_every_number_written(bounds):
    grammar = schema_to_grammar(dict({"type": "number"}, **bounds))
    check(grammar)
    rx = grammar_regex(grammar)

    def valid(x):
        return (x >= bounds.get("minimum", -1e99) and x <= bounds.get("maximum", 1e99)
                and x > bounds.get("exclusiveMinimum", -1e99)
                and x < bounds.get("exclusiveMaximum", 1e99))
    matched = [t for t in NUMBERS if rx.fullmatch(t)]
    assert matched, bounds
    for t in matched:
        assert valid(float(t)), (bounds, t)
    # whole numbers inside the bounds are never left out
    for t in NUMBERS:
        if float(t).is_integer() and "." not in t and valid(float(t)):
            assert t in matched, (bounds, t)


def test_number_bounds_too_narrow_for_a_grammar():
    schema = {"type": "number", "minimum": 0.2, "maximum": 0.8}
    with pytest.raises(SchemaError, match="minimum"):
        schema_to_grammar(schema)
    assert schema_to_grammar(schema, strict=False).startswith("root ::= number")


def test_claude_codes_read_tool_bounds():
    """Read's offset/limit: integers 0..2^53-1 and > 0 (sent as JSON Schema 2020-12)."""
    schema = {"type": "object", "required": ["file_path"], "additionalProperties": False,
              "properties": {
                  "file_path": {"type": "string"},
                  "offset": {"type": "integer", "minimum": 0, "maximum": 9007199254740991},
                  "limit": {"type": "integer", "exclusiveMinimum": 0,
                            "maximum": 9007199254740991}}}
    rx = grammar_regex(schema_to_grammar(schema))
    assert rx.fullmatch('{"file_path": "/a", "offset": 0, "limit": 10}')
    assert not rx.fullmatch('{"file_path": "/a", "limit": 0}')


# -- propertyNames ------------------------------------------------------------------

def test_property_names_hold_the_other_keys():
    schema = {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"},
              "additionalProperties": {"type": "string"}}
    rx = grammar_regex(schema_to_grammar(schema))
    assert rx.fullmatch('{"abc": "x", "de": "y"}')
    assert not rx.fullmatch('{"Abc": "x"}')
    assert not rx.fullmatch('{"abc": 1}')


def test_property_names_enum_leaves_out_the_declared():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}},
              "propertyNames": {"enum": ["a", "b", "c"]}}
    rx = grammar_regex(schema_to_grammar(schema))
    assert rx.fullmatch('{"a": 1, "b": true}')
    assert not rx.fullmatch('{"d": 1}')
    assert not rx.fullmatch('{"a": 1, "a": 2}')


# -- lenient: tool schemas never fail ----------------------------------------------

def test_lenient_mode_drops_what_it_cannot_express_and_keeps_the_rest():
    schema = {"type": "object", "required": ["n", "tags"], "properties": {
        "n": {"type": "integer", "multipleOf": 3, "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "uniqueItems": True, "items": {"enum": ["x", "y"]}},
        "when": {"if": {"type": "string"}, "then": {"minLength": 2}},
        "weird": {"type": "string", "pattern": "^(?=a)"},
    }}
    with pytest.raises(SchemaError, match="multipleOf"):
        schema_to_grammar(schema)
    grammar = schema_to_grammar(schema, strict=False)
    check(grammar)
    rx = grammar_regex(grammar)
    assert rx.fullmatch('{"n": 4, "tags": ["x", "x"]}')         # multipleOf, uniqueItems gone
    assert not rx.fullmatch('{"n": 12, "tags": ["x"]}')          # the bounds stay
    assert not rx.fullmatch('{"n": 4, "tags": ["z"]}')           # the enum stays
    assert rx.fullmatch('{"n": 4, "tags": [], "weird": "b"}')


def test_lenient_mode_turns_an_unreadable_part_into_any_value():
    schema = {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "strnig"}, "b": {"$ref": "#/nowhere"}, "c": {"type": "boolean"}},
        "required_too": True}
    grammar = schema_to_grammar(schema, strict=False)
    check(grammar)
    rx = grammar_regex(grammar)
    assert rx.fullmatch('{"a": [1, "x"], "c": true}')
    assert not rx.fullmatch('{"a": 1, "c": 3}')


def test_lenient_required_without_a_schema_is_any_value():
    schema = {"type": "object", "required": ["a", "b"], "properties": {"a": {"type": "string"}}}
    with pytest.raises(SchemaError, match="no schema"):
        schema_to_grammar(schema)
    rx = grammar_regex(schema_to_grammar(schema, strict=False))
    assert rx.fullmatch('{"a": "x", "b": [1]}') and not rx.fullmatch('{"a": "x"}')
