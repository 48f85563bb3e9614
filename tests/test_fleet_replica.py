"""One replica as a load balancer sees it (issue 50; docs/fleet.md), no balancer here.

Streams say ``X-Accel-Buffering: no``; ``--instance-name`` names the replica on
every response; ``--max-queue`` turns the request past the queue's bound into a
503 with ``Retry-After`` in each dialect's shape, a stream's too, as a status;
``/metrics`` shows the queue, the running requests, session and KV use;
``/health`` judges the default model alone; and SIGTERM closes the listening
socket at once, so a new connection is refused while the running stream ends
whole.  The balancers themselves: tests/test_fleet.py.
"""

import json
import os
import signal
import socket
import time

import pytest

try:
    from .serverproc import Call, ServerProcess
    from . import rawhttp
    from .rawhttp import argv_of, children
except ImportError:
    from serverproc import Call, ServerProcess
    import rawhttp
    from rawhttp import argv_of, children

# a stream long enough to still run when the next request comes (SmolLM2-135M on
# one thread: a few hundred tokens a second)
LONG = {"prompt": "Count from one to a thousand:", "n_predict": 400, "ignore_eos": True,
        "stream": True, "temperature": 0}


@pytest.fixture(scope="module")
def srv(smollm_path):
    with ServerProcess(smollm_path, "-np", 1, "--max-queue", 1, "--instance-name", "replica-a",
                       threads=1, ctx=1024) as s:
        yield s


def open_stream(srv, body, path="/completion"):
    """A streamed request whose headers and first event are in; (connection, response)."""
    c = srv.conn(60)
    c.request("POST", path, body=json.dumps(body).encode(),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    first = r.read1(65536)      # the first event: the stream is under way
    assert first
    r.first = first
    return c, r


def first_and_rest(r):
    return (r.first + r.read()).decode()


def test_streams_ask_a_proxy_not_to_buffer_them(srv):
    for path, body, kind in [
            ("/completion", {"prompt": "Hi", "n_predict": 3, "stream": True}, "text/event-stream"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                      "max_tokens": 3, "stream": True}, "text/event-stream"),
            ("/api/chat", {"model": "smollm2-135m-instruct-q4_1",
                           "messages": [{"role": "user", "content": "Hi"}],
                           "options": {"num_predict": 3}}, "application/x-ndjson")]:
        c = srv.conn(60)
        c.request("POST", path, body=json.dumps(body).encode(),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        c.close()
        assert r.status == 200 and r.getheader("Content-Type").startswith(kind), path
        assert r.getheader("X-Accel-Buffering") == "no", path


def test_every_response_names_the_instance(srv):
    for method, path, body, status in [("GET", "/health", None, 200),
                                       ("GET", "/no/such/route", None, 404),
                                       ("POST", "/completion", {"prompt": "Hi", "n_predict": 1},
                                        200),
                                       ("POST", "/completion", {"prompt": 5}, 400)]:
        got, headers, _ = srv.request(method, path, body)
        assert got == status, path
        assert headers.get("X-Offgrid-Instance") == "replica-a", (path, headers)


def test_the_lobbys_own_answers_name_the_instance_too(srv):
    # a connection that never speaks gets the lobby's 408 (server.first_byte_timeout: 3 s)
    sock = rawhttp.connect(srv.port)
    try:
        data = rawhttp.read_until_closed(sock, timeout=10)
    finally:
        sock.close()
    assert data.startswith(b"HTTP/1.1 408"), data
    assert b"\r\nX-Offgrid-Instance: replica-a\r\n" in data, data


def test_past_max_queue_a_503_with_retry_after_in_each_dialect(srv):
    c, r = open_stream(srv, LONG)           # runs on the one session
    queued = Call(srv, "/completion", {"prompt": "Hi", "n_predict": 1})
    queued.start()                           # waits: the queue's one place
    try:
        srv.wait_busy(busy=1, queued=1)
        shapes = [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]},
             lambda b: b["error"]["code"] == 503 and b["error"]["type"] == "unavailable_error"),
            ("/v1/messages", {"model": "x", "max_tokens": 4,
                              "messages": [{"role": "user", "content": "Hi"}]},
             lambda b: b["type"] == "error" and b["error"]["type"] == "overloaded_error"),
            ("/api/generate", {"model": "smollm2-135m-instruct-q4_1", "prompt": "Hi",
                               "stream": False},
             lambda b: isinstance(b["error"], str)),
            # a stream too: refused before its headers, with the real status
            ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stream": True},
             lambda b: b["error"]["code"] == 503),
        ]
        for path, body, shaped in shapes:
            t0 = time.monotonic()
            status, headers, got = srv.post(path, body, timeout=10)
            assert status == 503, (path, got)
            assert time.monotonic() - t0 < 2.0, "refused at once, not after a wait"
            assert int(headers["Retry-After"]) >= 1, headers
            assert shaped(got), (path, got)
            assert "--max-queue 1" in json.dumps(got), got
    finally:
        c.close()
    queued.join(60)
    assert queued.result[0] == 200       # the one that waited was served


