"""How many threads each decode gets: fixed (-t N) or learned from the decodes (-t auto).

ggml's threads meet at a barrier hundreds of times per token and spin while
they wait.  When another program holds one of the cores they need, one thread
is descheduled and the rest spin until the scheduler brings it back, at every
barrier: measured on 2 cores with a competing load of 1.5 cores, llama-bench
gave 1.29 tok/s with -t 2 and 54 with -t 1 (98 with -t 2 on the idle
machine).  No fixed count is right for a machine whose other programs come
and go, so ``ThreadChoice`` watches the speed of the decodes themselves:

* Each decode shape (one token; prompt batches of a size class) has its own
  choice, since a prompt batch may scale with threads where a single token
  does not.
* A decode much slower than the best seen at its thread count (the machine
  got busy) starts a probe of one thread fewer; a probe is a few decodes at
  the other count, and the faster median wins, by a margin against noise.
* Now and then it probes one thread more, so a machine that frees up gets
  its cores back (the probe wins by a wider margin, or, over twice as many
  decodes, by running as fast as that count did at its best, where more
  threads add less than the margin);
  an up-probe that loses waits twice as long before the next
  (up to ``up_interval_max``), since on a busy machine each losing probe
  decode can cost tens of times a normal one.  A probe whose first decode is
  slower than the current count's recent ones ends there.  A down-probe runs now and then too: the best seen may have been
  learned while the machine was already busy.

``ThreadChoice`` is a pure function of the (time, count, tokens, seconds)
history it is given: no clock, no libllama, so its decisions are tested on
recorded histories.  The session asks ``choose`` before a decode and tells
``observe`` after it (see engine/session.py).
"""

import logging
import os
import statistics
import time
from collections import deque

from .placement import Placement

log = logging.getLogger("offgrid.threads")

# prompt batches are told apart by size: per-token speed grows with the batch
_BATCH_CLASSES = (16, 64, 256)


def shape_of(n_tokens):
    """The decode shape a batch of n_tokens counts under: 0 for single tokens
    and batches too small to tell apart from them, else 1 + its size class."""
    if n_tokens < _BATCH_CLASSES[0]:
        return 0
    return 1 + sum(1 for c in _BATCH_CLASSES[1:] if n_tokens >= c)


class _Shape:
    """The choice for one decode shape, and what it has seen."""

    __slots__ = ("current", "best", "recent", "probe", "probe_base", "probe_best", "probe_rates",
                 "up_interval", "next_up", "next_down", "routine")

    def __init__(self, current, now, up_interval, routine=True):
        self.current = current
        self.best = {}              # thread count -> best rate seen (tokens/s)
        self.recent = {}            # thread count -> deque of (time, rate)
        self.probe = None           # the count being tried, or None
        self.probe_base = 0.0       # the current count's rate the probe must beat
        self.probe_best = 0.0       # the best seen at the probe's count before it began
        self.probe_rates = []
        self.up_interval = up_interval
        self.next_up = now + up_interval
        # the first down-probe comes soon: a server started on a busy machine
        # learns its "best" there, and would not see that it is slow.  Only
        # where a probe is cheap (single tokens, small batches): a prompt batch
        # at half the threads costs as much as a whole short request, so large
        # shapes probe down when they run slow or when a small one found the
        # machine busy (probe_down_soon)
        self.routine = routine
        self.next_down = now + 2 * up_interval if routine else float("inf")


