"""Threads that run jobs at once and are kept for the next job.

Starting a Python thread costs about 0.15 ms of CPU here, and a request used
to start three (the front's handler, the worker's prepare call, the worker's
generation): a sixth of llama-server's whole request overhead.  A Threads
hands each job to an idle thread if one waits, else to a new one, so every
job starts at once (a generation may last minutes and nothing queues behind
it).  Up to ``max_idle`` threads wait for work, forever; one more that is
done ends, so a burst of hundreds of connections leaves no hundreds of
threads behind.  They are daemons: they never hold up an exit.
"""

import logging
import queue
import threading

log = logging.getLogger("offgrid.jobs")

# Idle threads a Threads keeps by default: more than the connections and
# requests a few editors keep going at once, few enough to cost nothing.
MAX_IDLE = 16


class Threads:
    """Run ``fn(*args)`` on a thread now; a thread that is done waits for the next job."""

    def __init__(self, name, max_idle=MAX_IDLE):
        self.name = name
        self.max_idle = max_idle
        self._lock = threading.Lock()
        self._jobs = queue.SimpleQueue()
        self._idle = 0          # threads waiting for a job, or about to: one job each

    def submit(self, fn, *args):
        with self._lock:
            if self._idle:
                self._idle -= 1
                self._jobs.put((fn, args))
                return
        threading.Thread(target=self._run, args=(fn, args), daemon=True,
                         name=self.name).start()

    def _run(self, fn, args):
        while True:
            try:
                fn(*args)
            except BaseException:       # jobs answer their own errors: this is a bug
                log.exception("a job on a %s thread failed", self.name)
            fn = args = None            # drop the job's references while idle
            with self._lock:
                if self._idle >= self.max_idle:
                    return
                self._idle += 1
            fn, args = self._jobs.get()
