"""Pool, supersede, disconnects and shutdown, over real loopback HTTP on gemma-3-270m.

The real model is used here because these tests need requests that run long
enough to be interrupted: a few hundred generated tokens or a prompt of a few
thousand take seconds on it.  Every wait is bounded.
"""

import json
import socket
import time

import pytest

try:
    from .serverproc import Call, ServerProcess
except ImportError:
    from serverproc import Call, ServerProcess

LONG = {"n_predict": 400, "ignore_eos": True, "temperature": 0}


def long_prompt(n_words):
    return " ".join("word%d" % (i % 97) for i in range(n_words))


@pytest.fixture(scope="module")
def one(gemma_path):
    """A server with a single session, so requests queue behind each other."""
    with ServerProcess(gemma_path, "-np", "1", "-b", "128", ctx=4096) as s:
        yield s


@pytest.fixture(scope="module")
def two(gemma_path):
    with ServerProcess(gemma_path, "-np", "2") as s:
        yield s


def wait_generating(srv, n_cached=12, timeout=30):
    """Wait until the one session holds n_cached tokens: its prompt is done, output flows."""
    srv.wait_cached(n_cached, timeout=timeout)


def wait_in_prompt(srv, timeout=30):
    """Wait until the session has decoded the first batch (-b 128) of a long prompt: its
    evaluation is under way, and most of it still to come."""
    srv.wait_cached(128, timeout=timeout)


def test_newer_request_with_same_id_slot_cancels_the_running_one(one):
    a = Call(one, "/completion", dict(LONG, prompt="Once upon a time", id_slot=0))
    a.start()
    wait_generating(one)
    t0 = time.monotonic()
    b = one.post("/completion", {"prompt": "Hello", "n_predict": 4, "id_slot": 0,
                                 "temperature": 0})
    a.join(30)
    assert b[0] == 200 and b[2]["tokens_predicted"] == 4
    status, body = a.result
    assert status == 200
    # the superseded request got what it had generated so far, marked as not finished
    assert 0 < body["tokens_predicted"] < 400 and body["stop_type"] == "none"
    assert a.done_at - t0 < 5
    one.wait_idle()


def test_a_warm_up_waits_for_the_running_completion_instead_of_cancelling_it(one):
    # llama.vim: a suggestion is being generated on id_slot 0 when its ring
    # buffer sends a fire-and-forget warm-up (n_predict 0) on the same slot
    a = Call(one, "/completion", dict(LONG, n_predict=60, prompt="def main():", id_slot=0))
    a.start()
    wait_generating(one, n_cached=4)
    warm = Call(one, "/completion", {"prompt": "import os\nimport sys\n", "n_predict": 0,
                                     "id_slot": 0})
    warm.start()
    a.join(60)
    warm.join(60)
    status, body = a.result
    assert status == 200 and body["tokens_predicted"] == 60 and body["stop_type"] == "limit"
    assert body["content"], "the suggestion came back empty"
    assert warm.result[0] == 200 and warm.result[1]["tokens_predicted"] == 0
    assert warm.done_at >= a.done_at, "the warm-up ran before the completion it waited for"
    one.wait_idle()


def test_a_newer_warm_up_replaces_a_waiting_one_but_a_completion_replaces_both(one):
    a = Call(one, "/completion", dict(LONG, n_predict=80, prompt="Busy", id_slot=5))
    a.start()
    wait_generating(one, n_cached=2)
    w1 = Call(one, "/completion", {"prompt": "first warm", "n_predict": 0, "id_slot": 5})
    w1.start()
    one.wait_busy(queued=1)
    w2 = Call(one, "/completion", {"prompt": "second warm", "n_predict": 0, "id_slot": 5})
    w2.start()
    w1.join(10)
    assert w1.result is not None and w1.result[0] == 200, "the older warm-up was not answered"
    assert a.done_at is None, "a warm-up cancelled the completion"
    b = Call(one, "/completion", {"prompt": "Newest", "n_predict": 4, "id_slot": 5,
                                  "temperature": 0})
    b.start()
    for c in (a, w2, b):
        c.join(60)
    assert a.result[1]["stop_type"] == "none", "the newer completion did not supersede it"
    assert w2.result[0] == 200
    assert b.result[0] == 200 and b.result[1]["tokens_predicted"] == 4
    one.wait_idle()


