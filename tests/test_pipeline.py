"""The one generation pipeline (server/api/pipeline.py), seen from the routes.

Every dialect's generate request goes through it, so a field is read the
same way on every route (the drift test), a request is one unit of
cancellation however many jobs it fans out to, one request may only create
so many jobs, and every stream opens at once: its headers and the
dialect's opening event arrive while the request still waits for a session.
"""

import http.client
import json
import socket
import time

import pytest

try:
    from .serverproc import ServerProcess
except ImportError:
    from serverproc import ServerProcess

# the routes of llama-server's API and OpenAI's, and how each says its text
ROUTES = {
    "/completion": lambda b: [r["content"] for r in (b if isinstance(b, list) else [b])],
    "/v1/completions": lambda b: [c["text"] for c in b["choices"]],
    "/v1/chat/completions": lambda b: [c["message"]["content"] for c in b["choices"]],
}


def body_for(path, **fields):
    if path == "/v1/chat/completions":
        return dict({"messages": [{"role": "user", "content": "Count: one, two,"}]}, **fields)
    return dict({"prompt": "Count: one, two,"}, **fields)


def tokens_of(srv, path, body):
    """Generated tokens per choice, as the route reports them (timings, usage)."""
    status, _, out = srv.post(path, body)
    assert status == 200, out
    if path == "/completion":
        return [r["tokens_predicted"] for r in (out if isinstance(out, list) else [out])]
    return out["usage"]["completion_tokens"]


@pytest.fixture(scope="module")
def srv(smollm_path):
    with ServerProcess(smollm_path, "-np", "2") as s:
        yield s


@pytest.mark.parametrize("path", list(ROUTES))
def test_n_predict_comes_before_its_aliases_on_every_route(srv, path):
    body = body_for(path, n_predict=3, max_tokens=7, max_completion_tokens=5, temperature=0,
                    ignore_eos=True)
    n = tokens_of(srv, path, body)
    assert n == [3] or n == 3, n


@pytest.mark.parametrize("path", list(ROUTES))
def test_n_cmpl_comes_before_n_on_every_route(srv, path):
    body = body_for(path, n_cmpl=2, n=3, max_tokens=2, temperature=0)
    status, _, out = srv.post(path, body)
    assert status == 200, out
    assert len(ROUTES[path](out)) == 2


