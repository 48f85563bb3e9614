"""HTTPS: --ssl-key-file and --ssl-cert-file, llama-server's flags.

With both, the server speaks TLS only, with that certificate; everything the
HTTP layer does over plain connections it does over TLS ones: keep-alive and
pipelined requests (whose bytes may wait decrypted where poll() does not see
them), streams, the body limit, the read deadline, a client's hang-up
cancelling its generation, and a full server's /health.  The handshake is
done on the connection's own thread, so a client that connects and says
nothing, or stalls inside its handshake, holds up nobody else; a client that
speaks plain HTTP to the port has its connection closed and nothing more.
One flag alone, or files that do not load, stop the server at start, with
one line saying which file and why (exit 2, as the other flag errors).

A real server over loopback with the tiny plain model, reached with the
stdlib's client (and curl) verifying a certificate made per module by
openssl.
"""

import json
import socket
import ssl
import subprocess
import sys
import threading
import time

import pytest

from offgrid.flagvalues import tls_context
from offgrid.server.api.routes import APP
from offgrid.server.httpd.server import make_server

try:
    from . import rawhttp
    from .serverproc import ROOT, ServerProcess
except ImportError:
    import rawhttp
    from serverproc import ROOT, ServerProcess

READ_TIMEOUT = 4        # the server's --read-timeout: its handshake deadline too
MAX_BODY = 64 * 1024
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


