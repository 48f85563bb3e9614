"""ModelEntry: one model on the shelf, loaded or not.

The shelf (``shelf.py``) loads and unloads it; while it is loaded it holds
its worker process (``worker_client.WorkerClient``) and the pool of its
sessions (``sessions.ChatPool``).
"""

import time

from ...request import SamplingParams
from ..httpd.httperrors import Unavailable
from .sampling import model_defaults
from .sessions import ChatPool, SessionSlot


class ModelEntry:
    """One model on the shelf: the names it answers to, and while it is loaded its worker
    process and the pool of its sessions (``server/shelf.py`` loads and unloads it)."""

    def __init__(self, id, worker=None, pool=None, aliases=(), path="", source="command line",
                 pinned=False, settings=None):
        self.id = id
        self.aliases = list(aliases)    # every other name it answers to (a file's stem too)
        # what /models lists, as llama-server's: the aliases a user gave (-a, a
        # preset's alias), and informational tags (--tags, a preset's tags)
        self.listed_aliases = []
        self.tags = []
        self.path = path
        self.source = source            # "command line", "models_dir" or "preset"
        self.pinned = pinned            # never evicted nor put to sleep (--fim-model, --pin)
        self.settings = dict(settings or {})    # from the command line (chat_template)
        self.preset = None              # from --models-preset: [*] then [name]
        # its LoRA adapters (-m's: --lora), as given, and their global scales
        # (POST /lora-adapters; server/api/lora.py)
        self.lora_paths = []
        self.lora = []
        self.shelf = None
        self.worker = worker            # server.workers.WorkerClient, None while unloaded
        self.loading = None             # the WorkerClient starting, while it loads
        self.pool = pool                # ChatPool of its sessions, None while unloaded
        # what the worker reported at its last load: kept while unloaded, so listings
        # and /props still describe the model without waking it
        self._info = worker.info if worker is not None else None
        self._status = "loaded" if worker is not None else "unloaded"
        # what its requests sample with where they do not say, set at each load
        # (models/sampling.py), and the lines that say what of its file's was left out
        self.sampling = SamplingParams()
        self.sampling_notes = []
        self.error = None               # why it is in "error"
        self.progress = None            # 0..1 while loading, as its worker reports
        self.file_key = None            # (size, mtime) of the file when last looked at
        # held by requests now (Shelf.use .. Shelf.release), and since when idle
        self.active = 0
        self.last_used = time.monotonic()
        self.keep_alive = None          # seconds from the last request's keep_alive
        # counters for /metrics
        self.loads = 1 if worker is not None else 0
        self.unloads = 0
        self.evictions = 0
        self.load_seconds = 0.0
        self.resident_peak = 0
        self._past_starts = self._past_deaths = 0   # of the workers it had before this one

    @property
    def worker_starts(self):
        w = self.worker
        return self._past_starts + (w.starts if w is not None else 0)

    @property
    def worker_deaths(self):
        w = self.worker
        return self._past_deaths + (w.deaths if w is not None else 0)

    def answers_to(self, name):
        return name == self.id or name in self.aliases

    @classmethod
    def started(cls, worker, name=None, aliases=(), **kw):
        """The entry of a worker that has loaded its model (WorkerClient.start)."""
        info = worker.info
        entry = cls(id=name or info.name, worker=worker, aliases=aliases,
                    path=info.path, **kw)
        entry.attach(worker)
        return entry

    # -- loaded and unloaded (the shelf calls these under its lock) ---------------------------
    def attach(self, worker):
        info = worker.info
        self.worker = worker
        self._info = info
        self.pool = ChatPool([SessionSlot(i) for i in range(info.n_sessions)],
                             getattr(self.shelf, "max_queue", None))
        self._status, self.error, self.progress = "loaded", None, None
        try:
            self.sampling, self.sampling_notes = model_defaults(
                info.meta, self.preset, getattr(self.shelf, "sampling_flags", None),
                info.n_vocab)
        except ValueError as e:       # a preset read again since the start, now wrong
            self.sampling, self.sampling_notes = model_defaults(
                info.meta, None, getattr(self.shelf, "sampling_flags", None), info.n_vocab)
            self.sampling_notes.append("its preset's sampling keys left out: %s" % e)

    def detach(self, status="unloaded", error=None):
        """Forget the worker (the caller closes it); returns it."""
        worker, self.worker, self.pool = self.worker, None, None
        if worker is not None:
            self._past_starts += worker.starts
            self._past_deaths += worker.deaths
        self.set_status(status, error)
        self.keep_alive = None
        return worker

    def set_status(self, status, error=None):
        self._status, self.error = status, error
        if status != "loading":
            self.progress = None

    @property
    def status(self):
        """unloaded, loading, loaded, sleeping or error (server/shelf.py says when)."""
        w = self.worker
        if w is None:
            return self._status
        return {"ready": "loaded", "loading": "loading", "failed": "error",
                "closed": "unloaded"}.get(w.state, w.state)

    # what the front knows of the model, as its worker reported it at load (None:
    # never loaded yet)
    @property
    def info(self):
        w = self.worker
        if w is not None and w.info is not None:
            return w.info
        return self._info

    @property
    def n_ctx(self):
        return self.info.n_ctx

    @property
    def n_vocab(self):
        return self.info.n_vocab

    @property
    def has_fim(self):
        info = self.info
        return bool(info and info.has_fim)

    @property
    def state(self):
        """The worker's own state (loading, ready, failed, closed); closed while unloaded."""
        w = self.worker
        return w.state if w is not None else "closed"

    def call(self, method, what="", **args):
        w = self.worker
        if w is None:
            raise Unavailable("model %s is not loaded" % self.id)
        return w.call(method, what, **args)

    def peek(self, method):
        """A shelf read's answer from the worker (WorkerClient.peek): never waits long,
        None while there is none."""
        w = self.worker
        return w.peek(method) if w is not None else None
