"""A stuck worker is found and replaced, and reading the shelf never waits on one (issue 37, item 3).

A worker that hung (SIGSTOPped, a libllama call or a template that never
returned) held /props, /slots, /metrics and every request for its model
without limit, while /health said "ok".  Now:

  * a real server's worker SIGSTOPped in the middle of a stream: the stream
    ends with an error naming the model within seconds of --worker-timeout,
    the worker is killed and replaced, the next request is served, and
    offgrid_worker_deaths_total counts it;
  * while a worker is stopped and not yet replaced, /props, /slots and
    /metrics answer within about a second each (its last answers), and
    /health says the model is unresponsive; SIGCONT and it is "ok" again;
  * the other ways to be stuck, on a worker in this process: a generation
    that makes no decode step while the worker still answers its heartbeat,
    and a call that never returns -- each ends in an error naming the model
    after its deadline, and the model serves again.
"""

import os
import signal
import threading
import time

import pytest

from offgrid.engine.session import ChatSession, shared_decoder
from offgrid.engine.loaded import Loaded
from offgrid.engine.worker import Worker
from offgrid.errors import WorkerDied
from offgrid.request import GenerationParams, RequestCancel
from offgrid.server.models.entry import ModelEntry
from offgrid.server.models.worker_client import WorkerClient

try:
    from .inprocworker import InProcessWorker
    from .serverproc import ServerProcess
    from .test_workers import worker_of, wait_gone
except ImportError:
    from inprocworker import InProcessWorker
    from serverproc import ServerProcess
    from test_workers import worker_of, wait_gone

TIMEOUT = 3     # --worker-timeout of the server that gets stopped


def stream_events(srv, body, out):
    """A streamed /completion on this thread; ``out`` gets its status, events, end time."""
    status, events = srv.stream("/completion", dict(body, stream=True), timeout=120)
    out.update(status=status, events=events, ended=time.monotonic())


def test_a_stopped_worker_is_replaced_and_its_stream_gets_an_error_naming_the_model(
        smollm_path):
    with ServerProcess(smollm_path, "--worker-timeout", TIMEOUT) as srv:
        model = os.path.basename(str(smollm_path))
        pid = worker_of(srv, smollm_path)
        out = {}
        t = threading.Thread(target=stream_events, daemon=True, args=(srv, {
            "prompt": "Once", "n_predict": 4000, "ignore_eos": True}, out))
        t.start()
        time.sleep(2.0)             # it streams
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        t.join(60)
        assert out, "the stream never ended"
        assert out["ended"] - t0 < TIMEOUT + 5, out["ended"] - t0
        last = out["events"][-1]
        assert "error" in last and model in last["error"]["message"], last
        assert "stuck" in last["error"]["message"], last
        assert wait_gone(pid), "the stuck worker was not killed"
        status, _, body = srv.post("/completion", {"prompt": "Hi", "n_predict": 2}, timeout=60)
        assert status == 200, body
        assert srv.metrics()['offgrid_worker_deaths_total{model="%s"}' % model] == 1
        assert worker_of(srv, smollm_path) != pid


def test_reading_the_shelf_never_waits_on_a_stopped_worker(smollm_path):
    with ServerProcess(smollm_path, "--worker-timeout", 60) as srv:
        srv.post("/completion", {"prompt": "Hi", "n_predict": 2})
        srv.get("/slots"), srv.get("/props"), srv.get("/metrics")     # their last answers
        pid = worker_of(srv, smollm_path)
        os.kill(pid, signal.SIGSTOP)
        try:
            for path in ("/slots", "/props", "/metrics", "/v1/models", "/slots", "/metrics"):
                t0 = time.monotonic()
                status, _, body = srv.get(path, timeout=30)
                took = time.monotonic() - t0
                assert status == 200, (path, body)
                assert took < 2.5, (path, took)
            # a few missed heartbeats (2 s apart) later, /health says so
            deadline = time.monotonic() + 15
            while True:
                status, _, body = srv.get("/health", timeout=10)
                if status == 503:
                    break
                assert time.monotonic() < deadline, body
                time.sleep(0.5)
            assert body["models"][0]["status"] == "unresponsive", body
            slots = srv.get("/slots")[2]
            assert slots[0]["state"] == "unresponsive", slots
        finally:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 15
        while srv.get("/health")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.5)
        status, _, body = srv.post("/completion", {"prompt": "Hi", "n_predict": 2})
        assert status == 200, body
        assert pid == worker_of(srv, smollm_path)       # it was slow, not dead: kept


# -- stuck while its heartbeat answers (in this process) -------------------------------------

@pytest.fixture
def client(plain_model):
    """A WorkerClient over one real session of a shared decoder, its worker on threads of
    this process, with deadlines of a fraction of a second."""
    decoder = shared_decoder(plain_model, 1, n_ctx=256, n_batch=64, n_threads=1)
    session = ChatSession(plain_model, decoder=decoder)
    loaded = Loaded(plain_model, [session], decoder=decoder)
    c = WorkerClient("tiny-stuck", [], spawn=lambda argv: InProcessWorker(loaded))
    c.heartbeat_every, c.timeout = 0.2, 0.5        # progress: 2 s, calls: 5 s
    c.start(timeout=30)
    released = threading.Event()
    try:
        yield c, session, released
    finally:
        released.set()
        c.close()
        session.close()
        decoder.close()


def test_a_generation_that_makes_no_decode_step_is_found_stuck(client, monkeypatch):
    c, session, released = client
    monkeypatch.setattr(session, "complete", lambda *a, **k: released.wait(60))
    entry = ModelEntry.started(c, "tiny-stuck")
    t0 = time.monotonic()
    with pytest.raises(WorkerDied) as e:
        entry.worker.generate(0, [1, 2, 3], GenerationParams(n_predict=4),
                              cancel=RequestCancel())
    took = time.monotonic() - t0
    assert "tiny-stuck" in str(e.value) and "no decode step" in str(e.value), e.value
    assert took < c.timeout * c.progress_after + 5, took
    released.set()
    monkeypatch.undo()
    assert c.wait_ready(30)
    assert c.call("detokenize", tokens=[1, 2])["content"] is not None


def test_a_call_that_never_returns_is_found_stuck(client, monkeypatch):
    c, session, released = client
    monkeypatch.setattr(Worker, "call_detokenize", lambda self, tokens: released.wait(60))
    t0 = time.monotonic()
    with pytest.raises(WorkerDied) as e:
        c.call("detokenize", "POST /detokenize", tokens=[1, 2])
    took = time.monotonic() - t0
    assert "tiny-stuck" in str(e.value) and "unanswered" in str(e.value), e.value
    assert took < c.timeout * c.call_after + 5, took
    released.set()
    monkeypatch.undo()
    assert c.wait_ready(30)
    assert c.call("detokenize", tokens=[1, 2])["content"] is not None