def test_metrics_show_queue_running_sessions_and_kv_use(srv):
    srv.wait_idle()
    model = 'model="smollm2-135m-instruct-q4_1.gguf"'
    m = srv.metrics()
    assert m["offgrid_model_requests_running{%s}" % model] == 0
    assert m["offgrid_model_sessions_used_ratio{%s}" % model] == 0
    c, r = open_stream(srv, LONG)
    queued = Call(srv, "/completion", {"prompt": "Hi", "n_predict": 1})
    queued.start()
    try:
        srv.wait_busy(busy=1, queued=1)
        m = srv.metrics()
        assert m["offgrid_model_requests_queued{%s}" % model] == 1
        assert m["offgrid_model_requests_running{%s}" % model] == 1
        assert m["offgrid_model_sessions_used_ratio{%s}" % model] == 1
        # the running stream's prompt and tokens so far, of the session's 1024 cells
        assert 0.005 < m["offgrid_model_kv_used_ratio{%s}" % model] <= 1
    finally:
        c.close()
    queued.join(60)


def test_health_judges_the_default_model_alone(smollm_path, plain_model_path):
    with ServerProcess(smollm_path, "--fim-model", plain_model_path, threads=1,
                       ctx=512) as s:
        assert s.get("/health")[0] == 200
        # the worker's one argument is its settings as JSON (protocol.WorkerSettings)
        worker = next(pid for pid in children(s.proc.pid) if any(
            '"model": %s' % json.dumps(str(smollm_path)) in a for a in argv_of(pid)))
        os.kill(worker, signal.SIGKILL)
        # the FIM model still serves, but the default one restarts: not this replica's turn
        seen = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status, _, body = s.get("/health")
            seen.append(status)
            if status == 503:
                assert body["error"]["type"] == "unavailable_error"
                assert {m["status"] for m in body["models"]} >= {"loaded"}, body
            if 503 in seen and status == 200:
                break
            time.sleep(0.01)
        assert 503 in seen and seen[-1] == 200, seen


def test_sigterm_refuses_new_connections_at_once_and_finishes_the_stream(smollm_path):
    s = ServerProcess(smollm_path, "-np", 1, threads=1, ctx=1024).start()
    try:
        keep = s.conn(10)           # a kept-alive connection, as a balancer's
        keep.request("GET", "/health")
        assert keep.getresponse().read()
        c, r = open_stream(s, LONG)
        s.proc.send_signal(signal.SIGTERM)
        # a request on the kept-alive connection moments later gets 503 at once
        time.sleep(0.05)
        keep.request("GET", "/health")
        health = keep.getresponse()
        assert health.status == 503 and b"shutting down" in health.read()
        # a new connection is refused soon after, not queued in the kernel until exit
        deadline = time.monotonic() + 1.0
        refused_at = None
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", s.port), timeout=1).close()
            except ConnectionRefusedError:
                refused_at = time.monotonic()
                break
            time.sleep(0.02)
        assert refused_at is not None, "a new connection was still accepted 1 s after SIGTERM"
        # and the stream that ran ends whole: all its 400 tokens, the last event says stop
        rest = first_and_rest(r)
        events = [json.loads(line[6:]) for line in rest.splitlines()
                  if line.startswith("data: ") and line[6:].startswith("{")]
        assert events and events[-1]["stop"] is True
        assert events[-1]["tokens_predicted"] == LONG["n_predict"], events[-1]
        assert s.proc.wait(30) == 0
    finally:
        if s.proc.poll() is None:
            s.stop()
