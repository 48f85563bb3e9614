"""Three replicas behind Debian's HAProxy and nginx, with docs/fleet.md's configurations.

Issue 50's "done when", through each balancer on loopback: a stream arrives
in many reads, the first long before the end (through a bare nginx
``proxy_pass`` too, which buffers streams that lack X-Accel-Buffering: no); conversations hashed on a
session header read >= 90% of each later turn's prompt from the cache, round
robin far less; a replica SIGKILLed mid-stream ends that stream at once, the
conversation moves to another replica and the others keep theirs; a draining
replica finishes its stream and gets nothing new; past --max-queue the 503 is
redispatched.  The configurations are read from docs/fleet.md's blocks, only
their ports changed, so the page shows what was tested.

SmolLM2-135M, few tokens, one thread per replica: the 2-core machine runs
three replicas and a balancer.  `make fleet` installs haproxy and nginx (the
test fails naming it when either is missing) and runs this file; `make test`
leaves it out (marked ``fleet``: about a minute and a half).
"""

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

try:
    from . import doctext, rawhttp
    from .serverproc import ROOT, ServerProcess, free_port, parse_sse
except ImportError:
    import doctext
    import rawhttp
    from serverproc import ROOT, ServerProcess, free_port, parse_sse

pytestmark = pytest.mark.fleet

NAMES = ["a", "b", "c"]
DOC_REPLICAS = ["127.0.0.1:8101", "127.0.0.1:8102", "127.0.0.1:8103"]
DOC_FRONT = "127.0.0.1:8000"
HEADER = "X-Session-Id"
INSTANCE = "X-Offgrid-Instance"


# --------------------------------------------------------------------------
# The replicas and the balancers
# --------------------------------------------------------------------------

class Replica(ServerProcess):
    """One offgrid replica on a fixed port (a restart keeps it: the balancer's config
    names it): four sessions, no queue, every token its own write."""

    def __init__(self, model, name, port):
        super().__init__(model)
        self.name = name
        self.port = port
        # docs/fleet.md's flags (tests/test_docs.py checks they are here), then the
        # test's: no queue at all, and a write per token so a stream has many
        self.args = ["-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                     "--instance-name", name, "--max-queue", "0",
                     "-np", "4", "-t", "1", "-c", "1024", "--stream-interval-ms", "0"]


def doc_config(kind):
    """docs/fleet.md's configuration block for haproxy or nginx."""
    marker = "backend offgrid" if kind == "haproxy" else "upstream offgrid"
    (text,) = [b.text for b in doctext.blocks(Path("docs/fleet.md"))
               if b.lang == "text" and marker in b.text]
    return text


