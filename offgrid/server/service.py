"""The server's state and the path of one generation request through it.

    handler (http.py) --typed request--> Service.generate
        supersede.register(id_slot)          a newer request cancels this one
        watcher.watch(socket)                a closed connection cancels this one
        pool.acquire(prompt)                 wait for a session (FIFO, warm cache first)
        worker.generate(session, ...)        the model's worker process evaluates and
                                             generates, pieces to on_piece
        pool.release, unregister, unwatch    always, in a finally

Service also owns the models (ModelEntry: a worker and the pool of its
sessions), the counters behind /metrics and /slots, and the shutdown
sequence.  It knows nothing of HTTP beyond raising the errors of
``server.errors``, and nothing of libllama: models live in their workers.
"""

import threading
import time
from dataclasses import dataclass, field
from typing import List

from ..request import (Completion, FinishReason, PromptProgress, RequestCancel, SamplingParams,
                       Usage)
from .. import protocol
from .errors import BadRequest, Unavailable
from .metrics import Metrics
from .pool import ChatPool, SessionSlot, Supersede
from .watcher import DisconnectWatcher


@dataclass
class ModelEntry:
    """One model: the names it answers to, its worker process and its sessions."""
    id: str
    worker: object              # server.workers.WorkerClient
    pool: ChatPool
    aliases: List[str] = field(default_factory=list)
    path: str = ""

    def answers_to(self, name):
        return name == self.id or name in self.aliases

    @classmethod
    def started(cls, worker, name=None, aliases=()):
        """The entry of a worker that has loaded its model (WorkerClient.start)."""
        info = worker.info
        slots = [SessionSlot(i) for i in range(info["n_sessions"])]
        return cls(id=name or info["name"], worker=worker, pool=ChatPool(slots),
                   aliases=list(aliases), path=info["path"])

    # what the front knows of the model, as its worker reported it at load
    @property
    def info(self):
        return self.worker.info

    @property
    def n_ctx(self):
        return self.worker.info["n_ctx"]

    @property
    def n_vocab(self):
        return self.worker.info["n_vocab"]

    @property
    def has_fim(self):
        return self.worker.info["has_fim"]

    @property
    def state(self):
        return self.worker.state

    def call(self, method, what="", **args):
        return self.worker.call(method, what, **args)


class ContextExceeded(BadRequest):
    """llama-server's exceed_context_size_error, with the two sizes its body reports."""
    type = "exceed_context_size_error"

    def __init__(self, n_prompt_tokens, n_ctx):
        super().__init__("the request exceeds the available context size: the prompt has "
                         "%d tokens and the context holds %d" % (n_prompt_tokens, n_ctx))
        self.n_prompt_tokens, self.n_ctx = n_prompt_tokens, n_ctx

    def body(self):
        out = super().body()
        out["error"].update(n_prompt_tokens=self.n_prompt_tokens, n_ctx=self.n_ctx)
        return out


class Service:
    """Models, pools, supersede table, counters, and the lifecycle of requests."""

    def __init__(self, text, fim=None, n_predict_default=-1, shutdown_grace=10.0,
                 cache_reuse=64, sampling_default=None, endpoints_off=()):
        self.text = text                # ModelEntry for text and chat requests
        self.fim = fim or text          # ModelEntry for /infill and suffix requests
        self.entries = [text] + ([fim] if fim is not None and fim is not text else [])
        self.n_predict_default = n_predict_default
        # what a request's sampling fields default to (--temp, --seed)
        self.sampling_default = sampling_default or SamplingParams()
        # optional endpoints switched off (--no-metrics, --no-slots): they answer 501
        self.endpoints_off = frozenset(endpoints_off)
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
    def generate(self, entry, tokens, gen, id_slot=-1, on_piece=None, sock=None, cancel=None,
                 chat=None, what=""):
        """Run one generation request from start to finish; returns a Completion.

        ``on_piece`` gets each streamed piece of text, or with ``chat`` each
        reply delta (a dict); returning False cancels.  With
        ``gen.with_probs`` it is called as ``on_piece(piece, probs)`` where the
        worker sent probabilities (a list of TokenProb).  With ``chat`` the
        Completion's ``reply`` is the parsed reply.  A request superseded
        or disconnected while waiting returns an empty CANCELLED completion
        without ever touching a session.
        """
        if self.state != "ready":
            raise Unavailable("server is shutting down")
        if len(tokens) >= entry.n_ctx:
            # refuse before queueing: waiting for a session only to fail wastes the wait
            raise ContextExceeded(len(tokens), entry.n_ctx)
        cancel = cancel or RequestCancel()
        key = (entry.id, id_slot) if id_slot >= 0 else None
        with self._lock:
            self._running.add(cancel)
        if key is not None:
            self.supersede.register(key, cancel, warmup=gen.n_predict == 0)
        if sock is not None:
            self.watcher.watch(sock, cancel)
        try:
            session = entry.pool.acquire(tokens, cancel)
            if session is None:
                c = Completion("", [], FinishReason.CANCELLED, "none", "",
                               Usage(prompt_tokens=len(tokens)))
            else:
                try:
                    c = self._run(entry, session, tokens, gen, on_piece, cancel, chat, what)
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

    def _run(self, entry, session, tokens, gen, on_piece, cancel, chat, what):
        on_event = None
        if on_piece is not None:
            def on_event(frame):
                if "progress" in frame:     # return_progress: how far the prompt has come
                    return on_piece(PromptProgress(**frame["progress"]))
                payload = frame["text"] if frame["op"] == "piece" else frame["delta"]
                if "probs" in frame:    # only requests that asked for them get them
                    return on_piece(payload, protocol.decode_probs(frame["probs"]))
                return on_piece(payload)
        try:
            out = entry.worker.generate(session.index, tokens, gen, cancel,
                                        stream=on_piece is not None, chat=chat,
                                        on_event=on_event, what=what)
        except BaseException:
            # the worker's cache is unknown now (reset, or a new worker)
            session.cached = []
            raise
        session.cached = out["cached"]
        c = protocol.decode_completion(out["completion"])
        c.reply = out.get("reply")
        c.n_cached = len(out["cached"])
        return c

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
        """End every model's worker (after shutdown)."""
        for e in self.entries:
            e.worker.close()
