"""offgrid/jobs.py: request threads that start at once and are kept for the next job."""

import threading
import time

from offgrid.jobs import Threads


def wait_idle_threads(pool, n, timeout=5):
    """Wait until ``n`` of the pool's threads wait for a job (its own count of them)."""
    deadline = time.monotonic() + timeout
    while pool._idle < n:
        assert time.monotonic() < deadline, "%d idle threads, not %d" % (pool._idle, n)
        time.sleep(0.001)


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
        wait_idle_threads(pool, 1)      # the thread is back waiting for work
    pool.submit(job, True)
    assert done.wait(5)
    n = len({id(t) for t in seen})
    assert n == 1, "jobs got new threads: %d threads for 21 jobs one after another" % n


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
    threads = []

    def bad():
        threads.append(threading.current_thread())
        raise RuntimeError("a bug")

    def good():
        threads.append(threading.current_thread())
        ran.set()
    pool.submit(bad)
    wait_idle_threads(pool, 1)          # it logged the error and waits for work again
    pool.submit(good)
    assert ran.wait(5)
    assert threads[0] is threads[1]
