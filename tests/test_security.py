"""Who may use the server, and what a request can make it do.

Binding, API keys (several, Bearer and x-api-key, never logged), CORS and
foreign web origins, the body/header limits and the timeouts that bound what
one client can hold, and that no request reaches the file system or loads a
model.  All traffic goes to 127.0.0.1; the tiny plain model serves.
"""

import json
import os
import select
import subprocess
import sys
import threading
import time

import pytest

from offgrid.flagvalues import is_loopback
from offgrid.server.api.routes import APP
from offgrid.server.httpd.server import make_server

try:
    from . import rawhttp
    from .serverproc import ROOT, ServerProcess
except ImportError:
    import rawhttp
    from serverproc import ROOT, ServerProcess

KEYS = ["k-one-4f1d9c", "k-two-77ab01", "k-file-9e2c55", "k-env-c3d8a0"]
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def keyfile(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text("# offgrid keys\n\n%s\n" % KEYS[2])
    return path


@pytest.fixture(scope="module")
def locked(plain_model_path, keyfile):
    """Four keys: two flags, a file and the environment."""
    srv = ServerProcess(plain_model_path, "--api-key", KEYS[0], "--api-key", KEYS[1],
                        "--api-key-file", keyfile, threads=1, ctx=512)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OFFGRID_API_KEY", KEYS[3])     # for this server's start only
        srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def open_srv(plain_model_path):
    """No key, CORS off, small limits and short timeouts."""
    with ServerProcess(plain_model_path, "--max-body", MAX_BODY, "--timeout", 1,
                       "--read-timeout", 2, threads=1, ctx=512) as s:
        yield s


@pytest.fixture(scope="module")
def cors(plain_model_path):
    with ServerProcess(plain_model_path, "--cors-origin", "http://a.example",
                       "--cors-origin", "http://b.example:3000", threads=1, ctx=512) as s:
        yield s


def assert_error(status, body, code, kind):
    assert status == code, body
    err = body["error"]
    assert err["code"] == code and err["type"] == kind and err["message"]


# -- binding ----------------------------------------------------------------------------

def test_binds_loopback_by_default(open_srv):
    assert "listening on http://127.0.0.1:%d\n" % open_srv.port in open_srv.output
    with open("/proc/net/tcp") as fh:
        listening = [line.split()[1] for line in fh if line.split()[3] == "0A"]
    assert "0100007F:%04X" % open_srv.port in listening
    assert "00000000:%04X" % open_srv.port not in listening


def run_offgrid(model, *args):
    return subprocess.run([sys.executable, "-m", "offgrid", "-m", str(model), "--port", "0"] +
                          list(args), cwd=str(ROOT), capture_output=True, text=True, timeout=120)


def test_binding_elsewhere_without_a_key_warns(plain_model_path):
    # 192.0.2.1 (TEST-NET-1) is nobody's address: the warning comes, then the bind fails,
    # so nothing ever listens beyond loopback
    r = run_offgrid(plain_model_path, "--host", "192.0.2.1")
    assert "warning: listening on 192.0.2.1 without an API key" in r.stderr
    assert r.returncode == 1
    r = run_offgrid(plain_model_path, "--host", "192.0.2.1", "--api-key", "k")
    assert "warning" not in r.stderr and r.returncode == 1


def test_loopback_names_need_no_key():
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "192.168.1.20", "example.com", ""):
        assert not is_loopback(host), host


@pytest.mark.parametrize("args,env", [(["--api-key", ""], None), (["--api-key", "  "], None),
                                      ([], ""), (["--api-key-file", "EMPTY"], None)])
