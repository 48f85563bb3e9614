"""Sessions shared between requests: the pool, and the supersede table.

ChatPool hands out a model's ``--parallel`` sessions, each a SessionSlot:
the front's record of one ChatSession in the model's worker (its index
there, and the tokens its cache holds, as the worker reported after the
last request).  A freed session goes to the next waiter, and among free
sessions a request gets the one whose cache shares the longest prefix with its
prompt, so an editor keeps landing on its warm cache.

Waiters are grouped by owner (the HTTP request a job belongs to: one request
may fan out to many jobs, prompts x choices).  The next session goes to the
owner holding the fewest sessions, the least recently served among equals,
and within an owner to its oldest job: a request of 64 jobs takes its turn
beside a request of one instead of holding the queue ahead of it.  A job
whose cancel fires leaves the queue at once and never starts.

Supersede is llama-server's ``id_slot`` turned into what editors want: a
newer request with the same key cancels the older one, whether it is running
(it ends with what it has) or still waiting (it is answered empty at once).

Lock order: a RequestCancel's lock may be taken before the pool's condition
(cancel hooks notify it), never the other way round.
"""

import collections
import threading

# pure Python, the one measure of a warm cache on both sides of the pipe
from ..engine.cachereuse import common_prefix
from .errors import Unavailable


class SessionSlot:
    """One of a worker's ChatSessions, as the front sees it."""

    def __init__(self, index):
        self.index = index
        # token ids in its KV cache (None: a hole left by a cancel); kept
        # only in a pool of several sessions, where they pick the warm one
        self.cached = []
        self.n_cached = 0       # how many tokens its cache holds

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

    def __init__(self, sessions):
        self.sessions = list(sessions)
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

    # -- acquire / release ----------------------------------------------------
    def acquire(self, tokens, cancel, on_wait=None, owner=None):
        """Wait for a session; returns it, or None if ``cancel`` fired first.

        ``owner`` is what the job belongs to (its request; None: the job
        alone), for the turns between requests.  ``on_wait()`` is called
        once if no session is free at once (the disconnect watcher starts
        looking then).  Raises Unavailable once the pool is shutting down.
        """
        wake = self._notify
        cancel.attach(wake)     # outside the condition: see the lock order above
        try:
            with self._cond:
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
                            session = max(self._free, key=lambda s: s.common_prefix(tokens))
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


class Supersede:
    """The latest request per key; registering a newer one cancels the older.

    Warm-ups (``n_predict`` 0: llama.vim refreshes its ring of extra context
    with them, fire and forget) are apart: a warm-up replaces only an older
    warm-up, never a request that generates, so it cannot cost the editor
    the suggestion being written; it waits for the session instead.  (A
    warm-up cancelled while it evaluates keeps what it got into the cache.)
    A request that generates replaces both.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._latest = {}       # key -> {"gen": RequestCancel, "warm": RequestCancel}
        self.superseded = 0     # how many requests were cancelled this way

    def register(self, key, cancel, warmup=False):
        """Make ``cancel`` the latest request (or warm-up) for ``key``, cancelling
        what it replaces."""
        with self._lock:
            latest = self._latest.setdefault(key, {})
            if warmup:
                victims = [latest.get("warm")]
                latest["warm"] = cancel
            else:
                victims = [latest.pop("gen", None), latest.pop("warm", None)]
                latest["gen"] = cancel
            victims = [v for v in victims if v is not None and v is not cancel]
            # under the lock: two registers must not lose a count
            self.superseded += sum(1 for v in victims if not v.cancelled)
        for old in victims:
            # outside the lock: cancel hooks take the pool's lock (see the lock order)
            old.cancel("superseded")

    def unregister(self, key, cancel):
        """Forget ``cancel`` if it is still the latest for ``key`` (it never lingers)."""
        with self._lock:
            latest = self._latest.get(key)
            if latest is None:
                return
            for kind in ("gen", "warm"):
                if latest.get(kind) is cancel:
                    del latest[kind]
            if not latest:
                del self._latest[key]
