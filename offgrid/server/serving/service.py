"""The server's state and the path of one generation request through it.

    handler (http.py) --typed request--> Service.generate
        supersede.register(id_slot)          a newer request cancels this one
        watcher.watch(socket)                a closed connection cancels this one
                                             (polled once the request waits or has
                                             run WATCH_AFTER seconds)
        pool.acquire(prompt, owner)          wait for a session (turns between requests,
                                             FIFO within one, warm cache first)
        worker.generate(session, ...)        the model's worker process evaluates and
                                             generates, pieces to on_piece
        pool.release, unregister, unwatch    always, in a finally

Service also owns the shelf of models (``shelf.py``; a ModelEntry per model,
with its worker and the pool of its sessions while it is loaded), holds
the models each HTTP request uses (``request_scope``), the counters behind
/metrics and /slots, and the shutdown sequence.  It knows nothing of HTTP beyond raising the errors of
``server.errors``, and nothing of libllama: models live in their workers.
"""

import contextlib
import threading
import time

from ...request import (Completion, FinishReason, GenerationParams, PromptProgress,
                        RequestCancel, Usage)
from ... import protocol
from ...errors import EncoderOnly, PromptTooLong
from ..httpd.httperrors import BadRequest, Unavailable
from ..models.folders import parse_duration
from ..models.shelf import Shelf
from .metrics import Metrics
from .supersede import Supersede
from .watcher import DisconnectWatcher

# Seconds a request runs before the disconnect watcher polls its socket
# (sooner if it has to wait for a session): a hang-up is seen that much later
# at most, and a request done sooner never wakes the watcher's thread.
WATCH_AFTER = 0.05


class _Scope:
    """One HTTP request's hold on the models it uses."""
    __slots__ = ("held",)

    def __init__(self):
        self.held = []