def test_an_empty_key_refuses_to_start(plain_model_path, tmp_path, args, env):
    empty = tmp_path / "empty.txt"
    empty.write_text("# no keys yet\n\n")
    args = [str(empty) if a == "EMPTY" else a for a in args]
    environ = dict(os.environ)
    if env is not None:
        environ["OFFGRID_API_KEY"] = env
    r = subprocess.run([sys.executable, "-m", "offgrid", "-m", str(plain_model_path),
                        "--port", "0"] + args, cwd=str(ROOT), capture_output=True, text=True,
                       timeout=120, env=environ)
    assert r.returncode == 2 and "key" in r.stderr, r.stderr


# -- API keys -------------------------------------------------------------------------

@pytest.mark.parametrize("key", KEYS)
def test_every_key_works_as_bearer_and_as_x_api_key(locked, key):
    for headers in ({"Authorization": "Bearer " + key}, {"authorization": "bearer " + key},
                    {"x-api-key": key}):
        status, _, body = locked.get("/v1/models", headers=headers)
        assert status == 200, (headers, body)
    status, _, body = locked.post("/completion", {"prompt": "hi", "n_predict": 2},
                                  headers={"Authorization": "Bearer " + key})
    assert status == 200 and body["tokens_predicted"] == 2


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer "}, {"Authorization": "Bearer wrong"},
    {"Authorization": "Bearer " + KEYS[0][:-1]}, {"Authorization": "Bearer " + KEYS[0] + "x"},
    {"Authorization": "Basic " + KEYS[0]}, {"Authorization": KEYS[0]}, {"x-api-key": "wrong"},
    {"Authorization": "Bearer undefined"}, {"x-api-key": KEYS[0].upper()},
], ids=lambda h: json.dumps(h))
def test_a_missing_or_wrong_key_is_401_in_openai_shape(locked, headers):
    for method, path in (("GET", "/v1/models"), ("POST", "/completion"), ("GET", "/metrics"),
                         ("POST", "/tokenize")):
        status, resp_headers, body = locked.request(method, path, {"prompt": "x"}
                                                    if method == "POST" else None, headers=headers)
        assert_error(status, body, 401, "authentication_error")
        assert resp_headers.get("WWW-Authenticate") == "Bearer"


def test_health_stays_open(locked):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        status, _, body = locked.get("/health", headers=headers)
        assert status == 200 and body["status"] == "ok"


def test_keys_never_appear_in_the_log(plain_model_path):
    wrong = "wrong-key-5b7e21"
    with ServerProcess(plain_model_path, "-v", "--api-key", KEYS[0], threads=1, ctx=512) as s:
        s.get("/v1/models", headers={"Authorization": "Bearer " + KEYS[0]})
        s.get("/v1/models", headers={"x-api-key": KEYS[0]})
        s.post("/completion", {"prompt": "hi", "n_predict": 2}, headers={"x-api-key": KEYS[0]})
        s.get("/v1/models", headers={"Authorization": "Bearer " + wrong})
        s.get("/v1/models?api_key=%s" % KEYS[0])
        s.get("/v1/models?key=%s" % wrong, headers={"x-api-key": wrong})
        rawhttp.exchange(s.port, b"GET /health?k=%s HTTP/9.9\r\n\r\n" % wrong.encode())
        assert s.stop() == 0
    log = "".join(s.output)
    assert "GET /v1/models 200" in log and "GET /v1/models 401" in log    # it does log requests
    for secret in (KEYS[0], wrong):
        assert secret not in log


# -- CORS and web origins ---------------------------------------------------------------

def preflight(srv, origin, path="/completion", ask="content-type, authorization"):
    headers = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": ask}
    if origin:
        headers["Origin"] = origin
    return srv.request("OPTIONS", path, headers=headers)


def test_cors_is_off_by_default(open_srv):
    status, headers, body = preflight(open_srv, "http://a.example")
    assert_error(status, body, 403, "permission_error")
    assert "Access-Control-Allow-Origin" not in headers


