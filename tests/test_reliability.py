"""Bad input, one row each: the status, OpenAI's error shape, and a healthy server after.

Every row is sent to one server on the tiny FIM model, and every row is
followed by an ordinary completion that must succeed, so a row that broke
the server (a stuck session, a dead thread, a connection left out of step)
fails there; nor may a row make the server count a 5xx.

Rows that should *work* (chunked bodies, a valid surrogate pair, empty stop
strings, HEAD) are in the table too, with status 200.
"""

import json
from collections import namedtuple

import pytest

try:
    from . import rawhttp
    from .serverproc import ServerProcess
except ImportError:
    import rawhttp
    from serverproc import ServerProcess

MAX_BODY = 64 * 1024
TIMEOUT = 2         # --timeout and --read-timeout of the server, seconds
N_VOCAB = 49152     # the tiny models' (StarCoder) vocabulary


@pytest.fixture(scope="module")
def srv(fim_model_path):
    with ServerProcess(fim_model_path, "--max-body", MAX_BODY, "--timeout", TIMEOUT,
                       "--read-timeout", TIMEOUT, threads=1, ctx=512) as s:
        yield s


# -- how a row is sent ----------------------------------------------------------------

def post(path, obj):
    """A JSON body, as any client sends it."""
    return rawhttp.request("POST", path, json.dumps(obj).encode(),
                           {"Content-Type": "application/json", "Connection": "close"})


def post_raw(path, body, **headers):
    """Body bytes as given (invalid JSON, NaN, bad UTF-8 ...)."""
    headers.setdefault("Connection", "close")
    return rawhttp.request("POST", path, body, headers)


def chunked(path, chunks, **headers):
    """A chunked body: ``chunks`` are byte strings, or the whole encoded body as one bytes."""
    if isinstance(chunks, bytes):
        encoded = chunks
    else:
        encoded = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    headers.update({"Transfer-Encoding": "chunked", "Connection": "close"})
    return rawhttp.request("POST", path, headers=headers) + encoded


def line(method, path, **headers):
    headers.setdefault("Connection", "close")
    return rawhttp.request(method, path, headers=headers)


Row = namedtuple("Row", "name data status kind")
ROWS = []
# rows whose behaviour belongs to work still in progress elsewhere: name -> reason
PENDING = {}


def row(name, data, status, kind=None):
    ROWS.append(Row(name, data, status, kind))


INVALID = "invalid_request_error"
CONTEXT = "exceed_context_size_error"
C = "/completion"


def comp(**fields):
    body = {"prompt": "hello", "n_predict": 2}
    body.update(fields)
    return post(C, body)


# the body as a whole
row("malformed JSON", post_raw(C, b'{"prompt": "x",'), 400, INVALID)
row("JSON with a trailing comma", post_raw(C, b'{"prompt": "x",}'), 400, INVALID)
row("body is a list", post(C, ["prompt", "x"]), 400, INVALID)
row("body is a string", post(C, "prompt"), 400, INVALID)
row("body is a number", post(C, 5), 400, INVALID)
row("body is null", post(C, None), 400, INVALID)
row("empty body", post_raw(C, b""), 411, INVALID)
row("body of spaces", post_raw(C, b"   "), 400, INVALID)
row("invalid UTF-8", post_raw(C, b'{"prompt": "caf\xe9"}'), 400, INVALID)
row("overlong UTF-8", post_raw(C, b'{"prompt": "\xc0\xaf"}'), 400, INVALID)
row("lone high surrogate", post_raw(C, b'{"prompt": "a\\ud800b", "n_predict": 2}'), 400, INVALID)
row("lone low surrogate in a key", post_raw(C, b'{"prompt": "a", "\\udc00": 1}'), 400, INVALID)
row("surrogate pair is fine", post_raw(C, b'{"prompt": "\\ud83d\\ude00", "n_predict": 2}'), 200)
row("NaN", post_raw(C, b'{"prompt": "x", "temperature": NaN}'), 400, INVALID)
row("Infinity", post_raw(C, b'{"prompt": "x", "temperature": -Infinity}'), 400, INVALID)
row("nested 100000 deep", post_raw(C, b'{"prompt": ' + b"[" * 20000 + b"]" * 20000 + b"}"),
    400, INVALID)
