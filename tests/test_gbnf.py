"""The GBNF check (offgrid/chat/gbnf.py) that every grammar passes before libllama.

Accepted: llama.cpp's own example grammars and everything offgrid's JSON-schema
converter and tool-call grammars emit; each of those libllama builds too, so
the check is not stricter than the syntax.  Refused, with a message naming the
problem: the grammars that abort, overflow, hang or exhaust libllama.  The
model facts come from the real gemma-3-270m.
"""

import time

import pytest

from offgrid import libllama
from offgrid.chat.gbnf import GrammarError, Limits, VocabFacts, check, check_grammar, facts_of
from offgrid.chat.jsonschema import SchemaError, schema_to_grammar
from offgrid.chat.template import Tool, tool_call_grammar
from offgrid.errors import InvalidRequest


def libllama_accepts(model, grammar):
    ptr = libllama.init_grammar_sampler(model.lib, model.handle.vocab, grammar)
    if ptr:
        model.lib.llama_sampler_free(ptr)
    return bool(ptr)


# -- accepted ------------------------------------------------------------------

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name"]},
    {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 5},
    {"type": "string", "minLength": 2, "maxLength": 2},
    {"type": "string", "format": "date-time"},
    {"type": "integer", "minimum": -40, "exclusiveMaximum": 1000},
    {"enum": ["red", "green", "blue", None, 3]},
    {"anyOf": [{"type": "string"}, {"type": "null"}]},
    {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True},
    {"type": "object", "properties": {"abc": {}, "abd": {}}, "additionalProperties":
     {"type": "integer"}},
    {"$defs": {"node": {"type": "object", "required": ["v"], "properties": {
        "v": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}}}}, "$ref": "#/$defs/node"},
    {"type": "object", "properties": {"p%d" % i: {"type": "string", "maxLength": 500}
                                      for i in range(60)}},
]

