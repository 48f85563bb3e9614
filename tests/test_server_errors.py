"""Error responses: OpenAI's shape, the right status, and a healthy server after each."""

import threading

import pytest

from offgrid.server.api.routes import APP
from offgrid.server.httpd.server import make_server

try:
    from .serverproc import ServerProcess
except ImportError:
    from serverproc import ServerProcess


@pytest.fixture(scope="module")
def srv(fim_model_path, plain_model_path):
    # the text model has no FIM tokens; the FIM role is served by nobody else
    with ServerProcess(plain_model_path, "--max-body", "16384") as s:
        yield s


def assert_error(resp, status, kind=None):
    code, _, body = resp
    assert code == status, body
    err = body["error"]
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    if kind:
        assert err["type"] == kind


@pytest.mark.parametrize("method,path,body,status,kind", [
    ("GET", "/no/such/path", None, 404, "not_found_error"),
    ("DELETE", "/completion", None, 405, None),
    ("GET", "/completion", None, 405, None),
    ("POST", "/completion", {"n_predict": 3}, 400, "invalid_request_error"),
    ("POST", "/completion", {"prompt": "x", "n_predict": "many"}, 400, "invalid_request_error"),
    ("POST", "/completion", {"prompt": [1, 2, 10 ** 9]}, 400, "invalid_request_error"),
    ("POST", "/infill", {"input_prefix": "a", "input_suffix": "b"}, 501, "not_supported_error"),
    ("POST", "/v1/completions", {"prompt": "x", "suffix": "y"}, 501, "not_supported_error"),
    ("POST", "/v1/completions", {"prompt": "x", "best_of": 3}, 400, None),
    ("POST", "/v1/completions", {"prompt": "x", "echo": True}, 400, None),
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": -1}, 400, None),
    ("POST", "/v1/chat/completions", {"messages": []}, 400, None),
    ("POST", "/completion", {"prompt": "x " * 3000}, 400, "exceed_context_size_error"),
])
def test_bad_requests_get_json_errors(srv, method, path, body, status, kind):
    assert_error(srv.request(method, path, body), status, kind)
    assert srv.post("/completion", {"prompt": "ok", "n_predict": 2})[0] == 200


def test_a_prompt_over_the_context_says_both_sizes(srv):
    status, _, body = srv.post("/completion", {"prompt": "x " * 3000})
    assert status == 400
    err = body["error"]
    assert err["n_prompt_tokens"] >= 3000 and 0 < err["n_ctx"] < err["n_prompt_tokens"]


def test_body_over_the_limit_is_413(srv):
    assert_error(srv.post("/completion", {"prompt": "x" * 20000}), 413)
    assert srv.get("/health")[0] == 200


def test_malformed_json_is_400(srv):
    assert_error(srv.request("POST", "/completion", raw=b'{"prompt": '), 400)
    assert_error(srv.request("POST", "/completion", raw=b'["a list"]'), 400)


def test_health_says_loading_before_the_model_is_ready():
    httpd = make_server("127.0.0.1", 0, APP)       # no service yet: what `offgrid` shows while loading
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        import http.client
        import json
        c = http.client.HTTPConnection("127.0.0.1", httpd.server_address[1], timeout=10)
        c.request("GET", "/health")
        r = c.getresponse()
        assert r.status == 503 and json.loads(r.read())["status"] == "loading"
        c.request("POST", "/completion", body=b'{"prompt": "x"}')
        r = c.getresponse()
        assert r.status == 503 and json.loads(r.read())["error"]["type"] == "unavailable_error"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_shutdown_wakes_the_accept_loop_rather_than_waiting_for_a_poll():
    """serve_forever with no poll interval sleeps until a connection comes;
    shutdown() must wake it (socketserver's loop saw a stop only at its next
    poll: every stop of offgrid waited up to 0.2 s for it).  Then the server
    can be served and stopped again."""
    httpd = make_server("127.0.0.1", 0, APP)
    try:
        for _ in range(2):
            serving = threading.Thread(target=httpd.serve_forever, daemon=True,
                                       kwargs={"poll_interval": None})
            serving.start()
            stopping = threading.Thread(target=httpd.shutdown, daemon=True)
            stopping.start()
            stopping.join(10)
            assert not stopping.is_alive(), "shutdown() never returned"
            serving.join(10)
            assert not serving.is_alive()
    finally:
        httpd.server_close()
    httpd.shutdown()            # closed: nothing to wake, and no wait
