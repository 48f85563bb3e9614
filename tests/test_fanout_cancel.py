"""A request that fans out to many jobs is one unit of cancellation, and takes turns (issue 37).

One request may become prompts x choices jobs (``/completion``'s prompt
list and ``n_cmpl``, ``/v1/completions``' prompt list and ``n``, chat's
``n``), all waiting for the model's ``-np`` sessions.  On a real server of
two sessions, for each of these shapes, streamed and not:

  * the client that sent it hangs up while most of its jobs wait: every job
    ends within a few seconds (none left running or queued), the queued ones
    never start, and ``offgrid_requests_cancelled_total`` counts them all;
  * a second client's one-job request, sent while the first's jobs wait, is
    answered while they still wait: the queue takes turns between requests
    instead of serving the first request's jobs ahead of everyone.
"""

import json
import socket
import threading
import time

import pytest

try:
    from .serverproc import ServerProcess
except ImportError:
    from serverproc import ServerProcess

# tokens per fanned-out job: long enough that none ends before the hang-up's checks
JOB_TOKENS = 400
# ... and short enough, where another request waits for one of them to end (a
# session is never taken from a running job), that it does so within seconds
TURN_TOKENS = 32
SETTLE = 8.0        # seconds every job may take to end after the hang-up (the issue: "a few")


def fanouts():
    prompts = ["Story number %d begins:" % i for i in range(32)]
    chat = [{"role": "user", "content": "Tell me a long story."}]
    return {
        "completion": ("/completion", {"prompt": prompts, "n_cmpl": 2,
                                       "n_predict": JOB_TOKENS}, 64),
        "v1-completions": ("/v1/completions", {"prompt": prompts, "n": 2,
                                               "max_tokens": JOB_TOKENS}, 64),
        "chat": ("/v1/chat/completions", {"messages": chat, "n": 16,
                                          "max_tokens": JOB_TOKENS}, 16),
    }


CASES = [(name, stream) for name in fanouts() for stream in (False, True)]


@pytest.fixture(scope="module")
def srv(smollm_path):
    with ServerProcess(smollm_path, "-np", "2", ctx=4096) as s:
        yield s


def body_of(name, stream, tokens=JOB_TOKENS):
    path, body, n_jobs = fanouts()[name]
    body = dict(body, ignore_eos=True, temperature=0, stream=stream)
    for key in ("n_predict", "max_tokens"):
        if key in body:
            body[key] = tokens
    return path, body, n_jobs


def send_raw(srv, path, body):
    """A request on a socket of our own, whose answer is never read; returns the socket."""
    data = json.dumps(body).encode()
    sock = socket.create_connection((srv.host, srv.port), timeout=10)
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
    return sock


def wait_metrics(srv, ok, timeout, what):
    deadline = time.monotonic() + timeout
    while True:
        m = srv.metrics()
        if ok(m):
            return m
        if time.monotonic() > deadline:
            raise AssertionError("%s not within %gs: %r" % (what, timeout, {
                k: v for k, v in m.items() if "queue" in k or "busy" in k or "cancel" in k}))
        time.sleep(0.05)


@pytest.mark.parametrize("name,stream", CASES)
def test_hanging_up_cancels_every_job_of_a_fanned_out_request(srv, name, stream):
    srv.wait_idle(60)
    path, body, n_jobs = body_of(name, stream)
    before = srv.metrics()["offgrid_requests_cancelled_total"]
    sock = send_raw(srv, path, body)
    # both sessions taken, the rest of its jobs waiting
    m = wait_metrics(srv, lambda m: m["offgrid_sessions_busy"] == 2
                     and m["offgrid_queue_length"] >= n_jobs - 2 - 2, 30, "the jobs queued")
    time.sleep(1.0)
    at_hangup = srv.metrics()
    queued = at_hangup["offgrid_queue_length"]
    assert queued >= n_jobs - 6, at_hangup     # a job of JOB_TOKENS outlasts a second
    sock.close()
    t0 = time.monotonic()
    after = wait_metrics(srv, lambda m: m["offgrid_sessions_busy"] == 0
                         and m["offgrid_queue_length"] == 0, SETTLE, "every job ended")
    took = time.monotonic() - t0
    cancelled = after["offgrid_requests_cancelled_total"] - before
    # every job waiting at the hang-up was cancelled (never started), and the
    # two that ran too: none of them could have finished its tokens
    assert cancelled >= queued + 2, (cancelled, queued, at_hangup)
    assert took < SETTLE


@pytest.mark.parametrize("name,stream", CASES)
def test_another_request_is_served_while_a_fanned_out_one_waits(srv, name, stream):
    srv.wait_idle(60)
    path, body, n_jobs = body_of(name, stream, TURN_TOKENS)
    sock = send_raw(srv, path, body)
    try:
        wait_metrics(srv, lambda m: m["offgrid_queue_length"] >= n_jobs - 4, 30,
                     "the first request's jobs queued")
        t0 = time.monotonic()
        status, _, out = srv.post("/completion", {"prompt": "Hello", "n_predict": 8,
                                                  "ignore_eos": True}, timeout=60)
        took = time.monotonic() - t0
        assert status == 200, out
        assert out["tokens_predicted"] == 8
        # answered while the first request's jobs still wait: it took its turn
        # beside them, not behind them
        queued = srv.metrics()["offgrid_queue_length"]
        assert queued >= n_jobs - 8, (queued, took)
    finally:
        sock.close()
    wait_metrics(srv, lambda m: m["offgrid_sessions_busy"] == 0
                 and m["offgrid_queue_length"] == 0, SETTLE, "the first request cancelled")


def test_two_fanned_out_requests_take_turns(srv):
    """Two requests of many jobs each: sessions alternate between them."""
    srv.wait_idle(60)
    path, body, n_jobs = body_of("completion", False, TURN_TOKENS)
    small = dict(body, n_predict=4, prompt=body["prompt"][:8], n_cmpl=1)
    results = {}

    def run(key, b):
        t0 = time.monotonic()
        status, _, out = srv.post(path, b, timeout=120)
        results[key] = (status, time.monotonic() - t0)
    big = send_raw(srv, path, body)
    try:
        wait_metrics(srv, lambda m: m["offgrid_queue_length"] >= n_jobs - 4, 30, "queued")
        t = threading.Thread(target=run, args=("small", small), daemon=True)
        t.start()
        t.join(60)
        assert results.get("small", (None,))[0] == 200, results
        # eight jobs of four tokens, each taking its turn beside the big request's
        assert srv.metrics()["offgrid_queue_length"] >= n_jobs - 24
    finally:
        big.close()
    wait_metrics(srv, lambda m: m["offgrid_sessions_busy"] == 0
                 and m["offgrid_queue_length"] == 0, SETTLE, "the big request cancelled")
