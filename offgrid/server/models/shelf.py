"""The shelf: every model the server can serve, in memory or not, and when each comes and goes.

A model on the shelf is a ModelEntry (``server/service.py``) whether or not
its worker process runs.  Its status, in llama-server's router words:

    unloaded   on the shelf, no worker (never loaded, unloaded, evicted, keep_alive spent)
    loading    its worker is starting (a request or POST /models/load asked for it),
               or restarting after a death
    loaded     its worker serves it
    sleeping   unloaded by --sleep-idle-seconds; the next request wakes it, even
               with --no-models-autoload
    error      the file is not a GGUF, or its worker failed to load it; requests
               for it get a 500 saying why until the file changes

Where models come from: the command line (``-m``, ``--fim-model``, loaded at
start), every ``*.gguf`` in the ``--models-dir`` folders and one level of
their subfolders (split files as one model, named by their first part), and
the sections of ``--models-preset`` (llama-server's INI format).  The folders
are scanned again on ``/v1/models``, ``/api/tags`` and whenever a request
names a model the shelf does not know.  Names are only ever matched against
the shelf: a request cannot name a path.

The life of a load (``use``, on the request's own thread): the first request
for a model that is not loaded marks it ``loading`` and becomes its loader;
requests for the same model that come meanwhile wait for that one load.  The
loader first makes room: while loading it would pass ``--models-max`` or the
``--models-memory`` budget, the least recently used idle model is unloaded
(evicted).  Idle means no request holds it: every request holds each model
it uses from the moment it names it until its response is written
(``Service.request_scope``), so a model with a running stream, a queued
request, or one between its prompt preparation and its generation, is never
evicted; nor is a pinned one (``--fim-model``, ``--pin``).  If nothing can be
evicted the request gets a 503 saying why.  Then the worker starts
(``start_worker``, given by ``__main__``: the front's flags live there) and
the model is ``loaded``.

Unloading ends the model's worker process, which gives its memory back to
the system.  Idle models are unloaded by one reaper thread: after the
request's ``keep_alive`` (Ollama's: 0 unloads as soon as the request ends,
negative never), or else after ``--sleep-idle-seconds`` (status
``sleeping``).  Reading the shelf (/health, /props, /metrics, listings) never
wakes a model nor resets its timer: only ``use`` does.

Locking: one condition guards every entry's status, lease count and worker
slot; worker processes are started and closed outside it.
"""

import logging
import os
import sys
import threading
import time

from ...errors import ModelLoadError
from ..httpd.httperrors import BadRequest, HTTPError, NotFound, Unavailable
from .folders import file_key, gguf_problem, name_is_safe, scan
from .worker_process import rss_of

log = logging.getLogger("offgrid.shelf")

_MIB = 1 << 20


# -- the shelf -------------------------------------------------------------------------------

