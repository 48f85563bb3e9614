"""What one request may make the server hold is bounded, and so is the front (issue 37, item 2).

``n_probs: 1024`` over several prompts cost 95 KB of response and 1.08 MB of
the front's memory per generated token, and 64 prompts x 2,048 tokens of it
was allowed (~135 GB).  Against a real server:

  * every field that asks for alternative tokens, on every route that has
    one, is capped at 20: 21 is a 400 naming the cap, 20 works;
  * a response that is not streamed, whose worst case holds more than
    131072 probabilities, is a 400 saying how to fit, whatever makes it big
    (prompts, choices, tokens, alternatives, a whole context); the same
    request streamed is accepted;
  * the front refuses new work with 503 while its own memory is past three
    quarters of ``--front-max-rss``, answers /health and /metrics meanwhile,
    and takes work again once the memory is back;
  * a stream whose client does not read is cancelled once 8 MiB of it waits
    in the front (the queue's bound, on a real WorkerClient's pending request).
"""

import json
import os
import socket
import threading
import time

import pytest

from offgrid.request import RequestCancel
from offgrid.server.api import budget
from offgrid.server.api.fields import MAX_N_PROBS
from offgrid.server.httpd import frontmem
from offgrid.server.models.pending import MAX_BUFFERED, Pending

try:
    from .serverproc import ServerProcess
except ImportError:
    from serverproc import ServerProcess

MSG = [{"role": "user", "content": "Hi"}]
# (route, body, the field asking for alternatives, and how it turns them on)
PROB_FIELDS = [
    ("/completion", {"prompt": "Hi", "n_predict": 2}, "n_probs", {}),
    ("/completion", {"prompt": "Hi", "n_predict": 2}, "logprobs", {}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, "logprobs", {}),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 2}, "top_logprobs",
     {"logprobs": True}),
]


@pytest.fixture(scope="module")
def srv(smollm_path):
    with ServerProcess(smollm_path, "-np", "2", ctx=2048) as s:
        yield s


@pytest.mark.parametrize("path,body,field,on", PROB_FIELDS,
                         ids=["%s:%s" % (p, f) for p, _, f, _ in PROB_FIELDS])
def test_every_probability_field_is_capped_at_20(srv, path, body, field, on):
    status, _, out = srv.post(path, dict(body, **on, **{field: MAX_N_PROBS + 1}))
    assert status == 400, out
    assert "at most %d" % MAX_N_PROBS in out["error"]["message"], out
    for n in (1024, 10 ** 6):
        assert srv.post(path, dict(body, **on, **{field: n}))[0] == 400
    status, _, out = srv.post(path, dict(body, **on, **{field: MAX_N_PROBS}))
    assert status == 200, out


# each of these asks for a response past the budget in its own way
TOO_MUCH = {
    "many prompts": ("/completion", {"prompt": ["Hi"] * 64, "n_predict": 2048,
                                     "n_probs": 20}),
    "choices": ("/completion", {"prompt": "Hi", "n_cmpl": 16, "n_predict": 1024,
                                "n_probs": 20}),
    "a whole context": ("/v1/chat/completions", {"messages": MSG, "n": 4, "logprobs": True,
                                                 "top_logprobs": 20}),
    "long": ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 5000, "logprobs": 20}),
    "one token each": ("/completion", {"prompt": ["Hi"] * 64, "n_predict": 2048,
                                       "n_probs": 1}),
}


@pytest.mark.parametrize("name", sorted(TOO_MUCH))
def test_a_response_past_the_probability_budget_is_a_400_unless_streamed(srv, name):
    path, body = TOO_MUCH[name]
    t0 = time.monotonic()
    status, _, out = srv.post(path, body)
    assert status == 400, out
    msg = out["error"]["message"]
    assert str(budget.MAX_PROB_ENTRIES) in msg and "stream" in msg, msg
    assert time.monotonic() - t0 < 5       # refused before anything ran
    # streamed, it holds nothing: taken (the first event is enough; hanging up
    # cancels every job of it)
    sock = socket.create_connection((srv.host, srv.port), timeout=60)
    try:
        data = json.dumps(dict(body, stream=True)).encode()
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
        head = sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
    finally:
        sock.close()
    srv.wait_idle(60)


