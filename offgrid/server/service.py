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

import os
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import List, Optional

from ..request import Completion, FinishReason, RequestCancel, Usage
from .. import protocol
from .errors import BadRequest, Unavailable
from .pool import ChatPool, SessionSlot, Supersede


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


class Metrics:
    """Cumulative counters, updated under one lock."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests = {}              # endpoint -> count
        self.prompt_tokens = 0
        self.prompt_seconds = 0.0
        self.cached_tokens = 0
        self.predicted_tokens = 0
        self.predicted_seconds = 0.0
        self.cancelled = 0
        self.errors = 0
        self.started = time.time()

    def request(self, endpoint):
        with self._lock:
            self.requests[endpoint] = self.requests.get(endpoint, 0) + 1

    def completion(self, c):
        with self._lock:
            u = c.usage
            self.prompt_tokens += u.evaluated_tokens
            self.cached_tokens += u.cached_tokens
            self.prompt_seconds += u.prompt_ms / 1000.0
            self.predicted_tokens += u.completion_tokens
            self.predicted_seconds += u.generation_ms / 1000.0
            if c.finish_reason is FinishReason.CANCELLED:
                self.cancelled += 1

    def error(self):
        with self._lock:
            self.errors += 1


# Linux's "peer closed its end" poll event.  Elsewhere the watcher falls back
# to looking every `interval` seconds for a readable socket with nothing in it.
_POLLRDHUP = getattr(select, "POLLRDHUP", 0)
_GONE = select.POLLHUP | select.POLLERR | select.POLLNVAL | _POLLRDHUP


class DisconnectWatcher:
    """Cancels requests whose client closed its connection.

    One thread waits in poll() on the sockets of running requests and on a
    pipe that watch() and unwatch() write to, so it wakes only when a client
    hangs up or the set changes.  (It used to wake 20 times a second: on 2
    cores each wake-up takes a core from one of ggml's spinning threads, and
    the other waits at the next barrier; measured in one process, a 20 Hz
    poller took 2 to 4% off prompt speed.)
    While a request runs its client has nothing more to send, so a hang-up
    is the only event; it cancels the request, which also aborts a prompt
    evaluation in progress.
    """

    interval = 0.05     # seconds between looks where poll has no POLLRDHUP

    def __init__(self):
        self._lock = threading.Lock()
        self._watched = {}              # fileno -> (socket, RequestCancel)
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="disconnect-watcher", daemon=True)
        self._thread.start()

    def watch(self, sock, cancel):
        with self._lock:
            self._watched[sock.fileno()] = (sock, cancel)
        self._wake()

    def unwatch(self, sock):
        with self._lock:
            self._watched.pop(sock.fileno(), None)
        self._wake()

    def stop(self):
        self._stop.set()
        self._wake()

    def _wake(self):
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass                        # the pipe is full: a wake-up is already pending

    def _run(self):
        try:
            while not self._stop.is_set():
                self._look()
        finally:
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _look(self):
        with self._lock:
            # a cancelled request's socket stays watched until its handler
            # unwatches it; polling it again would return at once, forever
            items = [(fd, sock, cancel) for fd, (sock, cancel) in self._watched.items()
                     if not cancel.cancelled]
        # poll, not select: select cannot watch descriptors past 1023,
        # which a busy server's sockets reach
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        for fd, _, _ in items:
            poller.register(fd, _POLLRDHUP or select.POLLIN | select.POLLPRI)
        try:
            ready = dict(poller.poll(None if _POLLRDHUP else self.interval * 1000))
        except OSError:
            return
        if ready.pop(self._wake_r, 0):
            os.read(self._wake_r, 4096)
        for fd, sock, cancel in items:
            events = ready.get(fd, 0)
            if events & _GONE or (events and self._closed(sock)):
                cancel.cancel("client disconnected")
        if ready and not _POLLRDHUP:
            self._stop.wait(self.interval)      # a socket with unread bytes stays readable

    @staticmethod
    def _closed(sock):
        try:
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True


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
    def generate(self, entry, tokens, gen, id_slot=-1, on_piece=None, sock=None, cancel=None,
                 chat=None, what=""):
        """Run one generation request from start to finish; returns a Completion.

        ``on_piece`` gets each streamed piece of text, or with ``chat`` each
        reply delta (a dict); returning False cancels.  With ``chat`` the
        Completion's ``reply`` is the parsed reply.  A request superseded
        or disconnected while waiting returns an empty CANCELLED completion
        without ever touching a session.
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
                return on_piece(frame["text"] if frame["op"] == "piece" else frame["delta"])
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
