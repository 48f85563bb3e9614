"""The server's state and the path of one generation request through it.

    handler (http.py) --typed request--> Service.generate
        supersede.register(id_slot)          a newer request cancels this one
        watcher.watch(socket)                a closed connection cancels this one
        pool.acquire(prompt)                 wait for a session (FIFO, warm cache first)
        session.complete(...)                evaluate + generate, pieces to on_piece
        pool.release, unregister, unwatch    always, in a finally

Service also owns the models (ModelEntry), the counters behind /metrics and
/slots, and the shutdown sequence.  It knows nothing of HTTP beyond raising
the errors of ``server.errors``.
"""

import threading
import time
from dataclasses import dataclass, field
from typing import List, Optional

from ..request import Completion, FinishReason, RequestCancel, Usage
from .errors import BadRequest, Unavailable
from .metrics import Metrics
from .pool import ChatPool, Supersede
from .watcher import DisconnectWatcher


@dataclass
class ModelEntry:
    """One loaded model, the names it answers to, and its sessions."""
    id: str
    model: object               # offgrid.engine.model.Model
    pool: ChatPool
    n_ctx: int
    n_batch: int
    aliases: List[str] = field(default_factory=list)
    path: str = ""
    chat_template: Optional[str] = None     # --chat-template: Jinja text or a built-in name
    template: object = None     # the chat template in use, set by chat.select.template_for

    def answers_to(self, name):
        return name == self.id or name in self.aliases


class Service:
    """Models, pools, supersede table, counters, and the lifecycle of requests."""

    def __init__(self, text, fim=None, n_predict_default=-1, shutdown_grace=10.0,
                 cache_reuse=64):
        self.text = text                # ModelEntry for text and chat requests
        self.fim = fim or text          # ModelEntry for /infill and suffix requests
        self.entries = [text] + ([fim] if fim is not None and fim is not text else [])
        self.n_predict_default = n_predict_default
        # minimum run of cached tokens that FIM requests move rather than
        # recompute (0: prefix reuse only); see engine/cachereuse.py
        self.cache_reuse = cache_reuse
        self.shutdown_grace = shutdown_grace
        self.supersede = Supersede()
        self.metrics = Metrics()
        self.watcher = DisconnectWatcher()
        self.state = "ready"
        self._running = set()           # RequestCancel of every request in generate()
        self._lock = threading.Lock()

    # -- choosing a model ---------------------------------------------------
    def entry_for(self, name, fim=False):
        """The model a request names by id or alias, else the default for its kind."""
        if fim:
            return self.fim
        if isinstance(name, str):
            for e in self.entries:
                if e.answers_to(name):
                    return e
        return self.text

    # -- running a request --------------------------------------------------
    def generate(self, entry, tokens, gen, id_slot=-1, on_piece=None, sock=None, cancel=None):
        """Run one generation request from start to finish; returns a Completion.

        A request superseded or disconnected while waiting returns an empty
        CANCELLED completion without ever touching a session.
        """
        if self.state != "ready":
            raise Unavailable("server is shutting down")
        if len(tokens) >= entry.n_ctx:
            # refuse before queueing: waiting for a session only to fail wastes the wait
            raise BadRequest("the request exceeds the available context size: the prompt has "
                             "%d tokens and the context holds %d" % (len(tokens), entry.n_ctx),
                             type="exceed_context_size_error")
        cancel = cancel or RequestCancel()
        key = (entry.id, id_slot) if id_slot >= 0 else None
        with self._lock:
            self._running.add(cancel)
        if key is not None:
            self.supersede.register(key, cancel)
        if sock is not None:
            self.watcher.watch(sock, cancel)
        try:
            session = entry.pool.acquire(tokens, cancel)
            if session is None:
                c = Completion("", [], FinishReason.CANCELLED, "none", "",
                               Usage(prompt_tokens=len(tokens)))
            else:
                try:
                    c = session.complete(tokens, gen, on_piece, cancel)
                finally:
                    entry.pool.release(session)
            self.metrics.completion(c)
            return c
        finally:
            if sock is not None:
                self.watcher.unwatch(sock)
            if key is not None:
                self.supersede.unregister(key, cancel)
            with self._lock:
                self._running.discard(cancel)

    # -- shutdown -----------------------------------------------------------
    def shutdown(self):
        """Stop taking work: queued requests get 503, running ones get the grace period.

        Returns once every session is back in its pool (or after cancelling
        the stragglers and waiting a little more).
        """
        self.state = "shutting_down"
        for e in self.entries:
            e.pool.close()
        deadline = time.monotonic() + self.shutdown_grace
        for e in self.entries:
            e.pool.wait_idle(max(0.0, deadline - time.monotonic()))
        with self._lock:
            stragglers = list(self._running)
        for cancel in stragglers:
            cancel.cancel("server shutting down")
        for e in self.entries:
            e.pool.wait_idle(5.0)
        self.watcher.stop()

    def close(self):
        """Free every session and model (after shutdown)."""
        for e in self.entries:
            for s in e.pool.sessions:
                s.close()
        for e in self.entries:
            e.model.close()
