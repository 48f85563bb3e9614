"""Supersede: llama-server's ``id_slot`` turned into what editors want.

A newer request with the same key cancels the older one, whether it is
running (it ends with what it has) or still waiting (it is answered empty
at once).  Cancel hooks take the pool's lock (``models/sessions.py``), so
``cancel`` is called outside this table's lock.
"""

import threading


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