def test_a_foreign_web_page_cannot_make_the_server_work(open_srv):
    # a page on another origin may POST without a preflight (a "simple" request),
    # and reads nothing back; it must not get the server to generate either
    before = open_srv.metrics()["llamacpp:tokens_predicted_total"]
    body = json.dumps({"prompt": "x", "n_predict": 50}).encode()
    for path in ("/completion", "/v1/completions", "/tokenize"):
        status, headers, resp = open_srv.request(
            "POST", path, raw=body, headers={"Origin": "http://evil.example",
                                             "Content-Type": "text/plain"})
        assert_error(status, resp, 403, "permission_error")
        assert "Access-Control-Allow-Origin" not in headers
    assert open_srv.metrics()["llamacpp:tokens_predicted_total"] == before
    # its own origin is not foreign
    own = "http://127.0.0.1:%d" % open_srv.port
    assert open_srv.post("/completion", {"prompt": "x", "n_predict": 2},
                         headers={"Origin": own})[0] == 200


def test_cors_allow_list_answers_preflights_for_listed_origins_only(cors):
    for origin in ("http://a.example", "http://b.example:3000"):
        status, headers, _ = preflight(cors, origin)
        assert status == 200        # llama-server's status for a preflight
        assert headers["Access-Control-Allow-Origin"] == origin
        assert "POST" in headers["Access-Control-Allow-Methods"]
        assert headers["Access-Control-Allow-Headers"] == "content-type, authorization"
    for origin in ("http://c.example", "http://a.example:8080", "https://a.example", "null",
                   "http://a.example.evil.example", None):
        status, headers, body = preflight(cors, origin)
        assert_error(status, body, 403, "permission_error")
        assert "Access-Control-Allow-Origin" not in headers


def test_cors_preflight_echoes_only_well_formed_header_names(cors):
    _, headers, _ = preflight(cors, "http://a.example", ask="x-ok, bad name, (x), content-type")
    assert headers["Access-Control-Allow-Headers"] == "x-ok, content-type"


def test_cors_listed_origin_gets_the_answer_and_others_are_refused(cors):
    status, headers, body = cors.post("/completion", {"prompt": "x", "n_predict": 2},
                                      headers={"Origin": "http://a.example"})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://a.example"
    assert headers["Vary"] == "Origin"
    status, headers, body = cors.post("/completion", {"prompt": "x", "n_predict": 2},
                                      headers={"Origin": "http://c.example"})
    assert_error(status, body, 403, "permission_error")
    assert "Access-Control-Allow-Origin" not in headers


# -- limits and timeouts -----------------------------------------------------------------

def test_body_over_the_limit_is_413_before_it_is_read(open_srv):
    with rawhttp.connect(open_srv.port) as sock:
        sock.sendall(rawhttp.request("POST", "/completion", headers={
            "Content-Length": str(50 * 1024 * 1024)}) + b"x" * 65536)
        t0 = time.monotonic()
        responses = rawhttp.parse_responses(rawhttp.read_until_closed(sock, timeout=10))
        elapsed = time.monotonic() - t0
    # answered with 64 KiB of the 50 MiB sent, and the connection closed soon after
    assert [r[0] for r in responses] == [413]
    assert json.loads(responses[0][2])["error"]["type"] == "invalid_request_error"
    assert elapsed < 5
    assert open_srv.post("/completion", {"prompt": "ok", "n_predict": 2})[0] == 200


def test_expect_100_continue_gets_413_instead_of_continue(open_srv):
    with rawhttp.connect(open_srv.port) as sock:
        sock.sendall(rawhttp.request("POST", "/completion", headers={
            "Content-Length": str(50 * 1024 * 1024), "Expect": "100-continue"}))
        data = rawhttp.read_until_closed(sock, timeout=10)
    assert data.startswith(b"HTTP/1.1 413 ") and b" 100 " not in data.split(b"\r\n")[0]