class Balancer:
    """haproxy or nginx in the foreground with docs/fleet.md's configuration, its ports
    moved to the test's; ``edit`` changes the text further (round robin)."""

    def __init__(self, kind, replicas, folder, edit=None):
        self.kind, self.port, self.folder = kind, free_port(), Path(folder)
        text = doc_config(kind).replace(DOC_FRONT, "127.0.0.1:%d" % self.port)
        for doc, r in zip(DOC_REPLICAS, replicas):
            text = text.replace(doc, "127.0.0.1:%d" % r.port)
        if edit is not None:
            text = edit(text)
        if os.environ.get("FLEET_LOG") and kind == "haproxy":
            # FLEET_LOG=1: each request's line (and its retries) on haproxy's stdout,
            # printed when it stops
            text = text.replace("global\n", "global\n    log stdout format raw local0\n", 1)
            text = text.replace("defaults\n", "defaults\n    log global\n    option httplog\n", 1)
        self.text = text
        self.proc = None

    def start(self):
        binary = shutil.which(self.kind) or "/usr/sbin/" + self.kind
        assert os.path.exists(binary), "%s is missing: run `make fleet`" % self.kind
        conf = self.folder / ("%s-%d.conf" % (self.kind, self.port))
        conf.write_text(self.text)
        if self.kind == "haproxy":
            argv = [binary, "-f", str(conf), "-db"]
        else:
            argv = [binary, "-c", str(conf), "-p", str(self.folder), "-g",
                    "daemon off; pid %s/nginx-%d.pid; error_log %s/nginx-%d.log;"
                    % (self.folder, self.port, self.folder, self.port)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.proc.kill()
                    raise AssertionError("%s did not start:\n%s\n%s" % (
                        self.kind, self.proc.stdout.read().decode(), self.text))
                time.sleep(0.05)

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if os.environ.get("FLEET_LOG") and self.proc is not None:
            print(self.proc.stdout.read().decode("utf-8", "replace"))

    # -- requests through it ----------------------------------------------------
    def request(self, method, path, body=None, key=None, timeout=60):
        """(status, headers, parsed body) of one request on a new connection."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            headers = {"Content-Type": "application/json"}
            if key is not None:
                headers[HEADER] = key
            c.request(method, path, body=json.dumps(body).encode() if body is not None
                      else None, headers=headers)
            r = c.getresponse()
            data = r.read()
            parsed = json.loads(data) if "json" in (r.getheader("Content-Type") or "") \
                else data
            return r.status, {k.lower(): v for k, v in r.getheaders()}, parsed
        finally:
            c.close()

    def post_in_two_writes(self, path, body, key, pause=0.05):
        """(status, headers, parsed body) of a POST whose head and body go out in two
        writes ``pause`` apart, as most clients' do: the balancer may start on the head
        before the body is in."""
        data = json.dumps(body).encode()
        head = rawhttp.request("POST", path, data, {
            HEADER: key, "Content-Type": "application/json", "Connection": "close"})
        sock = rawhttp.connect(self.port, timeout=30)
        try:
            sock.sendall(head[:-len(data)])
            time.sleep(pause)
            sock.sendall(data)
            raw = rawhttp.read_until_closed(sock, timeout=30)
        finally:
            sock.close()
        (status, headers, payload), = rawhttp.parse_responses(raw)
        return status, {k.lower(): v for k, v in headers.items()}, json.loads(payload)

    def instance_for(self, key):
        """The replica the balancer sends ``key``'s requests to now."""
        status, headers, body = self.request("GET", "/health", key=key, timeout=10)
        assert status == 200, body
        return headers[INSTANCE.lower()]

    def open_stream(self, body, key):
        """A streamed /completion through the balancer, its first event in: the socket."""
        sock = rawhttp.connect(self.port, timeout=30)
        data = json.dumps(body).encode()
        sock.sendall(rawhttp.request("POST", "/completion", data, {
            HEADER: key, "Content-Type": "application/json", "Connection": "close"}))
        first = sock.recv(1 << 16)
        while b"data: " not in first:
            more = sock.recv(1 << 16)
            assert more, first
            first += more
        return sock, first


@pytest.fixture(scope="module")
def replicas(lib, smollm_path):
    ports = [free_port() for _ in NAMES]
    rs = [Replica(smollm_path, n, p) for n, p in zip(NAMES, ports)]
    try:
        for r in rs:
            r.start()
        yield rs
    finally:
        for r in rs:
            if r.proc is not None and r.proc.poll() is None:
                r.stop()


@pytest.fixture(scope="module", params=["haproxy", "nginx"])
def balancer(request, replicas, tmp_path_factory):
    b = Balancer(request.param, replicas, tmp_path_factory.mktemp(request.param)).start()
    try:
        yield b
    finally:
        b.stop()


def keys_by_replica(balancer, n=40):
    """{instance: [keys the balancer sends there]} for n keys."""
    out = {}
    for i in range(n):
        key = "conversation-%d" % i
        out.setdefault(balancer.instance_for(key), []).append(key)
    return out


@pytest.fixture
def fleet(balancer, replicas):
    """The three replicas up (one a test killed or drained is started again, on its
    port), and the balancer sending each its share of the keys again."""
    for i, r in enumerate(replicas):
        if r.proc.poll() is None and not healthy(r):
            r.proc.wait(30)         # a drain a failed test left under way: let it end
        if r.proc.poll() is not None:
            replicas[i] = fresh = Replica(r.args[1], r.name, r.port)
            fresh.start()
    deadline = time.monotonic() + 30
    while True:
        seen = keys_by_replica(balancer)
        if len(seen) == len(replicas):
            return balancer, replicas, seen
        assert time.monotonic() < deadline, "the balancer never used every replica: %s" % seen
        time.sleep(0.5)


def healthy(replica):
    try:
        return replica.get("/health", timeout=5)[0] == 200
    except OSError:
        return False


def replica_named(replicas, name):
    (r,) = [r for r in replicas if r.name == name]
    return r


def events_of(raw):
    """The JSON events of a raw streamed response (its chunks joined: a proxy may cut
    them elsewhere than the replica did); a cut-off end is left out."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    body = b""
    if b"chunked" in head.lower():
        while rest:
            size_line, sep, rest = rest.partition(b"\r\n")
            if not sep:
                break
            size = int(size_line.split(b";")[0] or b"0", 16)
            if size == 0:
                break
            body += rest[:size]
            rest = rest[size + 2:]
    else:
        body = rest
    return [e for e in parse_sse(body.decode("utf-8", "replace")) if isinstance(e, dict)]


def stream_body(n_predict):
    return {"prompt": "Write a long story about a lighthouse keeper.", "n_predict": n_predict,
            "ignore_eos": True, "temperature": 0, "stream": True}


# --------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------

def test_a_stream_arrives_in_many_reads_the_first_long_before_the_end(fleet):
    balancer, _, _ = fleet
    t0 = time.monotonic()
    sock, first = balancer.open_stream(stream_body(150), "stream")
    t_first = time.monotonic() - t0
    reads = 1
    data = first
    while True:
        more = sock.recv(1 << 16)
        if not more:
            break
        reads += 1
        data += more
    total = time.monotonic() - t0
    sock.close()
    events = events_of(data)
    assert events[-1]["stop"] is True and events[-1]["tokens_predicted"] == 150
    # a buffering proxy hands a stream on in a few reads at its end (nginx's stock
    # proxy_buffering: 4-5 reads for a 60-token stream)
    assert reads >= 20, "%d reads in %.2fs" % (reads, total)
    assert t_first < total / 3, "the first event after %.2fs of %.2fs" % (t_first, total)
    print("figures: %s stream: %d reads, first at %.2fs of %.2fs"
          % (balancer.kind, reads, t_first, total))


STOCK_NGINX = """worker_processes 1;
events { worker_connections 64; }
http {
    server {
        listen 127.0.0.1:8000;
        location / { proxy_pass http://127.0.0.1:8101; }
    }
}
"""


def test_a_stock_nginx_streams_because_the_replica_asks_it_not_to_buffer(replicas, tmp_path):
    """nginx's defaults (HTTP/1.0 to the replica, proxy_buffering on) hold a stream in
    their buffers; offgrid's X-Accel-Buffering: no turns that off per response (without
    it this proxy handed a 60-token stream on in 3 reads, at its end)."""
    stock = Balancer("nginx", replicas, tmp_path)
    stock.text = STOCK_NGINX.replace(DOC_FRONT, "127.0.0.1:%d" % stock.port).replace(
        DOC_REPLICAS[0], "127.0.0.1:%d" % replicas[0].port)
    stock.start()
    try:
        t0 = time.monotonic()
        sock, first = stock.open_stream(stream_body(60), "stock")
        t_first = time.monotonic() - t0
        reads, data = 1, first
        while True:
            more = sock.recv(1 << 16)
            if not more:
                break
            reads, data = reads + 1, data + more
        total = time.monotonic() - t0
        sock.close()
    finally:
        stock.stop()
    assert events_of(data)[-1]["tokens_predicted"] == 60
    assert reads >= 20 and t_first < total / 3, (reads, t_first, total)


SYSTEM = ("You are assistant {c} of the {tag} lighthouse museum. Answer in one short sentence. "
          "The museum keeps logbooks, lenses, foghorns, charts and the keepers' letters; "
          "visitors ask about the keepers, the storms, the ships that passed and the lamps. ")


def conversation_ratios(balancer, tag, n_conversations=4, turns=5):
    """Every conversation's turns, one request at a time in turn order (conversation 0's
    first turn, 1's first, ...), each hashed on a key of its own, its system prompt
    naming ``tag`` (so no earlier run's cache serves it); [[cached / prompt tokens of
    each later turn]]."""
    history = [[{"role": "system", "content": (SYSTEM.format(c=c, tag=tag) +
                 " ".join("Fact %d-%d: lamp %d burned %d nights." % (c, i, i * 3 + c, i * 7)
                          for i in range(9)))}] for c in range(n_conversations)]
    ratios = [[] for _ in range(n_conversations)]
    for turn in range(turns):
        for c in range(n_conversations):
            history[c].append({"role": "user",
                               "content": "And storm %d?" % (turn * 5 + c)})
            status, _, body = balancer.request("POST", "/v1/chat/completions", {
                "messages": history[c], "max_tokens": 4, "temperature": 0},
                key="%s-%d" % (tag, c))
            assert status == 200, body
            history[c].append({"role": "assistant",
                               "content": body["choices"][0]["message"]["content"]})
            u = body["usage"]
            if turn:
                ratios[c].append(u["prompt_tokens_details"]["cached_tokens"]
                                 / u["prompt_tokens"])
    return ratios


def round_robin(kind):
    """docs/fleet.md's configuration with round robin instead of the hash."""
    if kind == "haproxy":
        return lambda text: text.replace("balance hash var(txn.key)", "balance roundrobin")
    return lambda text: re.sub(r"\n\s*hash \$session_key consistent;", "", text)


