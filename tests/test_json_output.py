"""JSON output: schemas become grammars, and gemma-3-270m's output validates.

The converter is checked against libllama's GBNF parser for a spread of
schema features; then a real server constrains gemma-3-270m with
``response_format`` (through the openai client) and llama.cpp's
``json_schema`` field, and every reply must parse and validate.  The schemas
bound every string, array and number (and the grammar bounds whitespace), so
every reply has a finite worst-case length; max_tokens leaves room for what
the model writes here.  A reply cut off by max_tokens would not parse, which
is why finish_reason is checked too.
"""

import json

import openai
import pytest

from offgrid import libllama
from offgrid.chat.jsonschema import SchemaError, schema_to_grammar
from offgrid.chat.gbnf import check_grammar

try:
    from .serverproc import ServerProcess
except ImportError:
    from serverproc import ServerProcess


def validate(value, schema, root=None):
    """Raise AssertionError unless ``value`` validates (the subset the converter handles)."""
    root = root or schema
    if "$ref" in schema:
        target = root
        for part in schema["$ref"][2:].split("/"):
            target = target[part]
        return validate(value, target, root)
    if "enum" in schema:
        assert value in schema["enum"], (value, schema["enum"])
    if "const" in schema:
        assert value == schema["const"]
    for key in ("anyOf", "oneOf"):
        if key in schema:
            ok = 0
            for sub in schema[key]:
                try:
                    validate(value, sub, root)
                    ok += 1
                except AssertionError:
                    pass
            assert ok >= 1 and (key == "anyOf" or ok == 1), (value, schema)
    t = schema.get("type")
    if isinstance(t, list):
        assert any(_is_type(value, x) for x in t), (value, t)
    elif t:
        assert _is_type(value, t), (value, t)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for k in schema.get("required", []):
            assert k in value, "missing required %r in %r" % (k, value)
        for k, v in value.items():
            if k in props:
                validate(v, props[k], root)
            else:
                assert schema.get("additionalProperties", not props) not in (False, None), k
    if isinstance(value, list):
        assert len(value) >= schema.get("minItems", 0)
        assert len(value) <= schema.get("maxItems", len(value))
        if isinstance(schema.get("items"), dict):
            for v in value:
                validate(v, schema["items"], root)
    if isinstance(value, str):
        assert schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value))
    if _is_type(value, "number"):
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value)


def _is_type(v, t):
    return {"object": isinstance(v, dict), "array": isinstance(v, list),
            "string": isinstance(v, str), "boolean": isinstance(v, bool), "null": v is None,
            "integer": isinstance(v, int) and not isinstance(v, bool),
            "number": isinstance(v, (int, float)) and not isinstance(v, bool)}[t]


PERSON = {"type": "object", "required": ["name", "age"], "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
COLOURS = {"type": "array", "minItems": 1, "maxItems": 3,
           "items": {"enum": ["red", "green", "blue"]}}
ACCOUNT = {"type": "object", "required": ["user", "tags"], "additionalProperties": False,
           "properties": {
               "user": {"type": "object", "required": ["id", "admin"], "properties": {
                   "id": {"type": "integer", "minimum": 1, "maximum": 99},
                   "admin": {"type": "boolean"}}},
               "tags": {"type": "array", "maxItems": 2,
                        "items": {"enum": ["new", "vip", "old"]}},
               "note": {"type": ["string", "null"], "maxLength": 4}}}
VERDICT = {"type": "object", "required": ["answer"], "properties": {
    "answer": {"enum": ["yes", "no", "maybe"]}, "confidence": {"type": "integer", "minimum": 1,
                                                               "maximum": 5}}}

GRAMMAR_SCHEMAS = [
    {"type": "object"}, PERSON, COLOURS, ACCOUNT, VERDICT,
    {"type": "string", "format": "date"}, {"type": "string", "format": "uuid"},
    {"type": "integer", "minimum": -15, "maximum": 1234},
    {"type": "object", "properties": {"a": {"type": "number"}}, "additionalProperties": True},
    {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
    {"$defs": {"node": {"type": "object", "required": ["v"], "properties": {
        "v": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}}}}, "$ref": "#/$defs/node"},
    {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
               {"properties": {"b": {"type": "integer"}}}]},
]


@pytest.mark.parametrize("schema", GRAMMAR_SCHEMAS, ids=lambda s: json.dumps(s)[:40])
def test_schema_grammar_is_valid_gbnf(gemma, schema):
    grammar = schema_to_grammar(schema)
    check_grammar(gemma, grammar)
    ptr = libllama.init_grammar_sampler(gemma.lib, gemma.handle.vocab, grammar)
    assert ptr, "libllama refused a grammar the Python check passed"
    gemma.lib.llama_sampler_free(ptr)