class Service:
    """Models, pools, supersede table, counters, and the lifecycle of requests."""

    def __init__(self, text, fim=None, generation_default=None, shutdown_grace=10.0,
                 cache_reuse=64, endpoints_off=(), shelf=None,
                 fim_given=None):
        self.text = text                # ModelEntry for text and chat requests (None: a
                                        # router with no default model)
        self.fim = fim or text          # ModelEntry for /infill and suffix requests
        # whether /infill always goes to self.fim (--fim-model) rather than to the model
        # a request names
        self.fim_given = fim is not None if fim_given is None else fim_given
        if shelf is None:
            # the models of the command line only, all loaded: nothing to load or unload
            shelf = Shelf()
            for e in [text] + ([fim] if fim is not None and fim is not text else []):
                if e is not None:
                    shelf.add(e)
        self.shelf = shelf
        # what a request leaves out, past its model's sampling defaults (-n,
        # --ignore-eos, --keep, --cache-prompt): api/fields.generation_from reads it
        self.generation_default = generation_default or GenerationParams()
        # optional endpoints switched off (--no-metrics, --no-slots): they answer 501
        self.endpoints_off = frozenset(endpoints_off)
        # --slot-save-path: POST /slots/ID?action=... (api/slot_actions.py); None: refused
        self.slot_save_path = None
        # minimum run of cached tokens that FIM requests move rather than
        # recompute (0: prefix reuse only); see engine/cachereuse.py
        self.cache_reuse = cache_reuse
        self.shutdown_grace = shutdown_grace
        self.supersede = Supersede()
        self.metrics = Metrics()
        self.watcher = DisconnectWatcher()
        self.state = "ready"
        self._running = set()           # RequestCancel of every request in generate()
        # completion id -> (its RequestCancel, whether it takes controls): the running
        # requests POST /v1/chat/completions/control may reach
        self._by_id = {}
        self._lock = threading.Lock()
        self._local = threading.local()     # .scope: the request this thread serves

    @property
    def entries(self):
        """Every model on the shelf, loaded or not."""
        return self.shelf.entries

    # -- choosing a model ---------------------------------------------------
    @contextlib.contextmanager
    def request_scope(self, body=None):
        """The span of one HTTP request (http.py wraps each handler in it): the models it
        uses are held from ``entry_for`` until here, and then released with the
        body's ``keep_alive`` (Ollama's; any dialect may send it)."""
        keep_alive = None
        if isinstance(body, dict) and body.get("keep_alive") is not None:
            try:
                keep_alive = parse_duration(body["keep_alive"])
            except ValueError as e:
                raise BadRequest(str(e))
        scope = _Scope()
        self._local.scope = scope
        try:
            yield scope
        finally:
            self._local.scope = None
            for e in scope.held:
                self.shelf.release(e, keep_alive)

    def _scope(self):
        return getattr(self._local, "scope", None)

    def entry_for(self, name, fim=False):
        """The model a request names by id or alias, else the default for its kind,
        loaded and held for this request.

        ``fim``: /infill and suffix requests go to --fim-model when one was
        given, else to the model named, else to the default.  An unknown
        name is served by the default model when the shelf allows it (no
        --models-dir), and is a 404 otherwise; no name and no default is a
        400.
        """
        shelf = self.shelf
        named = name if isinstance(name, str) and name else None
        if fim and self.fim_given and self.fim is not None:
            entry = self.fim
        else:
            entry = shelf.lookup(named) if named else None
            if entry is None:
                if named and not shelf.fallback:
                    raise shelf.not_found(named)
                entry = self.fim if fim else self.text
                if entry is None:
                    if named:
                        raise shelf.not_found(named)
                    raise BadRequest("'model' is required: name one of %s"
                                     % ", ".join(shelf.known_names()[:5]))
        return shelf.use(entry, self._scope())

    # -- running a request --------------------------------------------------
    @staticmethod
    def at_once(entry, n_jobs, id_slot=-1):
        """Whether run_choices runs ``n_jobs`` jobs at once, each on a session of
        its own, rather than one after another (one session, or an ``id_slot``)."""
        pool = entry.pool
        return n_jobs > 1 and id_slot < 0 and pool is not None and len(pool.sessions) > 1

    def run_choices(self, entry, jobs, id_slot=-1):
        """Run the ``jobs`` of one request (callables returning a Completion: its
        choices, or its prompts) and return their Completions in order, up to
        and including the first one cancelled.

        They run at once, each on a session of its own, so the worker decodes
        them in one batch (engine/batch.py), unless they would take turns
        anyway: one session, or an ``id_slot`` (each would supersede the last).
        """
        if not self.at_once(entry, len(jobs), id_slot):
            done = []
            for job in jobs:
                done.append(job())
                if done[-1].finish_reason is FinishReason.CANCELLED:
                    break
            return done
        done = [None] * len(jobs)
        errors = []

        def run(i):
            try:
                done[i] = jobs[i]()
            except BaseException as e:
                errors.append((i, e))
        threads = [threading.Thread(target=run, args=(i,), daemon=True,
                                    name="choice-%d" % i) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise min(errors, key=lambda e: e[0])[1]
        for i, c in enumerate(done):
            if c.finish_reason is FinishReason.CANCELLED:
                return done[:i + 1]
        return done

    @contextlib.contextmanager
    def controlled(self, cid, cancel, armed):
        """While it lasts, the request of completion id ``cid`` (and ``cancel``) can be
        reached by control(); ``armed``: it asked for that (reasoning_control)."""
        with self._lock:
            self._by_id[cid] = (cancel, armed)
        try:
            yield
        finally:
            with self._lock:
                self._by_id.pop(cid, None)

    def control(self, cid, action):
        """llama-server's control of a running completion: "reasoning_end" ends its
        thinking now.  Its answer: {"success": bool} and, where false, a "message"."""
        with self._lock:
            cancel, armed = self._by_id.get(cid, (None, False))
        if cancel is None:
            return {"success": False, "message": "no active completion for this id"}
        if not armed:
            return {"success": False,
                    "message": "reasoning control not enabled for this completion"}
        cancel.control(action)
        return {"success": True}

    @contextlib.contextmanager
    def one_request(self, entry, id_slot=-1, sock=None, warmup=False):
        """The span of one generate request, however many jobs it runs: yields its one
        (RequestCancel, look).

        The cancel is the request's: a newer request with the same ``id_slot``
        (supersede; a ``warmup``, n_predict 0, replaces only a warm-up), its
        client hanging up (the disconnect watcher, polling ``sock`` once a job
        waits or has run WATCH_AFTER: ``look`` asks for that) and the
        shutdown flip it, and every job of the request ends with it, queued
        ones before they start.
        """
        if self.state != "ready":
            raise Unavailable("server is shutting down")
        cancel = RequestCancel()
        key = (entry.id, id_slot) if id_slot >= 0 else None
        with self._lock:
            self._running.add(cancel)
        if key is not None:
            self.supersede.register(key, cancel, warmup=warmup)
        look = None
        if sock is not None:
            self.watcher.watch(sock, cancel, wake=False)
            look = self.watcher.wake
        try:
            yield cancel, look
        finally:
            if sock is not None:
                self.watcher.unwatch(sock, cancel)
            if key is not None:
                self.supersede.unregister(key, cancel)
            with self._lock:
                self._running.discard(cancel)

    def generate(self, entry, tokens, gen, id_slot=-1, on_piece=None, cancel=None, look=None,
                 chat=None, what="", prepare=None):
        """Run one generation job from start to finish; returns a Completion.

        ``cancel`` and ``look`` are the request's (``one_request``).
        ``on_piece`` gets each streamed piece of text, or with ``chat`` each
        reply delta (a dict); returning False cancels.  With
        ``gen.with_probs`` it is called as ``on_piece(piece, probs)`` where the
        worker sent probabilities (a list of TokenProb); with ``gen.piece_tokens``
        also ``tokens=`` (the ids the piece shows), with ``gen.timings_per_token``
        ``usage=`` (a Usage: the counts and times so far).  With ``chat`` the
        Completion's ``reply`` is the parsed reply.  A request cancelled
        while waiting returns an empty CANCELLED completion without ever
        touching a session.

        ``prepare`` (a model of one session only: no prompt tokens are
        needed to choose it): ``tokens`` is None and the worker makes the
        prompt with this (method, args) call as the generation starts, one
        round trip instead of two (``deferred_prepare``).
        """
        self.shelf.use(entry, self._scope())     # held already when it came from entry_for
        self.admit(entry, [tokens])
        cancel = cancel or RequestCancel()
        # this request's pool and worker: an unload (POST /models/unload) or a
        # reload must not hand its session back to another pool
        pool, worker = entry.pool, entry.worker
        if pool is None or worker is None:
            raise Unavailable("model %s was unloaded" % entry.id)
        if 0 <= id_slot < len(pool.sessions):
            # the session the request names (llama-server's id_slot), free or not
            named = pool.sessions[id_slot]
            session = named if pool.hold(named, cancel, on_wait=look) else None
        else:
            session = pool.acquire(tokens or [], cancel, on_wait=look,
                                   adapters=_adapter_key(gen))
        if session is None:
            c = Completion("", [], FinishReason.CANCELLED, "none", "",
                           Usage(prompt_tokens=len(tokens or [])))
        else:
            try:
                c = self._run(worker, pool, session, tokens, gen, on_piece, cancel, chat,
                              what, prepare, look)
            finally:
                pool.release(session)
        self.metrics.completion(c)
        return c

    def admit(self, entry, prompts):
        """Raise what a job would meet before it runs: the server shutting down, the
        model gone, an encoder asked for text, a prompt (tokens, or None: the
        worker makes it) the context cannot hold.  Refused before queueing:
        waiting for a session only to fail wastes the wait, and a stream can
        still answer with the real status."""
        if self.state != "ready":
            raise Unavailable("server is shutting down")
        if entry.pool is None or entry.worker is None:
            raise Unavailable("model %s was unloaded" % entry.id)
        if entry.info.memory.get("class") == "none":      # the worker refuses it too
            raise EncoderOnly.of(entry.info.meta.get("general.architecture", "?"))
        entry.pool.check_room()     # --max-queue: a stream still gets its 503 as a status
        for tokens in prompts:
            if tokens is not None and len(tokens) >= entry.n_ctx:
                # the same error as the worker's for a prompt it made itself
                raise PromptTooLong(n_prompt_tokens=len(tokens), n_ctx=entry.n_ctx)

    def _run(self, worker, pool, session, tokens, gen, on_piece, cancel, chat, what,
             prepare=None, look=None):
        on_event = None
        if on_piece is not None:
            def on_event(frame):
                if "progress" in frame:     # return_progress: how far the prompt has come
                    return on_piece(PromptProgress(**frame["progress"]))
                payload = frame["text"] if frame["op"] == "piece" else frame["delta"]
                # only requests that asked for them get probabilities, token ids
                # (gen.piece_tokens) and the usage so far (gen.timings_per_token)
                probs = protocol.decode_probs(frame["probs"]) if "probs" in frame else None
                extra = {}
                if "tokens" in frame:
                    extra["tokens"] = frame["tokens"]
                if "usage" in frame:
                    extra["usage"] = protocol.decode_live_usage(frame["usage"])
                if extra:
                    return on_piece(payload, probs, **extra)
                return on_piece(payload) if probs is None else on_piece(payload, probs)
        # the tokens themselves only pick among several sessions (pool.py)
        want_cached = len(pool.sessions) > 1
        try:
            out = worker.generate(session.index, tokens, gen, cancel,
                                  stream=on_piece is not None, chat=chat,
                                  on_event=on_event, what=what, prepare=prepare,
                                  want_cached=want_cached, on_slow=look,
                                  slow_after=WATCH_AFTER)
        except PromptTooLong:       # a prompt the worker made (prepare): nothing ran,
            raise                   # the cache is as it was (to_http_error answers it)
        except BaseException:
            # the worker's cache is unknown now (reset, or a new worker)
            session.cached, session.n_cached = [], 0
            raise
        session.adapters = _adapter_key(gen)
        if want_cached:
            k = out["cached_prefix"]
            session.cached = (tokens[:k] if k else []) + out["cached"]
        session.n_cached = out["n_cached"]
        c = protocol.decode_completion(out["completion"])
        c.reply = out.get("reply")
        c.n_cached = out["n_cached"]
        return c

    @staticmethod
    def deferred_prepare(entry, n_jobs, stream):
        """Whether a request's one prompt may be made by the worker as its
        generation starts (``generate``'s ``prepare``): one job, not streamed
        (stream pieces report the prompt's size), and a model of one session,
        so no prompt tokens are needed to choose where it runs."""
        pool = entry.pool
        return n_jobs == 1 and not stream and pool is not None and len(pool.sessions) == 1

    # -- shutdown -----------------------------------------------------------
    def stop_taking(self):
        """New requests get 503 from now on (/health too); nothing else changes yet."""
        self.state = "shutting_down"

    def shutdown(self):
        """Stop taking work: queued requests get 503, running ones get the grace period.

        Returns once every session is back in its pool (or after cancelling
        the stragglers and waiting a little more).
        """
        self.stop_taking()
        pools = [e.pool for e in self.entries if e.pool is not None]
        for pool in pools:
            pool.close()
        deadline = time.monotonic() + self.shutdown_grace
        for pool in pools:
            pool.wait_idle(max(0.0, deadline - time.monotonic()))
        with self._lock:
            stragglers = list(self._running)
        for cancel in stragglers:
            cancel.cancel("server shutting down")
        for pool in pools:
            pool.wait_idle(5.0)
        self.watcher.stop()

    def close(self):
        """End every model's worker (after shutdown)."""
        self.shelf.close()


def _adapter_key(gen):
    """The LoRA adapter key the worker gives a generation (engine/adapters.key_of,
    which the front may not import): its scales' non-zero pairs, by id."""
    return tuple(sorted((int(i), float(s)) for i, s in (gen.lora or ()) if s != 0))