def test_expect_100_continue_gets_continue_for_a_good_request(open_srv):
    body = json.dumps({"prompt": "x", "n_predict": 2}).encode()
    with rawhttp.connect(open_srv.port) as sock:
        sock.sendall(rawhttp.request("POST", "/completion", headers={
            "Content-Length": str(len(body)), "Expect": "100-continue", "Connection": "close"}))
        first = sock.recv(100)
        assert first.startswith(b"HTTP/1.1 100 Continue\r\n")
        sock.sendall(body)
        rest = rawhttp.read_until_closed(sock)
    assert [r[0] for r in rawhttp.parse_responses((first + rest).split(b"\r\n\r\n", 1)[1])] == [200]


def test_header_limit_is_64_kib(open_srv):
    near = {"X-H%d" % i: "y" * 1000 for i in range(60)}        # about 60 KiB: fine
    assert open_srv.get("/health", headers=near)[0] == 200
    over = {"X-H%d" % i: "y" * 1000 for i in range(70)}        # about 70 KiB: too much
    status, _, body = open_srv.get("/health", headers=over)
    assert_error(status, body, 431, "invalid_request_error")


def test_an_idle_kept_alive_connection_is_closed_quietly(open_srv):
    with rawhttp.connect(open_srv.port) as sock:
        sock.sendall(rawhttp.request("GET", "/health"))
        t0 = time.monotonic()
        data = rawhttp.read_until_closed(sock, timeout=10)
        elapsed = time.monotonic() - t0
    # the answer, then nothing (no 408 on a connection that already had its answer)
    assert [r[0] for r in rawhttp.parse_responses(data)] == [200]
    assert 0.8 < elapsed < 5, elapsed


def test_a_new_connection_that_sends_nothing_gets_408(open_srv):
    with rawhttp.connect(open_srv.port) as sock:
        t0 = time.monotonic()
        data = rawhttp.read_until_closed(sock, timeout=10)
        elapsed = time.monotonic() - t0
    assert [r[0] for r in rawhttp.parse_responses(data)] == [408]
    assert 0.8 < elapsed < 5, elapsed


@pytest.mark.parametrize("what", ["headers", "body"])
def test_a_client_that_drips_its_request_is_cut_off_at_the_read_timeout(open_srv, what):
    # a byte every 0.2 s keeps a per-read timer alive for ever; the read
    # deadline (2 s here) is for the whole request, however it trickles in
    if what == "headers":
        start, drip = b"GET /health HTTP/1.1\r\n", b"X-Slow: " + b"a" * 200
    else:
        start = rawhttp.request("POST", "/completion", headers={"Content-Length": "300"})
        drip = b'{"prompt": "' + b"a" * 290
    with rawhttp.connect(open_srv.port) as sock:
        sock.sendall(start)
        t0 = time.monotonic()
        answered = None
        for byte in drip:
            if select.select([sock], [], [], 0.2)[0]:      # the answer is in
                answered = time.monotonic() - t0
                break
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            if time.monotonic() - t0 > 10:
                break
        data = rawhttp.read_until_closed(sock, timeout=5)
    assert [r[0] for r in rawhttp.parse_responses(data)] == [408]
    assert answered is not None and 1.5 < answered < 4, answered


def test_connections_beyond_the_cap_get_503_at_once():
    httpd = make_server("127.0.0.1", 0, APP)
    httpd.max_connections = 2
    httpd.peer_share = 1.0          # all three connections are from 127.0.0.1
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]
    try:
        # a connection holds a slot once it has spoken (silent ones wait threadless);
        # these sent a whole head and are being answered (their body is read), so
        # neither may be dropped for the newcomer (seats.py)
        held = [rawhttp.connect(port), rawhttp.connect(port)]
        for s in held:
            s.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        # both seated (a probe sent sooner could take a slot before the second, which
        # would then wait refused): the server's own count, no request of ours
        deadline = time.monotonic() + 10
        while httpd.seats.n < 2 or httpd.seats._waiting:     # seated, heads read
            assert time.monotonic() < deadline, "the two connections never got their slots"
            time.sleep(0.01)
        t0 = time.monotonic()
        # (not /health: that one is answered even beyond the cap)
        responses = rawhttp.exchange(port, rawhttp.request("GET", "/v1/models"))
        assert time.monotonic() - t0 < 2
        assert responses[0][0] == 503
        assert json.loads(responses[0][2])["error"]["message"] == "too many connections"
        for s in held:
            s.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:      # their threads end, the cap frees up
            status = rawhttp.exchange(port, rawhttp.request("GET", "/v1/models",
                                                            headers={"Connection": "close"}))
            if status and json.loads(status[0][2])["error"]["message"] == "Loading model":
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the cap never freed up")
    finally:
        httpd.shutdown()
        httpd.server_close()


