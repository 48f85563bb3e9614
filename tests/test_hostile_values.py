"""Every malformed value is a 400 in its dialect's shape, never a 500 nor a traceback (issue 37).

Round three of the hostile checks found a 1.2 KB request of tool parameters
nested 490 deep answered 500 (RecursionError) in all four chat dialects
with 217 KB of traceback in the log, ``keep_alive`` as a 400-digit integer a
500, and ``keep_alive: 1e12`` breaking ``/api/ps`` until another request
came.  Made general, against one real server:

  * nesting: a body nested past the bound, anywhere (tool parameters, a
    message's content, a schema, an unknown field), on every POST route, is
    a 400 in the route's error shape; a JSON *string* nested past it (a tool
    call's arguments, a tool's result) is not a 500; a body at the bound still
    works;
  * numbers: every numeric field offgrid reads (found in its source, not
    listed by hand), on every generation route, sent as the extremes JSON
    can spell (1e400, 400-digit integers, their negatives, 2**64, ...), is
    answered below 500 in the route's shape;
  * ``keep_alive`` at any of those values is a 400 or taken, and ``/api/ps``
    answers 200 after each;
  * the server's log holds no traceback at the end.
"""

import json
import re
from pathlib import Path

import pytest

from offgrid.jsonlimit import MAX_DEPTH
from offgrid.server.api import ollama

try:
    from .serverproc import ServerProcess
except ImportError:
    from serverproc import ServerProcess

ROOT = Path(__file__).resolve().parent.parent

MSG = [{"role": "user", "content": "Hi"}]
# each generation route, a body that asks for one token, and its error shape
ROUTES = {
    "/completion": ({"prompt": "Hi", "n_predict": 1}, "openai"),
    "/v1/completions": ({"prompt": "Hi", "max_tokens": 1}, "openai"),
    "/v1/chat/completions": ({"messages": MSG, "max_tokens": 1}, "openai"),
    "/v1/responses": ({"input": "Hi", "max_output_tokens": 1}, "openai"),
    "/v1/messages": ({"messages": MSG, "max_tokens": 1}, "anthropic"),
    "/api/generate": ({"model": "m", "prompt": "Hi", "stream": False,
                       "options": {"num_predict": 1}}, "ollama"),
    "/api/chat": ({"model": "m", "messages": MSG, "stream": False,
                   "options": {"num_predict": 1}}, "ollama"),
}
OTHER_POSTS = {
    "/tokenize": ({"content": "Hi"}, "openai"),
    "/detokenize": ({"tokens": [1]}, "openai"),
    "/apply-template": ({"messages": MSG}, "openai"),
    "/v1/embeddings": ({"input": "Hi"}, "openai"),
    "/api/embed": ({"model": "m", "input": "Hi"}, "ollama"),
    "/api/show": ({"model": "x"}, "ollama"),
    "/v1/messages/count_tokens": ({"messages": MSG}, "anthropic"),
    "/models/load": ({"model": "x"}, "openai"),
}
CHAT_ROUTES = ["/v1/chat/completions", "/v1/messages", "/api/chat", "/v1/responses"]

# the extremes, as JSON literals: Python's json reads 1e400 as inf
EXTREMES = ["1e400", "-1e400", "1" + "0" * 400, "-1" + "0" * 400, "18446744073709551616",
            "1e300", "4.9e-324"]


def numeric_fields(pattern="*.py"):
    """Every field name the front reads as a number (its source says which)."""
    names = set()
    for p in (ROOT / "offgrid" / "server" / "api").glob(pattern):
        names |= set(re.findall(r'\.(?:int|float)\(\s*"([A-Za-z_]+)"', p.read_text()))
    names |= {"keep_alive"}
    if pattern == "*.py":
        names |= {"n_predict", "n_probs", "logprobs", "max_completion_tokens", "id_slot",
                  "top_logprobs"}
    return sorted(names | {o[0] for o in ollama._OPTIONS})


@pytest.fixture(scope="module")
def srv(smollm_path):
    with ServerProcess(smollm_path, "-np", "1") as s:
        yield s


def check_shape(status, body, dialect, what):
    assert status is not None and 400 <= status < 500, (what, status, body)
    if dialect == "ollama":
        assert isinstance(body, dict) and isinstance(body.get("error"), str), (what, body)
    elif dialect == "anthropic":
        assert body.get("type") == "error" and isinstance(body["error"].get("message"), str), \
            (what, body)
    else:
        assert isinstance(body.get("error"), dict) and body["error"].get("code") == status, \
            (what, body)


def post_raw(conn, path, text):
    conn.request("POST", path, body=text.encode(), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    try:
        body = json.loads(data)
    except ValueError:
        body = data.decode("utf-8", "replace")
    return r.status, body


def nest(depth, leaf='"x"'):
    """A JSON text of ``depth`` levels, objects and arrays in turn."""
    text = leaf
    for i in range(depth):
        text = '{"a":%s}' % text if i % 2 else "[%s]" % text
    return text


def schema(levels):
    """A JSON schema whose properties nest ``levels`` deep (two JSON levels each)."""
    s = {"type": "string"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"p": s}}
    return s


def tool(parameters):
    return {"type": "function", "function": {"name": "f", "description": "d",
                                             "parameters": parameters}}


def anthropic_tool(parameters):
    return {"name": "f", "description": "d", "input_schema": parameters}