def test_newer_request_answers_a_waiting_one_empty_at_once(one):
    a = Call(one, "/completion", dict(LONG, prompt="The story begins", id_slot=1))
    a.start()
    one.wait_busy()
    b = Call(one, "/completion", dict(LONG, prompt="Waiting", id_slot=2, stream=True))
    b.start()
    one.wait_busy(queued=1)
    c = Call(one, "/completion", {"prompt": "Newest", "n_predict": 8, "id_slot": 2,
                                  "temperature": 0})
    c.start()
    b.join(10)
    assert b.result is not None, "the superseded waiting request did not return"
    status, events = b.result
    # the waiting stream is answered in its own format: one final event, empty, cancelled
    assert status == 200 and len(events) == 1
    assert events[0]["stop"] is True and events[0]["tokens_predicted"] == 0
    assert a.done_at is None, "it returned at once, not after the running request"
    # the superseded request never started, so it left no canceller behind:
    # the newest one, which runs next on the same session, generates to the end
    one.post("/completion", {"prompt": "x", "n_predict": 1, "id_slot": 1})   # ends `a`
    c.join(60)
    assert c.result[0] == 200 and c.result[1]["tokens_predicted"] == 8
    a.join(30)
    one.wait_idle()


def test_streaming_client_that_disconnects_frees_the_session(one):
    before = one.metrics()["offgrid_requests_cancelled_total"]
    sock = socket.create_connection((one.host, one.port))
    body = json.dumps(dict(LONG, prompt="Tell me a long story", stream=True)).encode()
    sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    got = b""
    while got.count(b"data: ") < 3:
        got += sock.recv(4096)
    sock.close()
    t0 = time.monotonic()
    m = one.wait_idle(timeout=5)
    assert time.monotonic() - t0 < 2
    assert m["offgrid_requests_cancelled_total"] == before + 1
    # and the next request runs normally
    assert one.post("/completion", {"prompt": "Hi", "n_predict": 3})[2]["tokens_predicted"] == 3


@pytest.mark.slow
def test_client_that_disconnects_during_the_prompt_frees_the_session(one):
    prompt = long_prompt(1000)      # about 2900 tokens
    n_tokens = len(one.post("/tokenize", {"content": prompt})[2]["tokens"])
    assert 2000 < n_tokens < 4000
    sock = socket.create_connection((one.host, one.port))
    body = json.dumps({"prompt": prompt, "n_predict": 4, "cache_prompt": False}).encode()
    sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))
    wait_in_prompt(one)
    sock.close()
    t0 = time.monotonic()
    one.wait_idle(timeout=10)
    freed = time.monotonic() - t0
    # a full evaluation of that prompt takes seconds; the abort lands within a chunk
    full = one.post("/completion", {"prompt": prompt, "n_predict": 0, "cache_prompt": False})
    assert full[0] == 200
    full_ms = full[2]["timings"]["prompt_ms"]
    assert freed * 1000 < full_ms / 2, (freed, full_ms)


def test_a_request_cancelled_in_its_prompt_reports_only_the_prompt_work_it_did(one):
    prompt = long_prompt(1000)      # about 2900 tokens
    a = Call(one, "/completion", {"prompt": prompt, "n_predict": 4, "cache_prompt": False,
                                  "id_slot": 7})
    a.start()
    wait_in_prompt(one)
    one.post("/completion", {"prompt": "x", "n_predict": 1, "id_slot": 7})
    a.join(30)
    status, body = a.result
    assert status == 200 and body["stop_type"] == "none"
    # superseded part way through its prompt: timings say what was decoded, not the prompt
    assert body["timings"]["prompt_n"] < body["tokens_evaluated"], body["timings"]
    one.wait_idle()


def test_four_clients_on_two_sessions_all_complete(two):
    calls = [Call(two, "/completion", {"prompt": "Client %d says" % i, "n_predict": 16,
                                       "ignore_eos": True}) for i in range(4)]
    for c in calls:
        c.start()
    for c in calls:
        c.join(120)
    assert [c.result[0] for c in calls] == [200] * 4
    assert [c.result[1]["tokens_predicted"] for c in calls] == [16] * 4
    two.wait_idle()


def test_shutdown_answers_the_queue_503_and_exits_zero(gemma_path):
    with ServerProcess(gemma_path, "-np", "1", "--shutdown-grace", "2") as srv:
        running = Call(srv, "/completion", dict(LONG, n_predict=2000, prompt="Go on"))
        running.start()
        srv.wait_busy()
        queued = [Call(srv, "/completion", {"prompt": "q%d" % i, "n_predict": 4})
                  for i in range(3)]
        for q in queued:
            q.start()
        srv.wait_busy(queued=3)
        t0 = time.monotonic()
        code = srv.stop(timeout=30)
        assert code == 0
        assert time.monotonic() - t0 < 10
        for q in queued:
            q.join(5)
            assert q.result[0] == 503
            assert q.result[1]["error"]["message"] == "server is shutting down"
        running.join(5)
        # the running one was cancelled after the grace period and still got its answer
        assert running.result[0] == 200
        assert running.result[1]["tokens_predicted"] < 2000
