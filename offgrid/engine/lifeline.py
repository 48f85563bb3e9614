"""A worker's first instructions: it ends with its front, and keeps to its memory, from the start.

``start`` runs before anything else in a worker process: the command the
front starts (``server/workers.py:worker_command``) calls it before it
imports ``offgrid.engine.worker``, libllama or a model.  It imports nothing
of offgrid's, so nothing that follows runs without it.

No orphans.  The worker's main loop exits at EOF on its stdin, but only once
it reads frames: while a model loads (seconds, or for good with a template
that loops) nothing reads, and a front that was SIGKILLed or SIGTERMed then
left the worker running on its own, spinning a core.  A daemon thread here
waits in poll() for the pipe's hang-up (POLLHUP: every writer gone, which
is the front's death or its ``close()``, its way of unloading a model or
stopping a load) and ends the process at once, in every state.  The parent
id is looked at every few seconds besides, for a pipe whose write end
another process still holds.  (prctl's PR_SET_PDEATHSIG would be the
kernel's way, but it fires when the *thread* that started the worker ends,
and the front starts workers from request and restart threads that do end.)
Python switches threads every 5 ms, so a template looping in Python does not
keep this thread from running, and libllama's calls release the GIL.

Memory.  ``max_data`` bytes become the process's RLIMIT_DATA (soft limit)
before libllama loads: what the process may map privately and writably (the
heap, anonymous mmaps: KV caches, buffers, Python's objects), which is what a
runaway allocation grows, while the model's weights, mmap'd read-only from
its file, are not counted.  An allocation past it fails at once (a
MemoryError in Python, an abort in C++) instead of after it happened, where
the front's RSS watchdog, which reads twice a second, would see it; the
front sets the limit a little above ``--worker-max-rss`` (RLIMIT_DATA counts
what is reserved, RSS what is touched) and may move it later
(``resource.prlimit``) once the worker says what its KV caches will take.
"""

import os
import select
import threading

# Seconds between looks at the parent's id (the hang-up needs no looking).
PARENT_CHECK = 5.0


def start(max_data=None):
    """Set the memory limit and start the thread that ends the process with its front."""
    if max_data:
        limit_data(max_data)
    parent = os.getppid()
    threading.Thread(target=_watch, args=(parent,), name="lifeline", daemon=True).start()


def limit_data(max_data):
    """RLIMIT_DATA's soft limit to ``max_data`` bytes (where the system allows)."""
    try:
        import resource
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        if hard != resource.RLIM_INFINITY:
            max_data = min(max_data, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (int(max_data), hard))
    except (ImportError, ValueError, OSError):
        pass        # not POSIX: the front's watchdog is the only ceiling


def _watch(parent):
    poller = select.poll()
    # no events asked for: poll reports only POLLHUP, POLLERR and POLLNVAL, so
    # frames waiting on the pipe never wake this thread
    poller.register(0, 0)
    while True:
        try:
            gone = poller.poll(PARENT_CHECK * 1000)
        except InterruptedError:
            continue
        if gone or os.getppid() != parent:
            os._exit(0)
