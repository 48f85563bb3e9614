"""Where a worker's decode threads run: llama-server's -C/-Cr, --cpu-strict, --prio
and --poll (and their -batch twins), applied as ggml applies them.

A ``Placement`` is one pool role's settings (generation: single-token decodes;
batch: prompt batches), checked by the front (offgrid/flagvalues.py) and
carried in ``protocol.WorkerSettings``.  ggml does most of the work itself
when it makes a pool (ggml-cpu.c, ggml_threadpool_new_impl): each of its
threads sets its own affinity and scheduling, and

* without ``strict`` every thread gets the whole mask;
* with ``strict`` each gets one CPU of it, in turn: threads 1..n-1 the
  mask's first CPUs, and thread 0, the one that calls llama_decode, the next
  (the mask wraps round when it has fewer CPUs than threads);
* ``prio`` -1 is SCHED_BATCH, 0 leaves the thread as it is, 1/2/3 are
  SCHED_FIFO at 40/80/90, which needs root or CAP_SYS_NICE (or an
  RLIMIT_RTPRIO that high); where it fails ggml writes one "warn:" line per
  thread and runs it at normal priority.

Thread 0 is whichever thread leads the decode.  In llama-server that is its
one main loop; in a worker it is any request thread that finds the decoder
free, so ggml's own placement of its caller (at the pool's creation, and on
resuming a paused pool) would land on whichever thread happened to be there.
Pools with a placement are made paused, so their creation places nobody, and
``lead`` puts the leading thread where ggml would put thread 0, before each
decode; a thread already there costs a lookup, no system call.

llama-server also sets the process's nice value from --prio (common.cpp,
set_process_priority: -1 is +5 ... 3 is -20); ``set_process_priority`` does
the same at the worker's start, so every thread made later inherits it.
"""

import dataclasses
import logging
import os
import threading
from typing import Optional

log = logging.getLogger("offgrid.worker")

# ggml_thread_apply_priority (Linux): enum ggml_sched_priority -> (policy, sched_priority)
SCHEDULING = {-1: ("SCHED_BATCH", 0), 1: ("SCHED_FIFO", 40), 2: ("SCHED_FIFO", 80),
              3: ("SCHED_FIFO", 90)}
# set_process_priority (common.cpp, POSIX): the same enum -> nice value
NICE = {-1: 5, 0: 0, 1: -5, 2: -10, 3: -20}


@dataclasses.dataclass(frozen=True)
class Placement:
    """One pool role's placement; the default is ggml's (any CPU, normal priority)
    with offgrid's poll (libllama.ThreadPool.POLL).  Frozen: pools are keyed by it."""
    cpus: tuple = ()                # the CPUs of -C/-Cr, ascending; (): any
    strict: bool = False            # --cpu-strict: one CPU per thread
    prio: int = 0                   # --prio: enum ggml_sched_priority, -1..3
    poll: Optional[int] = None      # --poll 0..100; None: offgrid's own

    @classmethod
    def from_settings(cls, d):
        """From WorkerSettings' dict (flagvalues.cpu_placements made it)."""
        if not d:
            return cls()
        return cls(tuple(sorted(d.get("cpus") or ())), bool(d.get("strict")),
                   int(d.get("prio", 0)), d.get("poll"))

    @property
    def placed(self):
        """Whether ggml moves or reschedules this pool's threads at all."""
        return bool(self.cpus) or self.prio != 0

    def leader_cpus(self, n_threads):
        """The CPUs ggml gives thread 0 of a pool of n_threads (ggml_thread_cpumask_next:
        threads 1..n-1 take the mask's CPUs in turn first), or () for any."""
        if not self.cpus or not self.strict:
            return self.cpus
        return (self.cpus[(n_threads - 1) % len(self.cpus)],)

    def lead(self, n_threads):
        """Put the calling thread, about to lead a decode on this role's pool of
        n_threads, where ggml puts that pool's thread 0."""
        want = (self.leader_cpus(n_threads), self.prio) if self.placed else None
        if getattr(_here, "at", None) == want:
            return
        cpus, prio = want or (_HOME, 0)
        try:
            os.sched_setaffinity(0, cpus)
        except OSError:
            pass        # a CPU taken offline since the start: ggml's threads warn alike
        policy, level = SCHEDULING.get(prio, ("SCHED_OTHER", 0))
        try:
            os.sched_setscheduler(0, getattr(os, policy), os.sched_param(level))
        except OSError:
            pass        # usable() found out at the start, and said so
        _here.at = want


# where each thread was last put by lead(): None (never, or back home) or (cpus, prio)
_here = threading.local()
# the worker's own CPUs, where a thread that led a placed pool goes back to
try:
    _HOME = tuple(sorted(os.sched_getaffinity(0)))
except (AttributeError, OSError):
    _HOME = ()


def usable(placement, flag):
    """``placement``, or the same at normal priority where this process may not use
    its real-time scheduling: one warning line then, rather than ggml's "warn:" from
    every thread of every pool.  Tried on a thread made for the purpose."""
    policy = SCHEDULING.get(placement.prio, (None, 0))[0]
    if policy != "SCHED_FIFO":
        return placement
    failed = []

    def attempt():
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO,
                                  os.sched_param(SCHEDULING[placement.prio][1]))
        except OSError as e:
            failed.append(e)
    t = threading.Thread(target=attempt, name="offgrid-prio-probe")
    t.start()
    t.join()
    if not failed:
        return placement
    log.warning("%s %d: this process may not use real-time scheduling (SCHED_FIFO %d: %s; "
                "it takes root, CAP_SYS_NICE or an RLIMIT_RTPRIO that high): its decode "
                "threads keep the normal priority", flag, placement.prio,
                SCHEDULING[placement.prio][1], failed[0].strerror or failed[0])
    return dataclasses.replace(placement, prio=0)


def set_process_priority(prio):
    """llama-server's set_process_priority: the calling thread's nice value (Linux's is
    per thread; the worker's main thread calls this before it makes the others)."""
    nice = NICE.get(prio, 0)
    if nice == 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError as e:
        log.warning("--prio %d: could not set the worker's nice value to %d (%s; a value "
                    "below 0 takes root or CAP_SYS_NICE)", prio, nice, e.strerror or e)
