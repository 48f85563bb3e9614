"""offgrid/jobs.py: request threads that start at once and are kept for the next job."""

import threading
import time

from offgrid.jobs import Threads


def test_every_job_starts_at_once_even_while_others_block():
    pool = Threads("t")
    release = threading.Event()
    started = []
    lock = threading.Lock()

    def job(i):
        with lock:
            started.append(i)
        release.wait(10)
    for i in range(5):
        pool.submit(job, i)
    deadline = time.monotonic() + 5
    while len(started) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(started) == [0, 1, 2, 3, 4], "a job waited behind a blocked one"
    release.set()


def test_a_thread_that_is_done_runs_the_next_job():
    pool = Threads("t")
    seen = []
    done = threading.Event()

    def job(last):
        seen.append(threading.current_thread())     # kept: ids of dead threads recur
        if last:
            done.set()
    for i in range(20):
        finished = threading.Event()
        pool.submit(lambda f=finished: (job(False), f.set()))
        assert finished.wait(5)
        time.sleep(0.005)           # the thread gets back to waiting
    pool.submit(job, True)
    assert done.wait(5)
    n = len({id(t) for t in seen})
    assert n < 5, "each job got a new thread: %d threads" % n


def test_no_more_than_max_idle_threads_wait():
    pool = Threads("counted", max_idle=2)
    release = threading.Event()
    for _ in range(6):
        pool.submit(release.wait, 10)
    release.set()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        alive = [t for t in threading.enumerate() if t.name == "counted"]
        if len(alive) <= 2:
            break
        time.sleep(0.01)
    assert len([t for t in threading.enumerate() if t.name == "counted"]) <= 2


def test_a_job_that_raises_leaves_the_thread_serving():
    pool = Threads("t", max_idle=1)
    ran = threading.Event()

    def bad():
        raise RuntimeError("a bug")
    pool.submit(bad)
    time.sleep(0.05)
    pool.submit(ran.set)
    assert ran.wait(5)