WEATHER = Tool("get_weather", "Weather for a city", {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "unit": {"enum": ["c", "f"]}}, "required": ["city"]})
CLOCK = Tool("get_time", "Time in a zone", {
    "type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}}, "required": ["tz"]})
SYNTAXES = ["hermes", "llama3", "mistral", "mistral-args", "mistral-callid", "harmony", "generic"]


def test_llama_cpp_example_grammars_pass(gemma, llama_src):
    files = sorted((llama_src / "grammars").glob("*.gbnf"))
    assert len(files) >= 8
    for path in files:
        text = path.read_text()
        check(text, facts_of(gemma))
        assert libllama_accepts(gemma, text), path.name


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: str(s)[:40])
def test_schema_grammars_pass_and_libllama_builds_them(gemma, schema):
    grammar = schema_to_grammar(schema)
    check_grammar(gemma, grammar)
    assert libllama_accepts(gemma, grammar)


@pytest.mark.parametrize("syntax", SYNTAXES)
def test_tool_call_grammars_pass_and_libllama_builds_them(gemma, syntax):
    for choice, parallel in (("required", False), ("required", True), ("get_time", False)):
        grammar = tool_call_grammar([WEATHER, CLOCK], syntax, choice, parallel)
        check_grammar(gemma, grammar)
        assert libllama_accepts(gemma, grammar)


@pytest.mark.parametrize("text", [
    'root ::= "a" | "b"  # a comment\n',
    'root ::= x{2} x{0,3} x{1,} x*\nx ::= [a-z\\-]\n',
    'root ::= [^\\x00-\\x1F"] . "\\u00e9\\U0001F600"\n',
    'root ::= (\n  "a"\n  | "b"\n)+\n',
    'root ::= <[105]> "hi" !<[1]>\n',
    'root ::= <start_of_turn> "x"\n',
    'root ::= "" "a"\nunused ::= "b"\n',
])
def test_valid_syntax_passes_and_libllama_agrees(gemma, text):
    check(text, facts_of(gemma))
    assert libllama_accepts(gemma, text)


# -- refused -------------------------------------------------------------------

def _chain(n):
    return "root ::= r0\n" + "".join("r%d ::= r%d\n" % (i, i + 1) for i in range(n)) + \
        'r%d ::= "a"\n' % n


HOSTILE = [
    ("nul class", "root ::= [\\x00]", "NUL"),
    ("nul literal", 'root ::= "a\\x00b"', "NUL"),
    ("raw nul", 'root ::= "a\x00"', "NUL"),
    ("token past vocabulary", "root ::= <[999999]>", "outside the vocabulary"),
    ("token past uint32", "root ::= <[4294967295]>", "outside the vocabulary"),
    ("token past uint64", "root ::= <[99999999999999999999999]>", "outside the vocabulary"),
    ("not one token", "root ::= <not a token at all>", "not a single token"),
    ("deep groups", "root ::= " + "(" * 20000 + '"a"' + ")" * 20000, "nested more than"),
    ("chain of 100,000 rules", _chain(100000), "characters"),
    ("chain of 5,000 leading rules", _chain(5000), "each starting with the next"),
    ("inverted repetition", 'root ::= "x"{3,2}', "minimum above its maximum"),
    ("repetition past threshold", 'root ::= "x"{0,2001}', "above 2000"),
    ("minimum past threshold", 'root ::= "x"{2001,}', "above 2000"),
    ("repetition of repetitions", 'root ::= "x"{50}{50}', "libllama's limit"),
    ("undefined rule", 'root ::= "a" missing', "'missing' is used but never defined"),
    ("no root", 'start ::= "a"', "no 'root' rule"),
    ("left recursion", 'root ::= root "a" | "a"', "left-recursive"),
    ("empty body repeated", 'root ::= ("a"?)*', "repeated without bound"),
    ("beyond unicode", 'root ::= "\\UFFFFFFFF"', "beyond Unicode"),
    ("empty range", "root ::= [z-a]", "is empty"),
    ("unknown escape", 'root ::= "\\q"', "unknown escape"),
    ("unclosed group", 'root ::= ("a"', "expecting ')'"),
    ("unterminated literal", 'root ::= "abc', "unterminated"),
    ("nothing to repeat", "root ::= *", "needs something before it"),
    ("exponential leading paths",
     "root ::= r0\n" + "".join("r%d ::= r%d | r%d\n" % (i, i + 1, i + 1) for i in range(40))
     + 'r40 ::= "a"\n', "paths of leading references"),
    ("too long", 'root ::= "' + "a" * (Limits.max_chars + 1) + '"', "characters"),
]


@pytest.mark.parametrize("name, text, words", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_grammar_is_refused_with_a_reason(gemma, name, text, words):
    t0 = time.perf_counter()
    with pytest.raises(GrammarError) as e:
        check_grammar(gemma, text)
    assert words in str(e.value)
    assert time.perf_counter() - t0 < 2.0


def test_grammar_error_is_a_client_error():
    assert issubclass(GrammarError, InvalidRequest)


def test_an_end_of_generation_token_cannot_be_required(gemma):
    eos = gemma.eos
    assert gemma.is_eog(eos)
    with pytest.raises(GrammarError, match="ends generation"):
        check_grammar(gemma, "root ::= <[%d]>" % eos)
    check_grammar(gemma, "root ::= !<[%d]>" % eos)     # anything but it is fine


def test_error_names_line_and_column(gemma):
    with pytest.raises(GrammarError) as e:
        check_grammar(gemma, 'root ::= a\na ::= "x" \n  b ::= "\\q"\n')
    assert "line 3 column" in str(e.value)


def test_a_character_no_token_starts_with_is_refused():
    facts = VocabFacts(1000, first_bytes=b"abc")
    check('root ::= [a-z] "b"', facts)
    with pytest.raises(GrammarError, match="no token"):
        check("root ::= [x-z]", facts)
    with pytest.raises(GrammarError, match="no token"):
        check('root ::= "xa"', facts)
    with pytest.raises(GrammarError, match="no token"):
        check("root ::= [^a-c]", facts)
    check("root ::= [^a]", facts)


def _flat(n):
    return "root ::= " + " | ".join('"v%d"' % i for i in range(n))


def test_a_flat_alternation_of_2000_literals_is_refused_for_its_cost(gemma):
    with pytest.raises(GrammarError, match="2000 alternatives at one point"):
        check_grammar(gemma, _flat(2000))


def test_an_enum_of_20000_values_is_a_tree_cheap_to_sample(gemma):
    grammar = schema_to_grammar({"enum": ["value%d" % i for i in range(20000)]})
    stats = check(grammar, facts_of(gemma))
    assert stats.frontier <= 16                 # one stack per next character, not per value
    assert libllama_accepts(gemma, grammar)


def test_an_enum_too_big_for_a_grammar_is_a_schema_error():
    with pytest.raises(SchemaError, match="characters"):
        schema_to_grammar({"enum": ["value%d" % i for i in range(30000)]})


def test_a_small_enum_passes(gemma):
    check_grammar(gemma, schema_to_grammar({"enum": ["value%d" % i for i in range(100)]}))


def test_cost_limit_scales_with_the_vocabulary():
    with pytest.raises(GrammarError):
        check(_flat(500), VocabFacts(262144))
    check(_flat(500), VocabFacts(32000))


def test_model_facts_exclude_end_tokens_and_nul(gemma):
    facts = facts_of(gemma)
    assert facts is facts_of(gemma)          # computed once
    assert facts.n_vocab == gemma.n_vocab
    assert gemma.eos in facts.eog
    assert 0 not in facts.first_bytes
    assert ord("a") in facts.first_bytes


def test_deep_nesting_costs_no_python_recursion():
    text = "root ::= " + "(" * 40000 + '"a"' + ")" * 40000
    t0 = time.perf_counter()
    with pytest.raises(GrammarError):
        check(text)
    assert time.perf_counter() - t0 < 0.5


# -- JSON schemas: malformed keywords are 400s, never 500s -------------------------

@pytest.mark.parametrize("schema, words", [
    ({"type": "string", "minLength": "5"}, "'minLength' must be a non-negative integer"),
    ({"type": "string", "maxLength": -1}, "'maxLength' must be a non-negative integer"),
    ({"type": "number", "exclusiveMinimum": "5"}, "exclusiveMinimum"),
    ({"type": "integer", "exclusiveMinimum": "5"}, "'exclusiveMinimum' must be a number"),
    ({"type": "integer", "minimum": True}, "'minimum' must be a number"),
    ({"type": "object", "required": [{"x": 1}]}, "'required' must be an array of strings"),
    ({"type": "integer", "maximum": int("9" * 1500)}, "beyond 16 digits"),
    ({"type": "integer", "minimum": 1e300}, "beyond 16 digits"),
    ({"type": "string", "minLength": 3, "maxLength": 2}, "'maxLength' is below 'minLength'"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, "'maxItems' is below 'minItems'"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "'minimum' is above 'maximum'"),
    ({"type": "string", "minLength": 5000}, "above 2000"),
    ({"type": "array", "minItems": "1"}, "'minItems' must be a non-negative integer"),
    ({"type": 5}, "'type' must be a string"),
    ({"type": "string", "format": 7}, "'format' must be a string"),
    ({"type": "object", "properties": []}, "'properties' must be an object"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": 3},
     "'additionalProperties'"),
    ({"allOf": {"type": "object"}}, "'allOf' must be a non-empty array"),
    ({"type": "array", "prefixItems": {"type": "string"}}, "'prefixItems'"),
    ({"enum": ["x"] * 70000}, "'enum' has 70000 values"),
])
def test_malformed_schema_is_a_schema_error(schema, words):
    with pytest.raises(SchemaError) as e:
        schema_to_grammar(schema)
    assert words in str(e.value)


def test_deeply_nested_schema_is_a_schema_error():
    schema = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(SchemaError, match="nests more than"):
        schema_to_grammar(schema)


def test_a_long_property_name_beside_additional_properties_is_no_crash(gemma):
    schema = {"type": "object", "properties": {"k" * 5000: {"type": "string"}},
              "additionalProperties": True}
    try:
        grammar = schema_to_grammar(schema)
    except SchemaError:
        return                                  # refused as too big: a 400 is fine
    check_grammar(gemma, grammar)


def test_a_long_property_name_of_realistic_size_works(gemma):
    schema = {"type": "object", "properties": {"k" * 300: {"type": "string"}},
              "additionalProperties": True}
    grammar = schema_to_grammar(schema)
    check_grammar(gemma, grammar)
    assert libllama_accepts(gemma, grammar)


@pytest.mark.parametrize("lo, hi", [(0, 0), (0, 3), (2, 2), (3, 2000), (1, 100000)])
def test_string_lengths_never_emit_an_inverted_repetition(gemma, lo, hi):
    grammar = schema_to_grammar({"type": "string", "minLength": lo, "maxLength": hi})
    check_grammar(gemma, grammar)               # refuses {m,n} with m > n or n > 2000
    assert libllama_accepts(gemma, grammar)
