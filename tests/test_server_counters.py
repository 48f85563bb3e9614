"""Counters read by /metrics while handler threads write them: no race, no lost count."""

import threading

from offgrid.request import RequestCancel
from offgrid.server.serving.metrics import Metrics
from offgrid.server.serving.supersede import Supersede


def test_a_snapshot_can_be_taken_while_other_threads_count_new_endpoints():
    m = Metrics()
    stop = threading.Event()
    failures = []

    def read():
        while not stop.is_set():
            try:
                for _ in m.snapshot().requests.items():
                    pass
            except RuntimeError as e:       # "dictionary changed size during iteration"
                failures.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(20000):
            m.request("/e%d" % i)
    finally:
        stop.set()
        reader.join()
    assert not failures
    assert len(m.snapshot().requests) == 20000


def test_a_snapshot_is_a_copy():
    m = Metrics()
    m.request("/completion")
    snap = m.snapshot()
    m.request("/completion")
    m.error()
    assert snap.requests == {"/completion": 1} and snap.errors == 0


def test_superseding_from_many_threads_loses_no_count():
    s = Supersede()
    n_threads, per_thread = 8, 500

    def run():
        for _ in range(per_thread):
            s.register("slot", RequestCancel())

    threads = [threading.Thread(target=run) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # every register but the very first cancelled exactly one earlier request
    assert s.superseded == n_threads * per_thread - 1