@pytest.mark.parametrize("schema, word", [
    ({"type": "string", "pattern": "^(?=a)a+$"}, "pattern"),
    ({"type": "number", "minimum": 0.2, "maximum": 0.8}, "minimum"),
    ({"type": "integer", "multipleOf": 3}, "multipleOf"),
    ({"$ref": "https://example.com/s.json"}, "$ref"),
])
def test_unsupported_schema_features_are_named(schema, word):
    with pytest.raises(SchemaError) as e:
        schema_to_grammar(schema)
    assert word in str(e.value)


def test_integer_ranges_are_exact():
    from offgrid.chat.jsonschema import _int_range
    import re
    # GBNF alternatives of literals and classes, checked by translating to a regex
    for lo, hi in [(0, 9), (5, 123), (-15, 7), (100, 150), (-99, -10), (0, 1000)]:
        rx = _int_range(lo, hi).replace(" ", "").replace('"', "").replace("|", "|")
        rx = re.sub(r"\{(\d+)\}", r"{\1}", rx)
        pattern = re.compile("^(?:%s)$" % rx)
        for n in range(lo - 20, hi + 21):
            assert bool(pattern.match(str(n))) == (lo <= n <= hi), (lo, hi, n)


# -- on the real model ------------------------------------------------------------

@pytest.fixture(scope="module")
def srv(gemma_path):
    with ServerProcess(gemma_path) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("schema, ask", [
    (PERSON, "Invent a person."),
    (COLOURS, "Name some colours."),
    (ACCOUNT, "Describe a user account."),
], ids=["object", "array-enum", "nested"])
def test_json_schema_output_validates(client, schema, ask):
    r = client.chat.completions.create(
        model="m", max_tokens=120, temperature=0,
        messages=[{"role": "user", "content": ask}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "out", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    validate(json.loads(r.choices[0].message.content), schema)


def test_sampled_output_validates_too(client):
    # temperature 1: whatever the model samples, the grammar keeps it valid
    answer = {"enum": ["yes", "no", "maybe"]}
    for seed in (1, 2, 3):
        r = client.chat.completions.create(
            model="m", max_tokens=40, temperature=1.0, seed=seed,
            messages=[{"role": "user", "content": "Is water wet?"}],
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": answer}})
        validate(json.loads(r.choices[0].message.content), answer)


def test_llama_cpp_json_schema_field_streams_valid_json(srv):
    status, events = srv.stream("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Is it raining?"}], "stream": True,
        "json_schema": VERDICT, "max_tokens": 60, "temperature": 0})
    assert status == 200
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                   if e["choices"])
    validate(json.loads(text), VERDICT)


def test_json_object_starts_an_object(client):
    r = client.chat.completions.create(model="m", max_tokens=2, temperature=0,
                                       messages=[{"role": "user", "content": "Hi"}],
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content.lstrip().startswith("{")


def test_bad_grammar_is_400_not_a_crash(srv):
    status, _, body = srv.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "grammar": "root ::= undefined-rule",
        "max_tokens": 4})
    assert status == 400 and "grammar" in body["error"]["message"]
    assert srv.get("/health")[0] == 200


def test_unsupported_schema_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
            response_format={"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "string", "pattern": "^(?!a)b$"}}})
    assert "pattern" in e.value.message


def test_schema_and_grammar_together_are_refused(srv):
    status, _, body = srv.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "json_schema": PERSON,
        "grammar": 'root ::= "x"'})
    assert status == 400 and "both" in body["error"]["message"]


# -- the same constraints on completions (llama-server's /completion fields) -----------

def test_completion_grammar_constrains_the_text(srv):
    status, _, body = srv.post("/completion", {
        "prompt": "Q: Is the sky green?\nA:", "grammar": 'root ::= " yes" | " no"',
        "n_predict": 8, "temperature": 0})
    assert status == 200
    assert body["content"] in (" yes", " no") and body["stop_type"] == "eos"


@pytest.mark.parametrize("path, text_of", [
    ("/completion", lambda b: b["content"]),
    ("/v1/completions", lambda b: b["choices"][0]["text"]),
])
def test_completion_json_schema_output_validates(srv, path, text_of):
    status, _, body = srv.post(path, {
        "prompt": "Is it raining? Reply in JSON.\n", "json_schema": PERSON,
        "max_tokens": 80, "temperature": 0})
    assert status == 200
    validate(json.loads(text_of(body)), PERSON)


def test_completion_with_a_bad_grammar_is_400(srv):
    status, _, body = srv.post("/completion", {
        "prompt": "Hi", "grammar": "root ::= undefined-rule", "n_predict": 4})
    assert status == 400 and "grammar" in body["error"]["message"]
    assert srv.get("/health")[0] == 200