def test_hashing_on_a_session_header_keeps_each_conversation_warm(fleet, tmp_path):
    balancer, replicas, _ = fleet
    run = "%x" % time.monotonic_ns()     # conversations no replica has seen
    hashed = conversation_ratios(balancer, "hashed-" + run)
    later = [r for conv in hashed for r in conv]
    assert min(later) >= 0.9, hashed
    rr = Balancer(balancer.kind, replicas, tmp_path, edit=round_robin(balancer.kind)).start()
    try:
        # other system prompts: the hashed run's caches must not serve these
        spread = conversation_ratios(rr, "spread-" + run)
    finally:
        rr.stop()
    spread_later = [r for conv in spread for r in conv]
    warm = sum(r >= 0.9 for r in spread_later)
    print("figures: %s later turns from cache: hashed min %.2f mean %.2f; round robin "
          "mean %.2f, %d of %d >= 0.9" % (balancer.kind, min(later), sum(later) / len(later),
                                          sum(spread_later) / len(spread_later), warm,
                                          len(spread_later)))
    # round robin sends a turn where this conversation was never, or turns ago
    assert sum(spread_later) / len(spread_later) < sum(later) / len(later) - 0.15, spread
    assert warm < len(spread_later) / 2, spread


def test_a_replica_killed_mid_stream_ends_it_and_moves_only_its_conversations(fleet):
    balancer, replicas, seen = fleet
    victim_name = sorted(seen, key=lambda name: -len(seen[name]))[0]
    victim = replica_named(replicas, victim_name)
    key = seen[victim_name][0]
    others = {seen[name][0]: name for name in seen if name != victim_name}
    sock, _ = balancer.open_stream(stream_body(3000), key)
    victim.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    data, closed = rawhttp.read_and_whether_closed(sock, timeout=10)
    ended = time.monotonic() - killed
    sock.close()
    assert closed and ended < 2.0, "the stream ran on %.1fs after its replica died" % ended
    assert b'"stop":true' not in data          # cut short, not finished
    # gone: a connection in the instant it dies may still be accepted, then reset (502)
    victim.proc.wait(10)
    # its conversation's next request: another replica, within a few seconds
    t0 = time.monotonic()
    status, headers, body = balancer.request("POST", "/completion", {
        "prompt": "Hello", "n_predict": 2}, key=key, timeout=30)
    moved_in = time.monotonic() - t0
    assert status == 200, body
    assert headers[INSTANCE.lower()] != victim_name and moved_in < 5.0, (headers, moved_in)
    # and every other conversation keeps its replica
    for other_key, name in others.items():
        status, headers, _ = balancer.request("POST", "/completion", {
            "prompt": "Hello", "n_predict": 2}, key=other_key, timeout=30)
        assert status == 200 and headers[INSTANCE.lower()] == name, (other_key, headers)