@pytest.mark.parametrize("path", list(ROUTES))
def test_choice_k_samples_with_seed_plus_k_on_every_route(one_session, path):
    # one session: the choices run in turn, each decoded as a lone request is (decoded
    # together, a batch moves the logits a little, and sampling at 1.5 shows it)
    srv = one_session
    fields = dict(max_tokens=8, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    status, _, both = srv.post(path, body_for(path, n=2, seed=1000, **fields))
    assert status == 200, both
    alone = []
    for seed in (1000, 1001):
        status, _, out = srv.post(path, body_for(path, seed=seed, **fields))
        alone += ROUTES[path](out)
    assert ROUTES[path](both) == alone


@pytest.mark.parametrize("path", list(ROUTES))
def test_stop_ends_the_text_where_it_begins_on_every_route(srv, path):
    fields = dict(max_tokens=12, temperature=0, ignore_eos=True)
    status, _, out = srv.post(path, body_for(path, **fields))
    text = ROUTES[path](out)[0]
    stop = text[len(text) // 2:len(text) // 2 + 3]     # a piece from its middle
    assert len(stop) == 3 and stop.strip(), text
    status, _, out = srv.post(path, body_for(path, stop=[stop], **fields))
    assert status == 200, out
    assert ROUTES[path](out)[0] == text[:text.index(stop)]


@pytest.mark.parametrize("path", list(ROUTES))
def test_best_of_and_echo_are_refused_on_every_route(srv, path):
    for field in ({"best_of": 2}, {"echo": True}):
        status, _, out = srv.post(path, body_for(path, max_tokens=1, **field))
        assert status == 400 and list(field)[0] in out["error"]["message"], out


@pytest.mark.parametrize("path", ["/completion", "/v1/completions"])
def test_one_request_creates_at_most_64_jobs(srv, path):
    status, _, out = srv.post(path, {"prompt": ["a %d" % i for i in range(33)], "n": 2,
                                     "max_tokens": 1})
    assert status == 400
    assert "66 generations" in out["error"]["message"] and "64" in out["error"]["message"]


def test_a_hang_up_cancels_every_job_of_a_fanned_out_request(srv):
    before = srv.metrics()["offgrid_requests_cancelled_total"]
    body = json.dumps({"prompt": ["Tell a story %d:" % i for i in range(8)], "n_cmpl": 2,
                       "n_predict": 200, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 30
    while srv.metrics()["offgrid_queue_length"] == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert srv.metrics()["offgrid_queue_length"] > 0, "the jobs never queued"
    sock.close()
    # every job ends: the running ones and the 14 queued ones
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        m = srv.metrics()
        if m["offgrid_queue_length"] == 0 and m["offgrid_sessions_busy"] == 0:
            break
        time.sleep(0.1)
    assert m["offgrid_queue_length"] == 0 and m["offgrid_sessions_busy"] == 0, m
    assert m["offgrid_requests_cancelled_total"] >= before + 2
    started = time.monotonic()
    status, _, out = srv.post("/completion", {"prompt": "Hi", "n_predict": 2})
    assert status == 200 and time.monotonic() - started < 10


# -- streams open at once --------------------------------------------------------------

# a streamed request in each dialect, and the bytes of its opening event (None: the
# dialect has none; its headers are the first thing)
STREAMS = [
    ("/completion", {"prompt": "Hi", "n_predict": 4, "stream": True}, None),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "stream": True}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "max_tokens": 4, "stream": True}, b'"role":"assistant"'),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "stream": True,
                      "messages": [{"role": "user", "content": "Hi"}]},
     b"event: message_start"),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 16, "stream": True},
     b"event: response.created"),
    ("/api/generate", {"model": "m", "prompt": "Hi", "options": {"num_predict": 4}}, None),
    ("/api/chat", {"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                   "options": {"num_predict": 4}}, None),
]


@pytest.fixture(scope="module")
def one_session(smollm_path):
    with ServerProcess(smollm_path, "-np", "1") as s:
        yield s


def _hold_the_session(srv):
    """A request that keeps the one session busy until its connection closes."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    conn.request("POST", "/completion", json.dumps(
        {"prompt": "Once upon a time", "n_predict": 4000, "ignore_eos": True, "stream": True}),
        {"Content-Type": "application/json"})
    conn.getresponse()
    _wait_for(srv, "offgrid_sessions_busy", 1)      # it runs
    return conn


def _wait_for(srv, name, value, timeout=30):
    deadline = time.monotonic() + timeout
    while srv.metrics()[name] != value:
        assert time.monotonic() < deadline, "%s never became %s" % (name, value)
        time.sleep(0.05)


@pytest.mark.parametrize("path,body,opening", STREAMS, ids=[s[0] for s in STREAMS])
def test_a_stream_opens_while_its_request_still_waits(one_session, path, body, opening):
    srv = one_session
    holder = _hold_the_session(srv)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()       # the headers, while the holder still runs
        assert resp.status == 200
        _wait_for(srv, "offgrid_queue_length", 1)   # and this request has not started
        if opening is not None:
            got = b""
            while opening not in got:
                got += resp.read1(4096)
            assert srv.metrics()["offgrid_queue_length"] == 1
        conn.close()
    finally:
        holder.close()
    srv.wait_idle()


def test_a_refused_stream_still_gets_its_real_status(one_session):
    status, _, out = one_session.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "word " * 3000}], "stream": True})
    assert status == 400 and out["error"]["type"] == "exceed_context_size_error"


def test_a_quiet_stream_gets_keep_alives(one_session):
    srv = one_session
    holder = _hold_the_session(srv)
    try:
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        body = json.dumps(STREAMS[3][1]).encode()
        sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        deadline = time.monotonic() + 25
        while b"event: ping" not in got and time.monotonic() < deadline:
            got += sock.recv(4096)
        assert b'event: ping\ndata: {"type":"ping"}' in got
        assert got.index(b"message_start") < got.index(b"event: ping")
        sock.close()
    finally:
        holder.close()
    srv.wait_idle()


@pytest.mark.parametrize("interval,pings", [("1", True), ("0", False)])
def test_sse_ping_interval_sets_how_soon_a_quiet_stream_is_pinged(smollm_path, interval, pings):
    """--sse-ping-interval (llama-server's): a queued stream's keep-alive after 1 s, or
    none with 0 (the default, 10 s, is the test above's)."""
    with ServerProcess(smollm_path, "-np", "1", "--sse-ping-interval", interval) as srv:
        holder = _hold_the_session(srv)
        try:
            sock = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
            body = json.dumps(STREAMS[3][1]).encode()
            sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
            sock.settimeout(0.25)
            got, deadline = b"", time.monotonic() + 4
            while b"event: ping" not in got and time.monotonic() < deadline:
                try:
                    got += sock.recv(4096)
                except socket.timeout:
                    pass
            assert b"message_start" in got, got
            assert (b"event: ping" in got) == pings, got
            sock.close()
        finally:
            holder.close()
