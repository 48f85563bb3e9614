"""A model's sessions, shared between requests: the pool.

ChatPool hands out a model's ``--parallel`` sessions, each a SessionSlot:
the front's record of one ChatSession in the model's worker (its index
there, and the tokens its cache holds, as the worker reported after the
last request).  Requests wait in
arrival order; a freed session goes to the oldest waiter, and among free
sessions a request gets the one whose cache shares the longest prefix with its
prompt, so an editor keeps landing on its warm cache.

Lock order: a RequestCancel's lock may be taken before the pool's condition
(cancel hooks notify it), never the other way round.
"""

import collections
import threading

# pure Python, the one measure of a warm cache on both sides of the pipe
from ...engine.cachereuse import common_prefix
from ..httpd.httperrors import Unavailable


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


class ChatPool:
    """A fixed set of sessions behind a lock and a condition."""

    def __init__(self, sessions):
        self.sessions = list(sessions)
        self._free = list(sessions)
        self._cond = threading.Condition()
        self._queue = collections.deque()       # waiting tickets, oldest first
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
        return len(self._queue)

    def is_busy(self, session):
        return session not in self._free

    # -- acquire / release ----------------------------------------------------
    def acquire(self, tokens, cancel, on_wait=None):
        """Wait for a session; returns it, or None if ``cancel`` fired first.

        ``on_wait()`` is called once if no session is free at once (the
        disconnect watcher starts looking then).  Raises Unavailable once
        the pool is shutting down.
        """
        wake = self._notify
        cancel.attach(wake)     # outside the condition: see the lock order above
        try:
            with self._cond:
                ticket = object()
                self._queue.append(ticket)
                try:
                    while True:
                        if self._closed:
                            raise Unavailable("server is shutting down")
                        if cancel.cancelled:
                            return None
                        if self._free and self._queue[0] is ticket:
                            session = max(self._free, key=lambda s: s.common_prefix(tokens))
                            self._free.remove(session)
                            return session
                        if on_wait is not None:
                            on_wait()
                            on_wait = None
                        self._cond.wait()
                finally:
                    self._queue.remove(ticket)
                    # the next waiter may now be first in line for a free session
                    self._cond.notify_all()
        finally:
            cancel.detach(wake)

    def release(self, session):
        with self._cond:
            if session not in self._free:
                self._free.append(session)
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