def test_a_draining_replica_finishes_its_stream_and_gets_nothing_new(fleet):
    balancer, replicas, seen = fleet
    victim_name = sorted(seen, key=lambda name: -len(seen[name]))[0]
    victim = replica_named(replicas, victim_name)
    keys = [k for ks in seen.values() for k in ks[:2]]
    sock, first = balancer.open_stream(stream_body(400), seen[victim_name][0])
    victim.proc.send_signal(signal.SIGTERM)
    rest = {}
    reader = threading.Thread(target=lambda: rest.update(
        data=rawhttp.read_until_closed(sock, timeout=60), at=time.monotonic()))
    reader.start()
    answered = []
    for key in keys:
        status, headers, body = balancer.request("POST", "/completion", {
            "prompt": "Hello", "n_predict": 2}, key=key, timeout=30)
        assert status == 200, (key, body)
        answered.append((headers[INSTANCE.lower()], time.monotonic()))
    reader.join(60)
    sock.close()
    events = events_of(first + rest["data"])
    assert events[-1]["stop"] is True and events[-1]["tokens_predicted"] == 400, events[-1]
    assert victim_name not in [name for name, _ in answered], answered
    # the requests came while the stream still ran: they met the drain
    assert answered[0][1] < rest["at"], "the stream ended before the first new request"
    assert victim.proc.wait(30) == 0


def test_past_max_queue_the_503_is_redispatched(fleet):
    balancer, replicas, seen = fleet
    busy_name = sorted(seen)[0]
    busy = replica_named(replicas, busy_name)
    key = seen[busy_name][0]
    # fill its four sessions directly; its queue holds none (--max-queue 0)
    streams = []
    for _ in range(4):
        sock = rawhttp.connect(busy.port, timeout=30)
        sock.sendall(rawhttp.request("POST", "/completion", json.dumps(stream_body(3000))
                                     .encode(), {"Content-Type": "application/json"}))
        assert sock.recv(1 << 16).startswith(b"HTTP/1.1 200")
        streams.append(sock)
    try:
        refused = busy.metrics()["offgrid_errors_total"]
        t0 = time.monotonic()
        # the head and the body apart: HAProxy retries only a request it holds whole
        # (docs/fleet.md's option http-buffer-request)
        status, headers, body = balancer.post_in_two_writes("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, key)
        took = time.monotonic() - t0
        assert status == 200, body
        assert headers[INSTANCE.lower()] != busy_name, headers
        assert took < 5.0, took
        # the replica its key hashes to was asked first, and said 503
        assert busy.metrics()["offgrid_errors_total"] >= refused + 1
    finally:
        for sock in streams:
            sock.close()