def make_cert(folder, name="localhost"):
    """A self-signed certificate for 127.0.0.1 and localhost: (key path, cert path)."""
    key, cert = folder / ("%s.key" % name), folder / ("%s.pem" % name)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=%s" % name, "-addext",
                    "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return key, cert


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    return make_cert(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def srv(plain_model_path, cert):
    key, pem = cert
    with ServerProcess(plain_model_path, "--ssl-key-file", key, "--ssl-cert-file", pem,
                       "-np", "2", "--read-timeout", READ_TIMEOUT, "--max-body", MAX_BODY,
                       threads=1, ctx=4096) as s:
        s.tls = ssl.create_default_context(cafile=str(pem))
        yield s


def tls_connect(srv, timeout=30):
    """A TLS connection to the server, verified, for bytes no client library sends."""
    sock = socket.create_connection((srv.host, srv.port), timeout=timeout)
    return srv.tls.wrap_socket(sock, server_hostname=srv.host)


# -- what a client sees ---------------------------------------------------------------

def test_a_chat_completion_over_https_is_verified_against_the_certificate(srv):
    assert "listening on https://127.0.0.1:%d\n" % srv.port in srv.output
    status, _, body = srv.post("/v1/chat/completions", CHAT)
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body
    with tls_connect(srv) as sock:
        assert sock.version() in ("TLSv1.2", "TLSv1.3")
        assert sock.getpeercert()["subject"] == ((("commonName", "localhost"),),)


def test_a_client_that_trusts_another_certificate_is_refused(srv, tmp_path):
    _, other = make_cert(tmp_path, "other")
    with pytest.raises(ssl.SSLCertVerificationError):
        with socket.create_connection((srv.host, srv.port), timeout=10) as sock:
            ssl.create_default_context(cafile=str(other)).wrap_socket(
                sock, server_hostname=srv.host)


def test_curl_gets_health_over_https(srv, cert):
    out = subprocess.run(["curl", "-sS", "--cacert", str(cert[1]),
                          "https://127.0.0.1:%d/health" % srv.port],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and json.loads(out.stdout)["status"] == "ok", out


def test_a_streamed_chat_completion_over_https(srv):
    status, events = srv.stream("/v1/chat/completions", dict(CHAT, stream=True))
    assert status == 200 and events[-1] == "[DONE]", events
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_two_requests_on_one_kept_alive_tls_connection(srv):
    c = srv.conn(timeout=30)
    try:
        c.request("POST", "/v1/chat/completions", body=json.dumps(CHAT).encode(),
                  headers={"Content-Type": "application/json"})
        first = c.getresponse()
        assert first.status == 200 and json.loads(first.read())["choices"]
        sock = c.sock           # http.client opens a new one if the server closed this one
        c.request("GET", "/health")
        second = c.getresponse()
        assert second.status == 200 and json.loads(second.read())["status"] == "ok"
        assert c.sock is sock
    finally:
        c.close()


def test_a_pipelined_pair_in_one_write_is_answered_both(srv):
    # one TLS record holds both requests; the first is larger than the server's first
    # read (8 KiB), so the second lies decrypted in the SSL object, where poll() on the
    # socket sees nothing, while the first is answered
    body = json.dumps({"prompt": "hi", "n_predict": 2}).encode() + b" " * 10000
    first = rawhttp.request("POST", "/completion", body,
                            headers={"Content-Type": "application/json"})
    second = rawhttp.request("GET", "/health", headers={"Connection": "close"})
    assert len(first + second) < 16384         # one record
    with tls_connect(srv) as sock:
        sock.sendall(first + second)
        responses = rawhttp.parse_responses(rawhttp.read_until_closed(sock, timeout=30))
    assert [r[0] for r in responses] == [200, 200], responses
    assert json.loads(responses[0][2])["tokens_predicted"] == 2
    assert json.loads(responses[1][2])["status"] == "ok"


def test_bytes_after_a_last_request_are_drained_without_an_error(srv):
    # the server closes after this answer with bytes of the client's unread: it looks
    # for them under TLS too (SSLSocket refuses recv(MSG_PEEK)), and drains them so the
    # close is no reset that could overtake the answer
    with tls_connect(srv) as sock:
        sock.sendall(rawhttp.request("GET", "/health", headers={"Connection": "close"}))
        sock.sendall(b"more bytes the server will not read")     # a TLS record of their own
        responses = rawhttp.parse_responses(rawhttp.read_until_closed(sock, timeout=10))
    assert [r[0] for r in responses] == [200], responses
    time.sleep(0.2)             # its handler's finish() is after the answer
    assert "Traceback" not in "".join(srv.output), "".join(srv.output)


# -- what a client cannot do to others ---------------------------------------------------

def test_silent_and_stalled_handshakes_hold_up_no_other_client(srv):
    silent = [socket.create_connection((srv.host, srv.port)) for _ in range(3)]
    # one byte of a ClientHello: its handler waits READ_TIMEOUT for the rest
    stalled = socket.create_connection((srv.host, srv.port))
    stalled.sendall(b"\x16")
    try:
        time.sleep(0.2)         # the server has accepted them all
        t0 = time.monotonic()
        status, _, body = srv.post("/v1/chat/completions", dict(CHAT, max_tokens=1))
        elapsed = time.monotonic() - t0
        assert status == 200, body
        # a handshake done in the accepting thread would have waited for the silent ones
        # (3 s, the lobby's limit) or the stalled one (READ_TIMEOUT)
        assert elapsed < 2.5, elapsed
        # and the stalled one is cut off at the handshake's deadline
        closed = rawhttp.read_and_whether_closed(stalled, READ_TIMEOUT + 3)
        assert closed[1] and not closed[0].startswith(b"HTTP/"), closed
    finally:
        for s in silent + [stalled]:
            s.close()


def test_plain_http_to_the_tls_port_is_closed_and_the_server_serves_on(srv):
    out, closed = rawhttp.read_and_whether_closed(_plain_request(srv), 5)
    # no HTTP answer in plain text: the handshake failed and the connection closed
    assert closed and not out.startswith(b"HTTP/"), out
    status, _, body = srv.post("/v1/chat/completions", dict(CHAT, max_tokens=1))
    assert status == 200, body


def _plain_request(srv):
    sock = socket.create_connection((srv.host, srv.port), timeout=10)
    sock.sendall(rawhttp.request("GET", "/health"))
    return sock


def test_a_body_over_the_limit_gets_413_over_tls(srv):
    with tls_connect(srv) as sock:
        sock.sendall(rawhttp.request("POST", "/completion", b"x" * (MAX_BODY + 1),
                                     headers={"Content-Type": "application/json"}))
        responses = rawhttp.parse_responses(rawhttp.read_until_closed(sock, timeout=10))
    assert [r[0] for r in responses] == [413], responses


def test_a_request_that_trickles_in_is_cut_off_at_the_read_timeout(srv):
    with tls_connect(srv) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        t0 = time.monotonic()
        answer = b""
        while time.monotonic() - t0 < READ_TIMEOUT + 5:
            sock.settimeout(0.3)
            try:
                answer = sock.recv(4096)
                break
            except socket.timeout:
                sock.sendall(b"X-Slow: a\r\n")       # a header line at a time
        elapsed = time.monotonic() - t0
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert READ_TIMEOUT - 0.5 < elapsed < READ_TIMEOUT + 2, elapsed


def test_a_client_hanging_up_mid_stream_cancels_its_generation(srv):
    before = srv.metrics()["offgrid_requests_cancelled_total"]
    c = srv.conn(timeout=30)
    c.request("POST", "/completion", headers={"Content-Type": "application/json"},
              body=json.dumps({"prompt": "hi", "n_predict": 4000, "ignore_eos": True,
                               "stream": True}).encode())
    r = c.getresponse()
    assert r.status == 200
    assert r.readline().startswith(b"data: ")
    c.close()
    t0 = time.monotonic()
    srv.wait_idle(timeout=20)
    # the 4000 tokens take the tiny model some seconds: its session is freed sooner
    assert time.monotonic() - t0 < 1.5
    assert srv.metrics()["offgrid_requests_cancelled_total"] == before + 1


def test_a_full_server_answers_health_and_503_over_tls(cert):
    """The lobby's answers to a connection that gets no seat: its handshake done there,
    without a thread."""
    httpd = make_server("127.0.0.1", 0, APP, tls=tls_context(*map(str, cert)))
    httpd.max_connections = 2
    httpd.peer_share = 1.0
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]
    client = ssl.create_default_context(cafile=str(cert[1]))
    held = []
    try:
        for _ in range(2):
            s = client.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10),
                                   server_hostname="127.0.0.1")
            s.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            held.append(s)
        deadline = time.monotonic() + 10
        while httpd.seats.n < 2 or httpd.seats._waiting:     # seated, heads read
            assert time.monotonic() < deadline, "the two connections never got their seats"
            time.sleep(0.01)
        answers = {}
        for path in ("/health", "/v1/models"):
            with client.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10),
                                    server_hostname="127.0.0.1") as s:
                s.sendall(rawhttp.request("GET", path))
                (answers[path],) = rawhttp.parse_responses(rawhttp.read_until_closed(s, 5))
        # no model service here: /health says it is loading, as a handler would
        assert json.loads(answers["/health"][2])["status"] == "loading", answers
        assert answers["/v1/models"][0] == 503
        assert json.loads(answers["/v1/models"][2])["error"]["message"] == \
            "too many connections"
    finally:
        for s in held:
            s.close()
        httpd.shutdown()
        httpd.server_close()