def tools_for(path, parameters):
    if path == "/v1/messages":
        return [anthropic_tool(parameters)]
    if path == "/v1/responses":
        return [{"type": "function", "name": "f", "description": "d", "parameters": parameters}]
    return [tool(parameters)]


# -- nesting ------------------------------------------------------------------------------

@pytest.mark.parametrize("path", sorted(ROUTES) + sorted(OTHER_POSTS))
@pytest.mark.parametrize("where", ["unknown_field", "prompt_or_messages"])
def test_a_body_nested_past_the_bound_is_a_400_in_the_routes_shape(srv, path, where):
    base, dialect = {**ROUTES, **OTHER_POSTS}[path]
    deep = nest(MAX_DEPTH + 5)
    body = json.dumps(base)
    key = "x_extra" if where == "unknown_field" else (
        "messages" if "messages" in base else "prompt" if "prompt" in base else "input")
    text = body[:-1] + ', "%s": %s}' % (key, deep)
    status, out = post_raw(srv.conn(), path, text)
    check_shape(status, out, dialect, path)
    assert "levels deep" in json.dumps(out)


@pytest.mark.parametrize("path", CHAT_ROUTES)
def test_tool_parameters_nested_490_deep_are_a_400(srv, path):
    base, dialect = ROUTES[path]
    body = dict(base, tools=tools_for(path, schema(245)))
    status, out = post_raw(srv.conn(), path, json.dumps(body))
    check_shape(status, out, dialect, path)


@pytest.mark.parametrize("path", CHAT_ROUTES)
def test_tool_parameters_nested_as_deep_as_allowed_work(srv, path):
    """At the bound nothing breaks either: the front's and the worker's walks of it fit."""
    base, dialect = ROUTES[path]
    # the body's own levels (tools, [0], function, parameters) and two per schema level
    levels = (MAX_DEPTH - 6) // 2
    body = dict(base, tools=tools_for(path, schema(levels)))
    status, _, out = srv.post(path, body)
    assert status == 200, out


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat"])
@pytest.mark.parametrize("field", ["arguments", "tool_result"])
def test_a_json_string_nested_past_the_bound_is_not_a_500(srv, path, field):
    """JSON inside a string (a call's arguments, a tool's result) is parsed too, later."""
    base, dialect = ROUTES[path]
    deep = nest(5000)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
    if path == "/api/chat":
        call = {"function": {"name": "f", "arguments": {"a": 1}}}
    msgs = MSG + [{"role": "assistant", "content": "", "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "c1",
                   "content": deep if field == "tool_result" else "ok"}]
    body = dict(base, messages=msgs, tools=[tool(schema(1))])
    status, _, out = srv.post(path, body)
    assert status < 500, out
    if status >= 400:
        check_shape(status, out, dialect, path)


# -- numbers ------------------------------------------------------------------------------

@pytest.mark.parametrize("path", sorted(ROUTES))
def test_every_numeric_field_at_every_extreme_is_answered_below_500(srv, path):
    base, dialect = ROUTES[path]
    failures = []
    conn = srv.conn(timeout=60)
    # Ollama's fields are its options, but for a few of its own at the top
    top = set(numeric_fields("ollama*.py")) if "options" in base else None
    for field in numeric_fields():
        for literal in EXTREMES:
            body = json.dumps(base)
            texts = []
            if top is None or field in top:
                texts.append(body[:-1] + ', "%s": %s}' % (field, literal))
            if "options" in base:
                texts.append(body.replace('"options": {', '"options": {"%s": %s, '
                                          % (field, literal)))
            for text in texts:
                try:
                    status, out = post_raw(conn, path, text)
                except OSError as e:
                    failures.append((field, literal[:12], "no answer: %s" % e))
                    conn = srv.conn(timeout=60)
                    continue
                if status >= 500 or status == 200 and not isinstance(out, dict):
                    failures.append((field, literal[:12], status, str(out)[:200]))
                elif status >= 400:
                    try:
                        check_shape(status, out, dialect, path)
                    except AssertionError as e:
                        failures.append((field, literal[:12], "shape", str(e)[:200]))
    assert not failures, failures


@pytest.mark.parametrize("value", EXTREMES + ['"1e400"', '"%s"' % ("9" * 400),
                                              '"99999999999h"', '"-1e400"'])
@pytest.mark.parametrize("path", ["/api/generate", "/v1/chat/completions"])
def test_keep_alive_out_of_range_is_a_400_and_api_ps_keeps_answering(srv, path, value):
    base, dialect = ROUTES[path]
    status, out = post_raw(srv.conn(), path, json.dumps(base)[:-1] + ', "keep_alive": %s}'
                           % value)
    assert status in (200, 400), (status, out)
    if status == 400:
        check_shape(status, out, dialect, path)
        assert "keep_alive" in json.dumps(out)
    status, _, ps = srv.get("/api/ps")
    assert status == 200, ps
    for m in ps["models"]:
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT[\d:.]+Z", m["expires_at"]), m
    # a value taken (a negative one: for good) is undone by the next request
    srv.post("/api/generate", dict(ROUTES["/api/generate"][0], keep_alive="5m"))


def test_the_log_holds_no_traceback(srv):
    """Runs last in this file: nothing above left a traceback in the server's output."""
    text = "".join(srv.output)
    assert "Traceback" not in text, text[-3000:]
    assert len(text) < 200_000, len(text)