def test_a_response_inside_the_budget_holds_its_probabilities(srv):
    status, _, out = srv.post("/completion", {"prompt": ["Hi", "Ho"], "n_predict": 8,
                                              "n_probs": 20, "ignore_eos": True})
    assert status == 200, out
    for r in out:
        assert len(r["completion_probabilities"]) == 8
        assert all(len(p["top_logprobs"]) == 20 for p in r["completion_probabilities"])


# -- the front's own ceiling -----------------------------------------------------------

def _rss_mib(pid):
    with open("/proc/%d/statm" % pid) as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def test_the_front_refuses_new_work_near_its_own_ceiling(smollm_path):
    with ServerProcess(smollm_path, "-np", "1", ctx=512) as probe:
        probe.post("/completion", {"prompt": "warm up", "n_predict": 2})
        idle = _rss_mib(probe.proc.pid)
    # refusals start 8 MiB above what an idle front holds
    ceiling = (idle + 8) / frontmem.REFUSE_AT
    with ServerProcess(smollm_path, "-np", "1", "--front-max-rss", "%.1f" % ceiling,
                       ctx=512) as srv:
        srv.post("/completion", {"prompt": "warm up", "n_predict": 2})
        assert srv.post("/completion", {"prompt": "Hi", "n_predict": 2})[0] == 200
        # a 7.9 MB prompt: the front holds its body, text and frame while the worker
        # tokenizes it (it is then too long for the context: a 400)
        big = {"prompt": "word " * (6 << 18), "n_predict": 1}
        result = {}
        t = threading.Thread(target=lambda: result.update(r=srv.post("/completion", big,
                                                                     timeout=120)),
                             daemon=True)
        t.start()
        deadline = time.monotonic() + 60
        refused, peak = None, 0
        while t.is_alive() and time.monotonic() < deadline:
            now = _rss_mib(srv.proc.pid)
            peak = max(peak, now)
            if now > ceiling * frontmem.REFUSE_AT + 1:
                # a quick POST (the front's check is the same for every route that
                # works): a probe that generated, once taken, could outlast the window
                # in which the big request holds its memory
                status, _, out = srv.post("/tokenize", {"content": "Hi"})
                if status == 503:
                    refused = out
                    # reading the shelf still answers
                    assert srv.get("/health")[0] == 200
                    assert srv.get("/metrics")[0] == 200
                    break
            time.sleep(0.01)
        t.join(120)
        assert refused is not None, "no refusal: the front held %.0f MiB at most, idle %.0f" % (
            peak, idle)
        assert "--front-max-rss" in refused["error"]["message"], refused
        # and work again once that memory is back
        deadline = time.monotonic() + 30
        while True:
            status, _, out = srv.post("/completion", {"prompt": "Hi", "n_predict": 2})
            if status == 200:
                break
            assert time.monotonic() < deadline, (status, out, _rss_mib(srv.proc.pid))
            time.sleep(0.5)


# -- a stream's buffer ---------------------------------------------------------------------

def test_a_stream_whose_client_does_not_read_is_cancelled_past_its_buffer():
    """What the worker's reader queues for one request is bounded: past MAX_BUFFERED the
    pieces are dropped and the request is cancelled when its thread next looks."""
    p = Pending("test")
    cancel = RequestCancel()
    piece = 64 << 10
    n = MAX_BUFFERED // piece
    for _ in range(n + 10):
        p.put_piece({"op": "piece", "text": "x"}, piece)
    assert p.queue.qsize() == n            # the rest were dropped
    assert p.buffered <= MAX_BUFFERED
    p.took(p.queue.get(), cancel)
    assert cancel.cancelled and "too slowly" in cancel.reason