def test_stalled_handshakes_are_dropped_for_a_newcomer_when_the_server_is_full(cert):
    """A connection stalled in its handshake holds a seat as one trickling its head does,
    and like it is dropped for a newcomer once the server is full (seats.py)."""
    httpd = make_server("127.0.0.1", 0, APP, tls=tls_context(*map(str, cert)))
    httpd.max_connections = 2
    httpd.peer_share = 1.0
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]
    stalled = []
    try:
        for _ in range(2):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"\x16")              # one byte of a ClientHello, then nothing
            stalled.append(s)
        deadline = time.monotonic() + 10
        while len(httpd.seats._waiting) < 2:    # both seated, in their handshakes
            assert time.monotonic() < deadline, "the two connections never got their seats"
            time.sleep(0.01)
        time.sleep(httpd.seats.min_wait)
        client = ssl.create_default_context(cafile=str(cert[1]))
        with client.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10),
                                server_hostname="127.0.0.1") as s:
            s.sendall(rawhttp.request("GET", "/v1/models", headers={"Connection": "close"}))
            (answer,) = rawhttp.parse_responses(rawhttp.read_until_closed(s, 5))
        # seated: a handler answered (no model service here: "Loading model"), where a
        # refusal would say "too many connections"
        assert json.loads(answer[2])["error"]["message"] == "Loading model", answer
        assert httpd.seats.dropped == 1
    finally:
        for s in stalled:
            s.close()
        httpd.shutdown()
        httpd.server_close()


# -- start errors -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, cert):
    folder = tmp_path_factory.mktemp("bad-tls")
    junk = folder / "junk.pem"
    junk.write_text("not a PEM file\n")
    other_key, _ = make_cert(folder, "other")
    return {"junk": junk, "missing": folder / "missing.pem", "other_key": other_key,
            "key": cert[0], "cert": cert[1]}


@pytest.mark.parametrize("flags,message", [
    (["--ssl-key-file", "{key}"], "--ssl-key-file needs --ssl-cert-file too: HTTPS takes the "
     "private key and its certificate"),
    (["--ssl-cert-file", "{cert}"], "--ssl-cert-file needs --ssl-key-file too: HTTPS takes the "
     "private key and its certificate"),
    (["--ssl-key-file", "{missing}", "--ssl-cert-file", "{cert}"],
     "--ssl-key-file {missing}: No such file or directory"),
    (["--ssl-key-file", "{key}", "--ssl-cert-file", "{missing}"],
     "--ssl-cert-file {missing}: No such file or directory"),
    (["--ssl-key-file", "{key}", "--ssl-cert-file", "{junk}"],
     "--ssl-cert-file {junk}: no PEM certificate in it"),
    (["--ssl-key-file", "{junk}", "--ssl-cert-file", "{cert}"],
     "--ssl-key-file {junk}: no PEM private key in it"),
    (["--ssl-key-file", "{other_key}", "--ssl-cert-file", "{cert}"],
     "--ssl-key-file {other_key} is not the private key of the certificate in "
     "--ssl-cert-file {cert}"),
], ids=["key-alone", "cert-alone", "no-key-file", "no-cert-file", "bad-cert", "bad-key",
        "key-of-another-cert"])
def test_tls_flags_that_cannot_work_stop_the_server_at_start(flags, message, bad_files,
                                                              plain_model_path):
    argv = [f.format(**bad_files) for f in flags]
    run = subprocess.run([sys.executable, "-m", "offgrid", "-m", str(plain_model_path)] + argv,
                         cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run
    assert "listening on" not in run.stdout
    # argparse's usage, then the one line that says what is wrong
    assert run.stderr.splitlines()[-1] == "offgrid: error: " + message.format(**bad_files)