class ThreadChoice:
    """Thread counts between 1 and ``max_threads``, chosen per decode shape.

    ``fixed``: always ``max_threads`` (``-t N``); nothing is learned.
    """

    slow = 0.6              # a decode under this share of the best seen is "slow"
    win = 1.10              # a probe's median must beat the current one's by 10%,
    win_up = 1.25           # ... an up-probe's by 25%: on a contended machine a few
                            # lucky decodes at more threads are common, and a wrong
                            # switch up costs every decode until the next probe down
    back = 0.85             # ... or, beating it at all, by running at this share of
                            # the best its count has seen, when that best is above
                            # the current count's: the cores are free again, on a
                            # machine where more threads gain less than win_up
    probe_len = 3           # decodes per probe
    free_probe_len = 6      # ... for an up-probe that wins only by _free_again
    recent_len = 5          # decodes kept per count for the comparison
    recent_age = 5.0        # seconds: older samples say nothing of the machine now
    up_interval = 1.0       # seconds before the first up-probe, and after an up-switch
    busy_interval = 2.0     # ... and after a down-switch: more cores are taken then
    up_interval_max = 32.0  # the longest wait between losing up-probes
    down_interval = 60.0    # seconds between routine down-probes

    def __init__(self, max_threads, fixed=False, now=0.0):
        self.max_threads = max(1, int(max_threads))
        self.fixed = fixed
        self.switches = 0
        self._shapes = {}

    def _shape(self, shape, now):
        s = self._shapes.get(shape)
        if s is None:
            s = self._shapes[shape] = _Shape(self.max_threads, now, self.up_interval,
                                             routine=shape == 0)
        return s

    def current(self, shape=0):
        """The count decodes of this shape settled on (not a probe's)."""
        s = self._shapes.get(shape)
        return self.max_threads if s is None else s.current

    def choose(self, n_tokens, now):
        """Threads for a decode of n_tokens tokens starting at time ``now``."""
        if self.fixed or self.max_threads == 1:
            return self.max_threads
        s = self._shape(shape_of(n_tokens), now)
        if s.probe is None:
            if s.current < self.max_threads and now >= s.next_up:
                self._start_probe(s, s.current + 1, now)
            elif s.current > 1 and now >= s.next_down:
                s.next_down = now + self.down_interval if s.routine else float("inf")
                self._start_probe(s, s.current - 1, now)
        return s.probe if s.probe is not None else s.current

    def observe(self, n_tokens, threads, seconds, now):
        """A decode of n_tokens at ``threads`` took ``seconds`` (ending at ``now``)."""
        if self.fixed or self.max_threads == 1 or seconds <= 0:
            return
        s = self._shape(shape_of(n_tokens), now)
        rate = n_tokens / seconds
        if rate > s.best.get(threads, 0.0):
            s.best[threads] = rate
        recent = s.recent.setdefault(threads, deque(maxlen=self.recent_len))
        recent.append((now, rate))
        if s.probe is not None and threads == s.probe:
            s.probe_rates.append(rate)
            self._judge_probe(s, rate, now)
        elif s.probe is None and threads == s.current and s.current > 1:
            slow = self._slow_rates(s, now)
            if slow:
                self._start_probe(s, s.current - 1, now, statistics.median(slow))

    def _start_probe(self, s, threads, now, base=None):
        if base is None:
            here = self._rates(s, s.current, now)
            base = statistics.median(here[-3:]) if here else s.best.get(s.current, 0.0)
        s.probe, s.probe_base, s.probe_rates = threads, base, []
        s.probe_best = s.best.get(threads, 0.0)

    def _slow_rates(self, s, now):
        """The last decodes at the current count, if they run far under its best."""
        best = s.best.get(s.current, 0.0)
        rates = self._rates(s, s.current, now)[-3:]
        if not rates or best <= 0:
            return []
        # two of the last three, the last among them: one slow decode is a
        # hiccup (a page fault, threads waking after an idle second), and a
        # probe measured against it would "win" with fewer threads
        slow = [r for r in rates if r < self.slow * best]
        return slow if len(slow) >= 2 and rates[-1] in slow else []

    def _rates(self, s, threads, now):
        return [r for t, r in s.recent.get(threads, ()) if now - t <= self.recent_age]

    def _judge_probe(self, s, rate, now):
        base = s.probe_base
        up = s.probe > s.current
        # a probe whose first decode is slower than the current count is over:
        # a losing probe then costs one decode (which, upwards on a busy
        # machine, can take tens of times a normal one)
        lost_early = len(s.probe_rates) == 1 and base > 0 and rate < base
        if len(s.probe_rates) < self.probe_len and not lost_early:
            return
        probe_rate = statistics.median(s.probe_rates)
        won = not lost_early and (base <= 0 or
                                  probe_rate > base * (self.win_up if up else self.win))
        if not won and not lost_early and up and self._free_again(s, probe_rate):
            # a win by a small margin needs more decodes: beside a hog, two
            # threads may run as fast as one (a 2-core Xeon VM), and the
            # wider spread of their rates puts three in a row above the
            # current count's often enough that 48 of 200 simulated minutes
            # beside the hog switched up at least once; with six, 4 of 200
            # (tests/test_threads.py has that host's rates)
            if len(s.probe_rates) < self.free_probe_len:
                return
            won = True
        old, tried, rates = s.current, s.probe, s.probe_rates
        s.probe, s.probe_rates = None, []
        if won:
            s.current = tried
            self.switches += 1
            s.next_down = now + self.down_interval if s.routine else float("inf")
            if not up:
                self.probe_down_soon(now)   # the other shapes: the machine is busy for all
            s.up_interval = self.up_interval if up else self.busy_interval
            s.next_up = now + s.up_interval
            log.info("threads: %d -> %d (%.1f -> %.1f tokens/s)", old, tried, base, probe_rate)
        elif up:
            s.up_interval = min(s.up_interval * 2, self.up_interval_max)
            s.next_up = now + s.up_interval
            log.info("threads: %d lost to %d (%s vs %.1f tokens/s; best %s); next in %.0f s",
                     tried, old, ", ".join("%.1f" % r for r in rates), base,
                     {k: round(v, 1) for k, v in sorted(s.best.items())}, s.up_interval)
        elif base > 0:
            # fewer threads did not help: the whole machine is slower now
            # (a VM's neighbours, a clock); what the current count does now is
            # its new normal, or every decode would look slow and start a probe
            s.best[s.current] = base

    def _free_again(self, s, probe_rate):
        """An up-probe runs as its count did at its best, which beat the current
        count's best, and each of its decodes beat the current count: on a
        2-core VM whose second core adds 12% to a token, a probe on the freed
        machine never reaches win_up, while one beside a hog runs at a fraction
        of its best, bar a lucky decode or two.  The best is taken from before
        the probe: its own decodes prove nothing."""
        best_here = s.best.get(s.current, 0.0)
        return (min(s.probe_rates) > s.probe_base and s.probe_best > best_here
                and probe_rate >= self.back * s.probe_best)

    def probe_down_soon(self, now):
        """Start a down-probe at the next decode of every shape: another kind of
        decode found the machine busy (a prompt batch may not come again for
        a while, and each at too many threads is slow)."""
        for s in self._shapes.values():
            s.next_down = min(s.next_down, now)

    def snapshot(self):
        """What /props, /slots and /metrics show: the counts in use and the switches.

        ``batch`` is the choice for the largest prompt batches seen so far.
        """
        batch = [shape for shape in self._shapes if shape > 0]
        return {"mode": "fixed" if self.fixed else "auto", "max": self.max_threads,
                "generation": self.current(0),
                "batch": self.current(max(batch)) if batch else self.max_threads,
                "switches": self.switches}


