"""Each model in its own worker process: a worker that dies costs its requests, not the server.

A real server runs gemma-3-270m (``-m``) and the tiny FIM model
(``--fim-model``), each in a worker.  Tests kill gemma's worker with a real
signal in the middle of a streamed generation or of a long prompt, and
check: that request gets its error, saying how the worker died; the other
model's stream, running meanwhile, finishes whole; the next request to the
crashed model succeeds within 10 s on a restarted worker; /metrics counts
the death; no process is left behind.
"""

import json
import os
import signal
import threading
import time

import pytest

try:
    from .rawhttp import argv_of, children
    from .serverproc import ServerProcess, parse_sse
except ImportError:
    from rawhttp import argv_of, children
    from serverproc import ServerProcess, parse_sse


def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def worker_of(srv, model_path, timeout=60):
    """The PID of the server's worker for ``model_path`` (once it has one)."""
    deadline = time.monotonic() + timeout
    while True:
        for pid in children(srv.proc.pid):
            # the worker's one argument is its settings as JSON (protocol.WorkerSettings)
            if any('"model": %s' % json.dumps(str(model_path)) in a for a in argv_of(pid)):
                return pid
        if time.monotonic() > deadline:
            raise AssertionError("no worker for %s" % model_path)
        time.sleep(0.05)


def wait_gone(pid, timeout=10):
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def deaths(srv, model_id):
    return srv.metrics()['offgrid_worker_deaths_total{model="%s"}' % model_id]