# past offgrid/jsonlimit.py's 64 levels (issue 37: nesting is refused before anything
# recurses into it; this one was taken, and tool parameters so deep were a 500)
row("prompt nested 900 deep", post_raw(C, b'{"n_predict": 2, "prompt": ' + b"[" * 900 +
                                      b'"x"' + b"]" * 900 + b"}"), 400, INVALID)
row("number with 5000 digits", post_raw(C, b'{"prompt": "x", "n_predict": ' + b"9" * 5000 + b"}"),
    400, INVALID)

# a wrong type in every field /completion reads
for name, value in [("prompt", 5), ("prompt", {"text": "x"}), ("prompt", True), ("prompt", None),
                    ("n_predict", "8"), ("n_predict", True), ("n_predict", [8]),
                    ("temperature", "hot"), ("dynatemp_range", []), ("dynatemp_exponent", {}),
                    ("top_k", 1.5), ("top_p", "x"), ("min_p", True), ("typical_p", [1]),
                    ("repeat_penalty", "x"), ("repeat_last_n", 2.5), ("presence_penalty", "x"),
                    ("frequency_penalty", {}), ("seed", "x"), ("samplers", 5),
                    ("samplers", [1, 2]), ("logit_bias", 5), ("logit_bias", [[1]]),
                    ("logit_bias", [["", 1]]), ("logit_bias", {"x" * 2000: 1}),
                    ("logit_bias", [[1, "x"]]), ("stop", 5), ("stop", [5]),
                    ("ignore_eos", "yes"), ("cache_prompt", 1), ("t_max_predict_ms", "x"),
                    ("n_indent", "x"), ("stream", "yes"), ("id_slot", "x"), ("id_slot", -2),
                    ("response_fields", "content"), ("response_fields", [1]),
                    ("return_tokens", 1), ("n_cmpl", "x"), ("n_cmpl", 0), ("n_cmpl", 100)]:
    body = {"prompt": "hello", "n_predict": 2}
    body[name] = value
    if value is None:
        del body[name]
    row("/completion %s=%s" % (name, json.dumps(value)), post(C, body), 400, INVALID)

# numbers out of range
for name, value in [("n_predict", -2), ("n_predict", 2 ** 31), ("n_predict", 10 ** 30),
                    ("n_predict", 1.5), ("n_predict", 1e300), ("max_tokens", -1),
                    ("max_tokens", 2.5), ("max_tokens", 10 ** 12), ("temperature", -0.5),
                    ("top_p", 1.5), ("min_p", -1), ("presence_penalty", 3),
                    ("repeat_last_n", 2 ** 31 - 1), ("repeat_last_n", -2), ("top_k", -2)]:
    row("/completion %s=%r" % (name, value), post(C, {"prompt": "x", name: value}), 400, INVALID)
row("temperature 1e400 (infinite)", post_raw(C, b'{"prompt": "x", "temperature": 1e400}'),
    400, INVALID)