def usable_cores():
    """The cores this process may run on (its affinity mask), at most 8: past
    that ggml's barriers cost more than the threads bring on models this size."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(n, 8))


class DecodeThreads:
    """A worker's thread counts: one ThreadChoice for single-token decodes
    (``-t``), one for prompt batches (``-tb``), and the pools they run on.

    ``pool_for(n, placement)`` is the shared ggml thread pool of n threads
    placed so (one per count and placement for the life of the process:
    engine/session.py); ``placements`` are the generation's and the batch's
    (engine/placement.py: -C, -Cb ...).  Switching a context from one pool to
    another is two pointer stores in libllama, so a choice may change from
    one decode to the next at no cost.  Every decode takes its turn under the
    worker's decode lock, so before() and after() are never called
    concurrently.
    """

    def __init__(self, pool_for, threads=None, threads_batch=None, clock=time.monotonic,
                 placements=(Placement(), Placement())):
        """``threads`` / ``threads_batch``: a count, or None / "auto" to adapt (up to the
        usable cores, and no more than the CPUs a placement names: more threads than
        CPUs would spin for each other's)."""
        gen_fixed = _fixed(threads)
        batch_fixed = _fixed(threads_batch) if threads_batch not in (None, "auto") else gen_fixed
        now = clock()
        self.placements = placements
        # whether a decode's leading thread is ever moved (nothing to do per decode if not)
        self._placed = any(p.placed for p in placements)
        auto = [min(usable_cores(), len(p.cpus) or usable_cores()) for p in placements]
        self.generation = ThreadChoice(gen_fixed or auto[0], fixed=bool(gen_fixed), now=now)
        self.batch = ThreadChoice(batch_fixed or auto[1], fixed=bool(batch_fixed), now=now)
        self.pool_for = pool_for
        self._pools = {}        # (count, batch) -> pool, so the per-token path takes no lock
        self.clock = clock
        self._gen_k = self.generation.max_threads
        self._batch_k = self.batch.max_threads

    def before(self, ctx, n_tokens):
        """Attach the pools of this decode's choice to ``ctx``; returns (count, start).

        libllama runs a one-token decode on the first pool and any larger
        one on the second; the other keeps the count it last had, so that
        the pair, and the attached pools, change only when a choice does.
        """
        now = self.clock()
        if n_tokens == 1:
            k = self._gen_k = self.generation.choose(1, now)
        else:
            k = self._batch_k = self.batch.choose(n_tokens, now)
        self.attach(ctx, n_tokens, self._gen_k, self._batch_k)
        return k, now

    def attach(self, ctx, n_tokens, gen_k, batch_k):
        """Attach the pools of gen_k and batch_k threads to ``ctx``, and put the
        calling thread, which leads the decode of n_tokens, where ggml puts the
        first thread of the pool that runs it (Placement.lead)."""
        ctx.use_pools(self.pool(gen_k), self.pool(batch_k, batch=True))
        if not self._placed:
            return
        if n_tokens == 1:
            self.placements[0].lead(gen_k)
        else:
            self.placements[1].lead(batch_k)

    def pool(self, n, batch=False):
        """The pool of n threads for single tokens, or for prompt batches."""
        pool = self._pools.get((n, batch))
        if pool is None:
            pool = self._pools[n, batch] = self.pool_for(n, self.placements[batch])
        return pool

    def after(self, n_tokens, started):
        """The decode begun with ``started`` (before()'s value) succeeded."""
        k, t0 = started
        now = self.clock()
        choice, other = ((self.generation, self.batch) if n_tokens == 1
                         else (self.batch, self.generation))
        shape = shape_of(n_tokens)
        was = choice.current(shape)
        choice.observe(n_tokens, k, now - t0, now)
        if choice.current(shape) < was:
            other.probe_down_soon(now)      # the machine got busy for every kind of decode

    def snapshot(self):
        gen, batch = self.generation.snapshot(), self.batch.snapshot()
        return {"mode": gen["mode"] if gen["mode"] == batch["mode"] else "mixed",
                "generation": gen["generation"], "batch": batch["batch"],
                "max": gen["max"], "max_batch": batch["max"],
                "switches": gen["switches"] + batch["switches"]}


def _fixed(threads):
    """A pinned count from -t / -tb, or 0 for auto."""
    if threads in (None, "auto"):
        return 0
    n = int(threads)
    return n if n > 0 else 0