class Stream(threading.Thread):
    """A streamed request on its own thread; ``events`` fill in as they arrive."""

    def __init__(self, srv, path, body):
        super().__init__(daemon=True)
        self.srv, self.path, self.body = srv, path, dict(body, stream=True)
        self.events, self.status, self.started = [], None, threading.Event()

    def run(self):
        import json
        c = self.srv.conn(timeout=300)
        try:
            c.request("POST", self.path, body=json.dumps(self.body).encode(),
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            self.status = r.status
            buf = b""
            while True:
                chunk = r.read1(65536) if hasattr(r, "read1") else r.read(65536)
                if not chunk:
                    break
                buf += chunk
                while b"\n\n" in buf:
                    block, buf = buf.split(b"\n\n", 1)
                    self.events += parse_sse(block.decode("utf-8") + "\n\n")
                    self.started.set()
        finally:
            self.started.set()
            c.close()


@pytest.fixture(scope="module")
def srv(gemma_path, fim_model_path):
    # one thread per decode: on a busy machine two threads wait for each other
    # at every barrier, and the streams below would crawl
    with ServerProcess(gemma_path, "--fim-model", fim_model_path, threads=1) as s:
        yield s
    # SIGTERM of the front (ServerProcess.stop) leaves no worker behind:
    # checked in its own test below


@pytest.mark.parametrize("sig", [signal.SIGABRT, signal.SIGSEGV, signal.SIGKILL],
                         ids=["SIGABRT", "SIGSEGV", "SIGKILL"])
@pytest.mark.slow
def test_a_worker_killed_mid_stream_fails_its_request_and_only_its_request(
        srv, gemma_path, fim_model_path, sig):
    gemma_id = os.path.basename(str(gemma_path))
    before = deaths(srv, gemma_id)
    victim = worker_of(srv, gemma_path)
    other = Stream(srv, "/infill", {"input_prefix": "def f(", "n_predict": 1500,
                                    "temperature": 0, "cache_prompt": False})
    doomed = Stream(srv, "/completion", {"prompt": "Once upon a time", "n_predict": 2000,
                                         "temperature": 0, "cache_prompt": False})
    other.start()
    doomed.start()
    deadline = time.monotonic() + 120
    while len(doomed.events) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(doomed.events) >= 3, "gemma's stream never started"
    os.kill(victim, sig)
    doomed.join(60)
    other.join(300)

    last = doomed.events[-1]
    assert doomed.status == 200 and last["error"]["code"] == 500
    assert signal.Signals(sig).name in last["error"]["message"]
    assert other.status == 200 and other.events[-1]["stop"] is True
    assert other.events[-1]["tokens_predicted"] == 1500, "the other model's stream was harmed"

    t0 = time.monotonic()
    status, _, body = srv.post("/completion", {"prompt": "Hello", "n_predict": 4,
                                               "temperature": 0}, timeout=60)
    assert status == 200 and body["tokens_predicted"] == 4
    assert time.monotonic() - t0 < 10, "the crashed model took too long to come back"
    assert deaths(srv, gemma_id) == before + 1
    assert wait_gone(victim), "the dead worker is still there"
    assert worker_of(srv, gemma_path) != victim
    assert len(children(srv.proc.pid)) == 2, "one worker per model, no more"


@pytest.mark.slow
def test_a_worker_killed_in_a_long_prompt_answers_500_and_the_next_request_succeeds(
        srv, gemma_path):
    gemma_id = os.path.basename(str(gemma_path))
    before = deaths(srv, gemma_id)
    victim = worker_of(srv, gemma_path)
    prompt = [100 + (i * 7919) % 40000 for i in range(1800)]
    result = {}

    def post():
        result["r"] = srv.post("/completion", {"prompt": prompt, "n_predict": 1,
                                               "cache_prompt": False}, timeout=120)
    t = threading.Thread(target=post, daemon=True)
    t.start()
    # inside the prompt's decode: its first batch (of 512) is in the cache, 3 are to come
    srv.wait_cached(1, model=gemma_id)
    os.kill(victim, signal.SIGKILL)
    t.join(60)
    status, _, body = result["r"]
    assert status == 500 and body["error"]["type"] == "server_error"
    assert "SIGKILL" in body["error"]["message"] and "died" in body["error"]["message"]

    status, _, body = srv.post("/completion", {"prompt": "Hello", "n_predict": 2}, timeout=60)
    assert status == 200 and body["tokens_predicted"] == 2
    assert deaths(srv, gemma_id) == before + 1


@pytest.mark.slow
def test_health_and_slots_show_a_restarting_model_as_loading(srv, gemma_path):
    victim = worker_of(srv, gemma_path)
    os.kill(victim, signal.SIGKILL)
    seen = set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        _, _, health = srv.get("/health")
        states = {m["id"]: m["status"] for m in health["models"]}
        seen.add(states[os.path.basename(str(gemma_path))])
        if "loading" in seen and "loaded" in seen:
            break
        time.sleep(0.01)
    assert "loading" in seen and "loaded" in seen, seen
    status, _, body = srv.post("/completion", {"prompt": "Hi", "n_predict": 1}, timeout=60)
    assert status == 200


def test_sigterm_of_the_front_leaves_no_worker(plain_model_path, fim_model_path):
    s = ServerProcess(plain_model_path, "--fim-model", fim_model_path, threads=1).start()
    workers = [worker_of(s, plain_model_path), worker_of(s, fim_model_path)]
    assert s.stop() == 0
    assert all(wait_gone(pid) for pid in workers), "a worker outlived its front"


def test_a_front_killed_outright_takes_its_workers_with_it(plain_model_path):
    s = ServerProcess(plain_model_path, threads=1).start()
    pid = worker_of(s, plain_model_path)
    s.proc.kill()
    s.proc.wait()
    assert wait_gone(pid), "the worker outlived a SIGKILLed front"


def test_a_worker_past_its_memory_ceiling_is_killed_and_its_request_gets_500(plain_model_path):
    # Measure the worker's own RSS first, then set the ceiling a little above it.
    with ServerProcess(plain_model_path, threads=1) as s:
        s.post("/completion", {"prompt": "warm up", "n_predict": 4})
        pid = worker_of(s, plain_model_path)
        with open("/proc/%d/statm" % pid) as fh:
            rss_mib = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // (1 << 20)
    with ServerProcess(plain_model_path, "--worker-max-rss", rss_mib + 150, threads=1) as s:
        # 8 MB of text becomes millions of tokens and their pieces in the worker
        status, _, body = s.post("/tokenize", {"content": "ab " * (2 << 20),
                                               "with_pieces": True}, timeout=120)
        assert status == 500
        assert "out of memory" in body["error"]["message"]
        assert "--worker-max-rss" in body["error"]["message"]
        status, _, body = s.post("/completion", {"prompt": "again", "n_predict": 2}, timeout=60)
        assert status == 200 and body["tokens_predicted"] == 2
        m = s.metrics()
        assert m['offgrid_worker_deaths_total{model="%s"}'
                 % os.path.basename(str(plain_model_path))] == 1
