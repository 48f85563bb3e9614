"""--api-prefix PREFIX: llama-server's flag, every route served under PREFIX.

llama-server registers each route, the web UI's and /health included, at
PREFIX + path, and answers any other path with its 404 ("File Not Found",
not_found_error); offgrid takes the prefix off a request's path in one
place (``Handler.route_path``) and answers the same.  A value that is not a
path (no leading "/", a trailing "/", spaces) stops the server at start.

A real server over loopback with the tiny plain model.
"""

import json
import subprocess
import sys
import threading
import time

import pytest

from offgrid.server.api.routes import APP
from offgrid.server.httpd.server import make_server

try:
    from . import rawhttp
    from .serverproc import ROOT, ServerProcess
except ImportError:
    import rawhttp
    from serverproc import ROOT, ServerProcess

PREFIX = "/llama"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def srv(plain_model_path):
    with ServerProcess(plain_model_path, "--api-prefix", PREFIX, threads=1, ctx=512) as s:
        yield s


def test_the_routes_answer_under_the_prefix(srv):
    status, _, body = srv.post(PREFIX + "/v1/chat/completions", CHAT)
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body
    status, _, body = srv.get(PREFIX + "/health")
    assert status == 200 and body["status"] == "ok", body
    # a route whose path ends in a value reads the value past the prefix
    status, _, models = srv.get(PREFIX + "/v1/models")
    name = models["data"][0]["id"]
    status, _, body = srv.get(PREFIX + "/v1/models/" + name)
    assert status == 200 and body["id"] == name, body


def test_a_streamed_chat_under_the_prefix(srv):
    status, events = srv.stream(PREFIX + "/v1/chat/completions", dict(CHAT, stream=True))
    assert status == 200 and events[-1] == "[DONE]", events


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/health", "/v1/models", PREFIX,
                                  PREFIX + "x/health", "/api/tags"])
def test_a_path_outside_the_prefix_is_llama_servers_404(srv, path):
    method = "POST" if "chat" in path else "GET"
    status, _, body = srv.request(method, path, CHAT if method == "POST" else None)
    assert status == 404, body
    # llama-server: {"error": {"message": "File Not Found", "type": "not_found_error",
    # "code": 404}}; Ollama's shape for its own paths
    if path.startswith("/api/"):
        assert body["error"].startswith("File Not Found"), body
    else:
        assert body["error"]["type"] == "not_found_error" and body["error"]["code"] == 404
        assert body["error"]["message"] == "File Not Found: " + path


def test_the_chat_page_is_at_the_prefix(srv):
    status, headers, html = srv.get(PREFIX + "/", headers={"Accept": "text/html"})
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert '<script src="app.js"' in html          # relative: PREFIX/app.js
    status, _, js = srv.get(PREFIX + "/app.js")
    assert status == 200 and 'fetch("." + path' in js      # its API calls are relative too
    assert "listening on http://127.0.0.1:%d\n" % srv.port in srv.output
    assert "chat page at http://127.0.0.1:%d%s/\n" % (srv.port, PREFIX) in "".join(srv.output)


def test_a_full_server_answers_health_under_the_prefix():
    """The lobby's /health, for a connection that gets no seat, reads the prefix too."""
    httpd = make_server("127.0.0.1", 0, APP, api_prefix=PREFIX)
    httpd.max_connections = 1
    httpd.peer_share = 1.0
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]
    held = rawhttp.connect(port)
    try:
        held.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        deadline = time.monotonic() + 10
        while httpd.seats.n < 1 or httpd.seats._waiting:
            assert time.monotonic() < deadline, "the connection never got its seat"
            time.sleep(0.01)
        (health,) = rawhttp.exchange(port, rawhttp.request("GET", PREFIX + "/health"))
        (bare,) = rawhttp.exchange(port, rawhttp.request("GET", "/health"))
    finally:
        held.close()
        httpd.shutdown()
        httpd.server_close()
    # no model service here: /health says it is loading; outside the prefix, the 503
    assert json.loads(health[2])["status"] == "loading", health
    assert bare[0] == 503 and json.loads(bare[2])["error"]["message"] == "too many connections"


@pytest.mark.parametrize("value", ["llama", "/llama/", "/", "/a//b", "/a b", "/a?b", ""])
def test_a_prefix_that_is_not_a_path_stops_the_server_at_start(value, plain_model_path):
    run = subprocess.run([sys.executable, "-m", "offgrid", "-m", str(plain_model_path),
                          "--api-prefix", value], cwd=str(ROOT), capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2, run
    assert run.stderr.splitlines()[-1] == (
        "offgrid: error: argument --api-prefix: a path such as /llama: starting with /, "
        "without a trailing /, of printable characters without spaces, ?, # or %%, not %r"
        % value)