row("temperature as a 400-digit integer",
    post_raw(C, b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}"), 400, INVALID)
row("n_predict 2.0 is an integer", comp(n_predict=2.0), 200)

# token-id prompts
row("token id negative", comp(prompt=[1, -1, 2]), 400, INVALID)
row("token id = n_vocab", comp(prompt=[1, N_VOCAB]), 400, INVALID)
row("token id huge", comp(prompt=[10 ** 30]), 400, INVALID)
row("token id float", comp(prompt=[1, 2.5]), 400, INVALID)
row("token id bool", comp(prompt=[1, True]), 400, INVALID)
row("empty token list", comp(prompt=[]), 400, INVALID)
row("several prompts", comp(prompt=["a", "b"]), 200)
row("a prompt in several prompts that is not one", comp(prompt=["a", ["b", "c"]]), 400, INVALID)
row("65 prompts", comp(prompt=["a"] * 65), 400, INVALID)
row("detokenize negative id", post("/detokenize", {"tokens": [-5]}), 400, INVALID)
row("detokenize id out of range", post("/detokenize", {"tokens": [N_VOCAB + 1]}), 400, INVALID)
row("detokenize strings", post("/detokenize", {"tokens": ["a"]}), 400, INVALID)
row("detokenize not a list", post("/detokenize", {"tokens": "1 2"}), 400, INVALID)

# the context
row("prompt longer than the context", comp(prompt="word " * 2000), 400, CONTEXT)
row("token prompt longer than the context", comp(prompt=[100] * 600), 400, CONTEXT)

# stop strings
row("300 stop strings", comp(stop=["s%d" % i for i in range(300)]), 400, INVALID)
row("a stop string of 5000 characters", comp(stop=["x" * 5000]), 400, INVALID)
row("empty stop strings are ignored", comp(stop=["", ""]), 200)

# /infill
I = "/infill"
for name, value in [("input_prefix", 5), ("input_suffix", []), ("prompt", 5),
                    ("input_extra", {}), ("input_extra", "text"), ("input_extra", [5]),
                    ("input_extra", [{"filename": "a.py"}]), ("input_extra", [{"text": 5}]),
                    ("input_extra", [{"text": "x", "filename": 5}]), ("input_extra", [[1, 2]])]:
    row("/infill %s=%s" % (name, json.dumps(value)),
        post(I, {"input_prefix": "a", "input_suffix": "b", name: value}), 400, INVALID)

# OpenAI completions
V = "/v1/completions"
for name, value in [("prompt", {}), ("prompt", 5), ("max_tokens", "x"), ("n", "x"), ("n", 0),
                    ("n", 17),
                    ("best_of", "x"), ("echo", "x"), ("suffix", 5), ("logprobs", "x"),
                    ("stream_options", 5), ("temperature", [])]:
    row("/v1/completions %s=%s" % (name, json.dumps(value)),
        post(V, {"prompt": "x", "max_tokens": 2, name: value}), 400, INVALID)
row("/v1/completions include_usage not a bool",
    post(V, {"prompt": "x", "stream": True, "stream_options": {"include_usage": "x"}}),
    400, INVALID)
row("/v1/completions without prompt", post(V, {"max_tokens": 2}), 400, INVALID)

# tokens
for name, value in [("content", 5), ("content", None), ("add_special", "x"),
                    ("parse_special", "x"), ("with_pieces", "x")]:
    body = {"content": "hello", name: value}
    if value is None:
        del body[name]
    row("/tokenize %s=%s" % (name, json.dumps(value)), post("/tokenize", body), 400, INVALID)

# chat
H = "/v1/chat/completions"
for name, messages in [("messages missing", None), ("messages empty", []),
                       ("messages a string", "hi"), ("a message not an object", [5]),
                       ("unknown role", [{"role": "wizard", "content": "hi"}]),
                       ("role not a string", [{"role": 5, "content": "hi"}]),
                       ("content a number", [{"role": "user", "content": 5}]),
                       ("content part of unknown type",
                        [{"role": "user", "content": [{"type": "hologram", "data": "x"}]}]),
                       ("content part image",
                        [{"role": "user", "content": [
                            {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]),
                       ("content part not an object", [{"role": "user", "content": ["hi"]}])]:
    body = {"max_tokens": 2}
    if messages is not None:
        body["messages"] = messages
    row("chat: " + name, post(H, body), 400, INVALID)
row("chat: max_tokens negative", post(H, {"messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": -3}), 400, INVALID)

# embeddings: OpenAI's and llama.cpp's (server/api/embeddings.py)
E = "/v1/embeddings"
for name, value in [("input", None), ("input", 5), ("input", True), ("input", []),
                    ("input", [[]]), ("input", [1, 2.5]), ("input", [1, True]),
                    ("input", {"content": "x"}), ("input", {"content": [{"type": "hologram"}]}),
                    ("input", {"prompt_string": 5}), ("input", ["x"] * 2049),
                    ("encoding_format", "hex"), ("encoding_format", 5), ("dimensions", 7),
                    ("dimensions", "8"), ("dimensions", 0), ("embd_normalize", "l2"),
                    ("embd_normalize", -2), ("user", 5)]:
    body = {"input": "hello", name: value}
    if value is None:
        del body[name]
    row("/v1/embeddings %s=%s" % (name, json.dumps(value)[:40]), post(E, body), 400, INVALID)
row("/v1/embeddings token id negative", post(E, {"input": [1, -1]}), 400, INVALID)
row("/v1/embeddings token id = n_vocab", post(E, {"input": [[1], [N_VOCAB]]}), 400, INVALID)
row("/v1/embeddings token id huge", post(E, {"input": [10 ** 30]}), 400, INVALID)
row("/v1/embeddings input longer than the context", post(E, {"input": [100] * 600}), 400,
    CONTEXT)
row("/v1/embeddings works", post(E, {"input": ["hello", [1, 2, 3]]}), 200)
row("/embedding without content", post("/embedding", {"n": 1}), 400, INVALID)
row("/embedding content a number", post("/embedding", {"content": 5}), 400, INVALID)
row("/embeddings token id out of range", post("/embeddings", {"content": [N_VOCAB]}), 400,
    INVALID)
row("/embedding works", post("/embedding", {"content": "hello"}), 200)

# framing: lengths, chunks, sizes
row("body over the limit", post_raw(C, b'{"prompt": "' + b"x" * (MAX_BODY + 10) + b'"}'),
    413, INVALID)
row("Content-Length not a number", rawhttp.request("POST", C, b"", {"Content-Length": "ten"}),
    400, INVALID)
row("Content-Length negative", rawhttp.request("POST", C, b"", {"Content-Length": "-5"}),
    400, INVALID)
row("two Content-Lengths", rawhttp.request("POST", C, b'{"prompt": "x"}',
                                           {"Content-Length": "3"}), 400, INVALID)
row("Content-Length missing", rawhttp.request("POST", C, b'{"prompt": "x"}', length=False),
    411, INVALID)
row("Content-Length says more than is sent",
    rawhttp.request("POST", C, headers={"Content-Length": "100"}) + b'{"prompt": "x"}',
    408, INVALID)
row("chunked body works", chunked(C, [b'{"prompt": "he', b'llo", "n_p', b'redict": 2}']), 200)
row("chunked body with extensions and trailers",
    chunked(C, b'5;x=1\r\n{"pro\r\n16\r\nmpt": "a", "n_predict"\r\n3\r\n: 2\r\n1\r\n}\r\n'
               b'0\r\nX-Trailer: 1\r\n\r\n'), 200)
row("chunked body, bad size", chunked(C, b"zz\r\n{}\r\n0\r\n\r\n"), 400, INVALID)
row("chunked body, 0x prefix", chunked(C, b"0x2\r\n{}\r\n0\r\n\r\n"), 400, INVALID)
row("chunked body, chunk longer than said", chunked(C, b"2\r\n{}}\r\n0\r\n\r\n"), 400, INVALID)
row("chunked body over the limit", chunked(C, [b"x" * 40000, b"x" * 40000]), 413, INVALID)
row("Transfer-Encoding gzip", rawhttp.request("POST", C, b"{}", {"Transfer-Encoding": "gzip"}),
    400, INVALID)

# the request line and headers
row("header too large", line("GET", "/health", **{"X-Big": "x" * 70000}), 431, INVALID)
row("headers too large together",
    line("GET", "/health", **{"X-H%d" % i: "y" * 1000 for i in range(80)}), 431, INVALID)
row("too many headers", line("GET", "/health", **{"X-N%d" % i: "1" for i in range(150)}),
    431, INVALID)
row("request line too long", line("GET", "/health?" + "q" * 70000), 414, INVALID)
row("garbage request line", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400, INVALID)
row("bad HTTP version", b"GET /health HTTP/9.9\r\nConnection: close\r\n\r\n", 505, None)
row("client that sends nothing", b"", 408, INVALID)

# paths and methods
row("path with ..", line("GET", "/../../../../etc/passwd"), 404, "not_found_error")
row("path with .. inside", line("GET", "/v1/../health"), 404, "not_found_error")
row("path with encoded ..", line("GET", "/%2e%2e/%2e%2e/etc/passwd"), 404, "not_found_error")
row("path with a NUL", line("GET", "/health%00.json"), 404, "not_found_error")
row("absolute-form target", line("GET", "http://127.0.0.1/etc/passwd"), 404, "not_found_error")
row("PUT", line("PUT", "/completion"), 405, INVALID)
row("DELETE", line("DELETE", "/v1/models"), 405, INVALID)
row("TRACE", line("TRACE", "/health"), 405, INVALID)
row("made-up method", line("BREW", "/completion"), 405, INVALID)
row("lowercase method", line("get", "/health"), 405, INVALID)
row("made-up method on no path", line("BREW", "/coffee"), 404, "not_found_error")
row("GET on a POST route", line("GET", "/completion"), 405, INVALID)
row("POST on a GET route", post("/health", {}), 405, INVALID)
row("OPTIONS without an Origin", line("OPTIONS", "/completion"), 403, "permission_error")
row("HEAD /health", line("HEAD", "/health"), 200)


def check_follow_up(srv):
    status, _, body = srv.post("/completion", {"prompt": "still fine?", "n_predict": 2})
    assert status == 200 and body["tokens_predicted"] == 2, body


@pytest.mark.parametrize("r", [
    pytest.param(r, id=r.name, marks=[pytest.mark.xfail(reason=PENDING[r.name])]
                 if r.name in PENDING else []) for r in ROWS])
def test_bad_input_gets_its_status_and_the_server_stays_healthy(srv, r):
    errors = srv.metrics()["offgrid_errors_total"]
    responses = rawhttp.exchange(srv.port, r.data, timeout=TIMEOUT + 10)
    assert responses, "no response to %r" % r.name
    status, headers, body = responses[0]
    assert status == r.status, body[:300]
    if status >= 400:
        err = json.loads(body)["error"]
        assert err["code"] == status
        assert isinstance(err["message"], str) and err["message"]
        assert err["type"] == (r.kind or err["type"]) and isinstance(err["type"], str)
    if status == 405:
        assert headers.get("allow"), "405 without an Allow header"
    if r.data.startswith(b"HEAD"):
        assert body == b"" and int(headers["content-length"]) > 0
    assert len(responses) == 1, "one request, %d responses" % len(responses)
    check_follow_up(srv)
    # no 5xx on the way (not even one written to a client already gone), nothing stuck
    m = srv.wait_idle()
    assert m["offgrid_errors_total"] == errors


def test_a_lying_short_content_length_ends_the_connection(srv):
    # 5 bytes are declared, 40 are sent: the rest must not be read as a next request
    data = rawhttp.request("POST", C, headers={"Content-Length": "5"}) + \
        b'{"prompt": "x", "n_predict": 2}' + b"GET /health HTTP/1.1\r\n\r\n"
    responses = rawhttp.exchange(srv.port, data)
    assert [r[0] for r in responses] == [400]
    check_follow_up(srv)


def test_keep_alive_connection_survives_4xx_without_a_body(srv):
    with rawhttp.connect(srv.port) as sock:
        sock.sendall(line("GET", "/nowhere", Connection="keep-alive") +
                     line("GET", "/health", Connection="close"))
        responses = rawhttp.parse_responses(rawhttp.read_until_closed(sock))
    assert [r[0] for r in responses] == [404, 200]
