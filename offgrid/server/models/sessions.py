"""A model's sessions, shared between requests: the pool.

ChatPool hands out a model's ``--parallel`` sessions, each a SessionSlot:
the front's record of one ChatSession in the model's worker (its index
there, and the tokens its cache holds, as the worker reported after the
last request).  A freed session goes to the next waiter, and among free
sessions a request gets the one whose cache shares the longest prefix with its
prompt, so an editor keeps landing on its warm cache.

Waiters are grouped by owner (the request a job belongs to: its one
RequestCancel, however many jobs, prompts x choices, it fans out to).  The
next session goes to the owner holding the fewest sessions, the least
recently served among equals, and within an owner to its oldest job: a
request of 64 jobs takes its turn beside a request of one instead of holding
the queue ahead of it.  A job whose cancel fires leaves the queue at once and
never starts.  With ``max_queue`` (--max-queue) at most that many jobs wait:
one more that would have to wait is refused (QueueFull, a 503 with
Retry-After) rather than piling up behind them, so a load balancer can take
it to a replica with room.

Lock order: a RequestCancel's lock may be taken before the pool's condition
(cancel hooks notify it), never the other way round.
"""

import collections
import threading

# pure Python, the one measure of a warm cache on both sides of the pipe
from ...engine.cachereuse import common_prefix
from ..httpd.httperrors import QueueFull, Unavailable


class SessionSlot:
    """One of a worker's ChatSessions, as the front sees it."""

    def __init__(self, index):
        self.index = index
        # token ids in its KV cache (None: a hole left by a cancel); kept
        # only in a pool of several sessions, where they pick the warm one
        self.cached = []
        self.n_cached = 0       # how many tokens its cache holds
        # the LoRA adapter key its cache was computed with (engine/adapters.py)
        self.adapters = ()

    def common_prefix(self, tokens):
        """How many leading tokens of ``tokens`` the session has cached."""
        return common_prefix(self.cached, tokens)


class _Ticket:
    """One waiting job."""
    __slots__ = ("owner", "cancel")

    def __init__(self, owner, cancel):
        self.owner = owner
        self.cancel = cancel


class ChatPool:
    """A fixed set of sessions behind a lock and a condition."""

    def __init__(self, sessions, max_queue=None):
        self.sessions = list(sessions)
        self.max_queue = max_queue      # jobs that may wait for a session (None: no bound)
        self._free = list(sessions)
        self._cond = threading.Condition()
        # owner -> its waiting tickets, oldest first; the owners in turn order
        # (the least recently served first)
        self._waiting = collections.OrderedDict()
        self._n_waiting = 0
        self._held = {}                         # session -> owner of the job using it
        self._in_use = collections.Counter()    # owner -> sessions its jobs hold
        self._closed = False

    # -- counters for /metrics and /slots -------------------------------------
    @property
    def n_busy(self):
        return len(self.sessions) - len(self._free)

    @property
    def n_idle(self):
        return len(self._free)

    @property
    def n_waiting(self):
        return self._n_waiting

    def is_busy(self, session):
        return session not in self._free

    def check_room(self):
        """Raise QueueFull if a new job would have to wait behind max_queue others
        (a job waits when the free sessions are fewer than the jobs waiting with it)."""
        with self._cond:
            self._check_room()

    def _check_room(self):
        if self.max_queue is not None and self._n_waiting >= self.max_queue \
                and len(self._free) <= self._n_waiting:
            raise QueueFull("the queue is full: this model's %d sessions are busy and %d "
                            "requests wait already (--max-queue %d); retry later or on "
                            "another server"
                            % (len(self.sessions), self._n_waiting, self.max_queue))

    # -- acquire / release ----------------------------------------------------
    def acquire(self, tokens, cancel, on_wait=None, owner=None, adapters=()):
        """Wait for a session; returns it, or None if ``cancel`` fired first.

        ``owner`` is what the job belongs to, for the turns between requests
        (None: its ``cancel``, which every job of one request shares).  ``on_wait()`` is called
        once if no session is free at once (the disconnect watcher starts
        looking then).  Raises Unavailable once the pool is shutting down.
        A session whose cache is of the request's LoRA adapter key
        (``adapters``) is preferred: the worker drops a cache of another key.
        """
        wake = self._notify
        cancel.attach(wake)     # outside the condition: see the lock order above
        try:
            with self._cond:
                if self._closed:
                    raise Unavailable("server is shutting down")
                self._check_room()
                ticket = _Ticket(owner if owner is not None else cancel, cancel)
                self._waiting.setdefault(ticket.owner, collections.deque()).append(ticket)
                self._n_waiting += 1
                try:
                    while True:
                        if self._closed:
                            raise Unavailable("server is shutting down")
                        if cancel.cancelled:
                            return None
                        if self._free and self._next() is ticket:
                            session = max(self._free, key=lambda s: (
                                s.adapters == adapters, s.common_prefix(tokens)))
                            self._free.remove(session)
                            self._held[session] = ticket.owner
                            self._in_use[ticket.owner] += 1
                            self._waiting.move_to_end(ticket.owner)     # served: last in turn
                            return session
                        if on_wait is not None:
                            on_wait()
                            on_wait = None
                        self._cond.wait()
                finally:
                    self._leave(ticket)
                    # the next waiter may now be first in line for a free session
                    self._cond.notify_all()
        finally:
            cancel.detach(wake)

    def hold(self, session, cancel, on_wait=None):
        """Wait for this one ``session`` to be free and take it (a request's
        ``id_slot``, a slot action: api/slot_actions.py); False if ``cancel``
        fired first.  ``on_wait`` as acquire's.  Released as any."""
        wake = self._notify
        cancel.attach(wake)
        waiting = False
        try:
            with self._cond:
                try:
                    while True:
                        if self._closed:
                            raise Unavailable("server is shutting down")
                        if cancel.cancelled:
                            return False
                        if session in self._free:
                            self._free.remove(session)
                            self._held[session] = cancel
                            self._in_use[cancel] += 1
                            return True
                        if not waiting:
                            self._check_room()
                            waiting = True
                            self._n_waiting += 1
                            if on_wait is not None:
                                on_wait()
                        self._cond.wait()
                finally:
                    if waiting:
                        self._n_waiting -= 1
        finally:
            cancel.detach(wake)

    def _next(self):
        """The ticket a free session goes to (under the condition): of the owners
        holding the fewest sessions the first in turn, its oldest live ticket."""
        best, best_n = None, None
        for owner, tickets in self._waiting.items():
            n = self._in_use[owner]
            if best_n is not None and n >= best_n:
                continue
            for t in tickets:
                if not t.cancel.cancelled:      # a cancelled job is leaving: never its turn
                    best, best_n = t, n
                    break
        return best

    def _leave(self, ticket):
        tickets = self._waiting.get(ticket.owner)
        if tickets is None:
            return
        try:
            tickets.remove(ticket)
        except ValueError:
            return
        self._n_waiting -= 1
        if not tickets:
            del self._waiting[ticket.owner]

    def release(self, session):
        with self._cond:
            if session not in self._free:
                self._free.append(session)
            owner = self._held.pop(session, None)
            if owner is not None:
                self._in_use[owner] -= 1
                if self._in_use[owner] <= 0:
                    del self._in_use[owner]
            self._cond.notify_all()

    def _notify(self):
        with self._cond:
            self._cond.notify_all()

    def close(self):
        """Refuse new and waiting requests (503); running ones keep their session."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait_idle(self, timeout):
        """Wait until every session is back; returns whether they all are."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._free) == len(self.sessions), timeout)