# -- no files, no models by path ------------------------------------------------------------

def test_no_request_reads_or_writes_files_or_loads_a_model(open_srv, fim_model_path, tmp_path):
    pid = open_srv.proc.pid
    files_before = rawhttp.open_files_of(pid)
    target = tmp_path / "slot.bin"
    _, _, models = open_srv.get("/v1/models")
    own_id = models["data"][0]["id"]

    # a "model" that is a path is a name like any other: the default model answers
    for name in (str(fim_model_path), "../../../../etc/passwd", "file:///etc/passwd"):
        status, _, body = open_srv.post("/completion", {"prompt": "x", "n_predict": 2,
                                                        "model": name})
        assert status == 200 and body["model"] == own_id
    # the FIM model named by its path was not loaded: still one model, still no FIM
    assert [m["id"] for m in open_srv.get("/v1/models")[2]["data"]] == [own_id]
    assert open_srv.post("/infill", {"input_prefix": "a", "input_suffix": "b",
                                     "model": str(fim_model_path)})[0] == 501
    # llama-server's slot save/restore take file names: refused without
    # --slot-save-path (its 501), and a path is never a file name with it
    # (tests/test_slot_actions.py); POST /lora-adapters sets scales of the adapters
    # loaded at start (--lora), never loads a file: an object is a 400
    for path in ("/slots/0?action=save", "/slots/0?action=restore", "/slots/0",
                 "/lora-adapters"):
        status, _, body = open_srv.post(path, {"filename": str(target), "id_slot": 0})
        assert status == (400 if path == "/lora-adapters" else 501), (path, body)
    # OpenAI's model retrieve names models, never files: a path is no model here
    path = "/v1/models/" + str(fim_model_path)
    assert open_srv.post(path, {"filename": str(target)})[0] == 405
    status, _, body = open_srv.get(path)
    assert status == 404 and body["error"]["type"] == "invalid_request_error", body
    status, _, body = open_srv.post("/completion", {"prompt": "x", "n_predict": 2,
                                                    "lora": [{"path": str(target), "scale": 1}],
                                                    "slot_save_path": str(tmp_path)})
    assert status == 200
    status, _, body = open_srv.get("/../../../../etc/passwd")
    assert status == 404 and "root:" not in json.dumps(body)

    assert not target.exists() and list(tmp_path.iterdir()) == []
    assert rawhttp.open_files_of(pid) == files_before


def test_cors_localhost_keyword_allows_pages_on_this_machine_on_any_port(plain_model_path):
    with ServerProcess(plain_model_path, "--cors-origin", "localhost", threads=1, ctx=512) as s:
        for origin in ("http://localhost", "http://localhost:5173", "http://127.0.0.1:3000",
                       "http://[::1]:8080"):
            status, headers, _ = preflight(s, origin)
            assert status == 200 and headers["Access-Control-Allow-Origin"] == origin
        for origin in ("http://localhost.evil.example", "http://notlocalhost",
                       "http://evil.example"):
            status, headers, _ = preflight(s, origin)
            assert status == 403 and "Access-Control-Allow-Origin" not in headers