class Shelf:
    """The model table and the rules for loading and unloading; see the module docstring."""

    # Seconds between the reaper's looks at idle models: --sleep-idle-seconds
    # is honoured to within this.
    tick = 0.25
    # How many known names an unknown-model error lists.
    names_in_errors = 5
    # Seconds a load waits for a busy model to become idle before its 503: a request
    # lets go of its model just after its last byte is written, and a client that asks
    # for another model at once must not meet that moment.  Short: this is no queue.
    room_wait = 2.0

    def __init__(self, start_worker=None, dirs=(), preset=None, models_max=0, memory=0,
                 autoload=True, sleep_idle=None, fallback=True, announce=None, max_queue=None,
                 sampling_flags=None):
        self.start_worker = start_worker    # entry -> started WorkerClient (raises ModelLoadError)
        self.dirs = [os.path.abspath(d) for d in dirs]
        self.preset = preset                # (defaults, {name: settings}) or None
        self.models_max = max(0, int(models_max or 0))     # 0: no limit on the count
        self.memory = max(0, int(memory or 0))             # bytes; 0: no budget
        self.autoload = autoload
        self.sleep_idle = sleep_idle        # seconds, or None: never
        self.max_queue = max_queue          # jobs each model's pool lets wait (None: no bound)
        # the command line's sampling flags, {field: value} (models/sampling.py)
        self.sampling_flags = dict(sampling_flags or {})
        # an unknown name is served by the default model (no --models-dir)
        self.fallback = fallback
        self.announce = announce or (lambda line: sys.stderr.write("offgrid: %s\n" % line))
        self._entries = []
        self._cond = threading.Condition()
        self._closed = False
        self._reaper = None
        # the reaper sleeps on this, not on _cond: every request's use and
        # release notify _cond, and waking the reaper for each cost a request
        # a thread switch (it only needs its tick, and close)
        self._reaper_stop = threading.Event()
        self._clashes = set()       # files left out for a name already taken (warned once)

    # -- the table ----------------------------------------------------------------------
    @property
    def entries(self):
        with self._cond:
            return list(self._entries)

    def add(self, entry):
        """Put an entry on the shelf; returns it."""
        with self._cond:
            entry.shelf = self
            self._entries.append(entry)
        return entry

    def find(self, name):
        """The entry that answers to ``name`` (Ollama's ``x:latest`` is ``x``), or None."""
        if not isinstance(name, str) or not name:
            return None
        with self._cond:
            e = self._find_locked(name)
            if e is None and name.endswith(":latest"):
                e = self._find_locked(name[:-len(":latest")])
            return e

    def _find_locked(self, name):
        for e in self._entries:
            if e.answers_to(name):
                return e
        return None

    def lookup(self, name):
        """``find``, scanning the folders again on a miss (a file added since)."""
        e = self.find(name)
        if e is None and self.dirs and name_is_safe(name):
            self.rescan()
            e = self.find(name)
        return e

    def known_names(self):
        return [e.id for e in self.entries]

    def not_found(self, name):
        """The 404 for a name the shelf does not have, listing a few it has."""
        names = self.known_names()
        listed = ", ".join(names[:self.names_in_errors])
        more = len(names) - self.names_in_errors
        if more > 0:
            listed += " and %d more (GET /v1/models lists them)" % more
        return NotFound("model %s not found; this server has: %s"
                        % (_quote(name), listed or "no models"), type="not_found_error")

    def rescan(self):
        """Read the folders and the preset again: new files join, vanished ones that are
        not loaded leave, changed ones that failed get another chance."""
        if not self.dirs and self.preset is None:
            return
        from .entry import ModelEntry
        found = scan(self.dirs)
        defaults, sections = self.preset or ({}, {})
        added, removed = [], []
        with self._cond:
            # a file is one model per path it is reached by (two links, two names);
            # a command-line model found in a folder is the same model, by its real path
            by_path = {os.path.abspath(e.path): e for e in self._entries}
            by_real = {os.path.realpath(e.path): e for e in self._entries
                       if e.source == "command line"}
            seen = set()
            for name, path, more in found:
                path = os.path.abspath(path)
                if path in seen:
                    continue
                seen.add(path)
                e = by_path.get(path) or by_real.get(os.path.realpath(path))
                if e is None:
                    clash = next((x for x in self._entries if x.answers_to(name)), None)
                    if clash is not None:
                        if path not in self._clashes:
                            self._clashes.add(path)
                            log.warning("two models are named %s; serving %s, not %s",
                                        name, clash.path, path)
                        continue
                    e = ModelEntry(id=name, path=path, aliases=more, source="models_dir")
                    e.shelf = self
                    self._entries.append(e)
                    by_path[path] = e
                    added.append(e)
                else:
                    for n in [name] + more:
                        if not any(x.answers_to(n) for x in self._entries):
                            e.aliases.append(n)
                self._check_file(e)
            for section, settings in sections.items():
                e = self._find_locked(section)
                if e is None and settings.get("model"):
                    path = os.path.abspath(settings["model"])
                    e = by_path.get(path)
                    if e is None:
                        e = ModelEntry(id=section, path=path, source="preset")
                        e.shelf = self
                        self._entries.append(e)
                        by_path[path] = e
                        added.append(e)
                    elif not e.answers_to(section):
                        e.aliases.append(section)
                        e.listed_aliases = sorted(set(e.listed_aliases) | {section})
                    self._check_file(e)
                if e is None:
                    continue
                merged = dict(defaults)
                merged.update(settings)
                for alias in merged.pop("alias", []):
                    if self._find_locked(alias) is None:
                        e.aliases.append(alias)
                    if alias not in e.listed_aliases and alias != e.id:
                        e.listed_aliases = sorted(e.listed_aliases + [alias])
                tags = merged.pop("tags", [])
                if tags:
                    e.tags = sorted(set(e.tags) | set(tags))
                if merged.pop("pin", False):
                    e.pinned = True
                e.preset = merged
            for e in list(self._entries):
                # a file gone from its folder leaves the shelf, once nothing runs it
                if e.source == "models_dir" and os.path.abspath(e.path) not in seen \
                        and e.worker is None and e.status != "loading" and not e.active:
                    self._entries.remove(e)
                    removed.append(e)
            for e in self._entries:
                if e.preset is None and defaults:
                    e.preset = dict(defaults)
            self._cond.notify_all()
        for e in added:
            log.info("on the shelf: %s (%s)", e.id, e.path)
        for e in removed:
            log.info("gone from the shelf: %s", e.id)

    def _check_file(self, e):
        """An entry's status from its file: error for what cannot be a GGUF, a fresh chance
        for a failed one whose file changed.  Under the lock."""
        key = file_key(e.path)
        if key == e.file_key:
            return
        e.file_key = key
        if e.worker is not None or e.status == "loading":
            return
        problem = "the file is gone" if key is None else gguf_problem(e.path)
        if problem:
            e.set_status("error", problem)
        elif e.status == "error":
            e.set_status("unloaded")

    # -- using a model --------------------------------------------------------------------
    def use(self, entry, scope=None, autoload=None):
        """Hold ``entry`` for the request of ``scope`` (until its release), loaded.

        Loads it if need be (the request waits; concurrent requests share the
        load).  Raises BadRequest with --no-models-autoload for a model that
        is not loaded, Unavailable when no room can be made, HTTPError (500)
        for a model that cannot load.  Without a scope (a caller outside any
        HTTP request) the model is loaded but not held.
        """
        if scope is not None and entry in scope.held:
            return entry
        with self._cond:
            entry.active += 1
            entry.last_used = time.monotonic()
        try:
            self._ensure_loaded(entry, self.autoload if autoload is None else autoload)
        except BaseException:
            self._let_go(entry)
            raise
        if scope is None:
            self._let_go(entry)
        else:
            scope.held.append(entry)
        return entry

    def _let_go(self, entry):
        with self._cond:
            entry.active -= 1
            self._cond.notify_all()

    def release(self, entry, keep_alive=None):
        """A request is done with ``entry``: its idle timer starts now, with the request's
        ``keep_alive`` (None: the server's); keep_alive 0 unloads it at once."""
        worker = None
        with self._cond:
            entry.active -= 1
            entry.last_used = time.monotonic()
            entry.keep_alive = keep_alive
            if keep_alive == 0 and self._idle(entry) and self.start_worker is not None:
                worker = self._detach(entry, "unloaded")
            self._cond.notify_all()
        if worker is not None:
            self.announce("unloaded %s (keep_alive 0)" % entry.id)
            self._close_worker(entry, worker)

    def load(self, entry, wait=True):
        """POST /models/load and the models loaded at start: load ``entry`` now (a failed
        one gets another try).  With ``wait`` False the load runs on a thread of its own."""
        with self._cond:
            if entry.status == "error":
                entry.set_status("unloaded")
                entry.file_key = None
                self._check_file(entry)

        def run():
            try:
                self.use(entry, autoload=True)
            except (HTTPError, ModelLoadError) as e:
                if not wait:
                    log.warning("loading %s: %s", entry.id, getattr(e, "message", e))
                else:
                    raise
        if wait:
            run()
        else:
            threading.Thread(target=run, daemon=True, name="load-%s" % entry.id).start()

    def unload(self, entry, why="unloaded"):
        """POST /models/unload: end the model's worker now, requests running or not
        (those get 'worker died'), or stop its load (the requests waiting for it
        get 503); False if it was neither loaded nor loading."""
        with self._cond:
            if entry.worker is None:
                starting = entry.loading if entry.status == "loading" else None
                if starting is None:
                    return False
        if entry.worker is None:
            self.announce("stopped loading %s (%s)" % (entry.id, why))
            starting.close(timeout=1.0)     # its loader then finds the load stopped
            return True
        with self._cond:
            if entry.worker is None:
                return False
            worker = self._detach(entry, "unloaded")
            self._cond.notify_all()
        self.announce("unloaded %s (%s)" % (entry.id, why))
        self._close_worker(entry, worker)
        return True

    # -- loading ------------------------------------------------------------------------------
    def _ensure_loaded(self, entry, autoload):
        with self._cond:
            while True:
                if self._closed:
                    raise Unavailable("server is shutting down")
                w = entry.worker
                if w is not None:
                    if w.state != "failed" or self.start_worker is None:
                        return      # loaded, or restarting after a death (its client waits)
                    # it died and could not start again: the model is at fault now
                    self._detach(entry, "error", w.error or "its worker failed")
                    threading.Thread(target=w.close, daemon=True).start()
                    continue
                status = entry.status
                if status == "loading":
                    self._cond.wait()   # another request loads it: share that load
                    continue
                if status == "error":
                    raise HTTPError("model %s cannot be loaded: %s" % (_quote(entry.id),
                                                                       entry.error), status=500)
                if status == "unloaded" and not autoload:
                    raise BadRequest("model %s is not loaded (the server runs with "
                                     "--no-models-autoload); load it with POST /models/load"
                                     % _quote(entry.id))
                if self.start_worker is None:
                    raise Unavailable("model %s is not loaded" % _quote(entry.id))
                entry.set_status("loading")
                entry.progress = 0.0
                break
        started = time.monotonic()
        try:
            self._make_room(entry)
            self.announce("loading %s (%s)" % (entry.id, entry.path))
            worker = self.start_worker(entry)
        except ModelLoadError as e:
            with self._cond:
                entry.set_status("error", str(e))
                self._cond.notify_all()
            self.announce("cannot load %s: %s" % (entry.id, e))
            raise HTTPError("model %s cannot be loaded: %s" % (_quote(entry.id), e), status=500)
        except BaseException as e:
            with self._cond:
                # no room (503), shutdown: not the model's fault; /models says why
                entry.set_status("unloaded", getattr(e, "message", None))
                self._cond.notify_all()
            raise
        seconds = time.monotonic() - started
        with self._cond:
            closed = self._closed
            if not closed:
                entry.attach(worker)
                entry.loads += 1
                entry.load_seconds += seconds
                entry.last_used = time.monotonic()
            else:
                entry.set_status("unloaded")
            self._cond.notify_all()
        if closed:
            worker.close()
            raise Unavailable("server is shutting down")
        info = worker.info
        self.announce("loaded %s in %.1f s; flash attention %s; memory %s%s%s"
                      % (entry.id, seconds, info.flash_attn,
                         info.memory.get("description", "?"),
                         "; layers: " + info.placement if info.placement else "",
                         "; " + info.control_vector if info.control_vector else ""))
        for note in entry.sampling_notes:
            self.announce("%s: %s" % (entry.id, note))

    def estimate(self, entry):
        """Bytes a model will hold once loaded: what it held last time, else its file
        and a quarter more for its KV caches and buffers."""
        info = entry.info
        if info and entry.resident_peak:
            return entry.resident_peak
        try:
            size = os.path.getsize(entry.path)
        except OSError:
            size = 0
        if info:
            # what a GPU holds in its own memory is not the host's (/metrics shows it)
            return (max(0, info.file_size + info.kv_bytes - info.device_bytes)
                    + info.draft_bytes + 64 * _MIB)
        return size + size // 4 + 64 * _MIB

    def resident(self, entry):
        """Bytes a model holds now: its worker's RSS, or the estimate while it loads."""
        w = entry.worker
        if w is not None and w.pid is not None:
            rss = rss_of(w.pid)
            if rss is not None and w.state == "ready":
                entry.resident_peak = max(entry.resident_peak, rss)
                return rss
        if entry.worker is not None or entry.status == "loading":
            return self.estimate(entry)
        return 0

    def _occupies(self, e):
        return e.worker is not None or e.status == "loading"

    def _idle(self, e):
        """Whether nothing holds ``e`` and its worker serves: may be unloaded.  Under the lock."""
        w = e.worker
        return (e.active == 0 and w is not None and w.state == "ready" and e.pool is not None
                and e.pool.n_busy == 0 and e.pool.n_waiting == 0)

    def _make_room(self, entry):
        """Evict least recently used idle models until ``entry`` fits; Unavailable if it
        cannot."""
        if not self.models_max and not self.memory:
            return
        need = self.estimate(entry)
        deadline = time.monotonic() + self.room_wait
        while True:
            with self._cond:
                others = [e for e in self._entries if e is not entry and self._occupies(e)]
                over_count = self.models_max and len(others) + 1 > self.models_max
                used = sum(self.resident(e) for e in others) if self.memory else 0
                # the budget is about models side by side: one alone may be larger
                over_memory = self.memory and others and used + need > self.memory
                if not over_count and not over_memory:
                    return
                idle = sorted((e for e in others if not e.pinned and self._idle(e)),
                              key=lambda e: e.last_used)
                if not idle:
                    left = deadline - time.monotonic()
                    if left > 0 and any(not e.pinned for e in others):
                        self._cond.wait(left)   # a release or a finished load wakes us
                        continue
                    raise Unavailable(self._why_full(entry, others, over_count, used, need))
                victim = idle[0]
                worker = self._detach(victim, "unloaded")
                victim.evictions += 1
                self._cond.notify_all()
            self.announce("evicted %s (least recently used) to load %s" % (victim.id, entry.id))
            self._close_worker(victim, worker)

    def _why_full(self, entry, others, over_count, used, need):
        held = []
        for e in others:
            if e.pinned:
                held.append("%s is pinned" % e.id)
            elif e.worker is None or e.worker.state != "ready":
                held.append("%s is loading" % e.id)
            else:
                n = e.active + (e.pool.n_waiting if e.pool is not None else 0)
                held.append("%s has %d request%s running or queued" % (e.id, n,
                                                                       "" if n == 1 else "s"))
        if over_count:
            limit = "--models-max %d models are loaded" % self.models_max
        else:
            limit = ("the loaded models hold %d MiB and %s needs about %d MiB more, past "
                     "--models-memory %d MiB" % (used // _MIB, entry.id, need // _MIB,
                                                 self.memory // _MIB))
        return ("cannot load model %s now: %s and none can be unloaded (%s); retry when "
                "one is idle" % (_quote(entry.id), limit, "; ".join(held)))

    def _detach(self, entry, status, error=None):
        """Take the worker off ``entry``, leaving it ``status``; the caller closes the worker
        outside the lock.  Under the lock."""
        worker = entry.detach(status, error)
        entry.unloads += 1
        return worker

    def _close_worker(self, entry, worker):
        timeout = (entry.preset or {}).get("stop_timeout", 10.0)
        worker.close(timeout=max(0.1, float(timeout)))

    # -- idle unload ---------------------------------------------------------------------------
    def start_reaper(self):
        """Start the thread that unloads idle models (keep_alive, --sleep-idle-seconds)."""
        if self._reaper is None and self.start_worker is not None:
            self._reaper = threading.Thread(target=self._reap, daemon=True, name="shelf-reaper")
            self._reaper.start()

    def expires_in(self, entry, now=None):
        """Seconds until an idle ``entry`` is unloaded (None: never), and the status it
        then takes."""
        keep = entry.keep_alive
        if keep is None:
            keep = (entry.preset or {}).get("keep_alive")
        if keep is not None:
            return (None if keep < 0 else keep - ((now or time.monotonic()) - entry.last_used),
                    "unloaded")
        if self.sleep_idle is None or self.sleep_idle < 0 or entry.pinned:
            return None, None
        return self.sleep_idle - ((now or time.monotonic()) - entry.last_used), "sleeping"

    def _reap(self):
        while not self._reaper_stop.wait(self.tick):
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                due = []
                for e in self._entries:
                    if not self._idle(e):
                        continue
                    left, status = self.expires_in(e, now)
                    if left is not None and left <= 0:
                        due.append((e, status, self._detach(e, status)))
                if due:
                    self._cond.notify_all()
            for e, status, worker in due:
                self.announce("%s %s (idle)" % ("put to sleep" if status == "sleeping"
                                                 else "unloaded", e.id))
                self._close_worker(e, worker)

    # -- the end ---------------------------------------------------------------------------------
    def close(self):
        """End every worker (after the service's shutdown).  Idempotent."""
        with self._cond:
            self._closed = True
            workers = [(e, e.detach("unloaded")) for e in self._entries if e.worker is not None]
            # loads under way stop too: their worker would otherwise load on, alone
            workers += [(e, e.loading) for e in self._entries
                        if e.worker is None and e.loading is not None]
            self._cond.notify_all()
        self._reaper_stop.set()
        for e, w in workers:
            w.close()


def _quote(name):
    return '"%s"' % str(name)[:200].replace('"', '\\"')
