"""The front's side of a model's worker process: start it, talk to it, notice its death.

WorkerClient is the one way the front reaches a model.  It starts
``offgrid.engine.worker`` with the interpreter and the offgrid package the
front itself runs from (a checkout, a pip install and the offline bundle
alike), then:

    call(method, **args)        a short request (tokenize, prepare a prompt, ...)
    generate(session, ...)      a generation on one of the worker's sessions,
                                its pieces handed to on_event as they come
    close()                     end the worker (idempotent)

Threads: one reader per worker takes every frame off its stdout and hands it
to the request that waits for it (a queue each), so a slow client never
holds up another's pieces.  A watchdog thread per worker reads its RSS twice
a second and kills it past ``max_rss``.

A worker that dies (a signal, std::terminate, the OOM killer, an exit) is
noticed at once by EOF on its pipe: every request it was serving fails with
WorkerDied saying how, and the worker is started again with backoff while
requests for the model wait (``wait_ready``).  A worker whose front dies
sees EOF on its stdin and exits.

A worker may say why before it dies: a "fatal" frame carries the error its
requests get instead of WorkerDied (an rpc-server that went away is an
RpcUnavailable, a 503 naming it).  While a restart cannot load the model
because an rpc-server is down (its "failed" frame says RpcUnavailable), the
restarts go on with backoff, so the model comes back with the endpoint,
and requests get that 503 at once instead of waiting for them.
"""

import itertools
import logging
import queue
import signal
import subprocess
import sys
import threading
import time

from ... import protocol
from ...errors import ModelLoadError, OffgridError, RpcUnavailable, WorkerDied
from ..httpd import burst
from ..httpd.httperrors import Unavailable
from .pending import Pending
from .worker_process import (_popen, _reap, data_limit, describe_exit, rss_of,
                             set_data_limit, worker_command)

log = logging.getLogger("offgrid.workers")

_MIB = 1 << 20
class WorkerClient:
    """One model's worker process, as the front sees it."""

    # Seconds between RSS readings: often enough to catch a runaway
    # allocation (libllama's grammar parser was seen growing 380 MB/s), rare
    # enough that waking up costs ggml's spinning threads nothing measurable.
    watch_interval = 0.5
    # Restart delays after successive deaths (seconds); a worker that served
    # for restart_reset seconds counts as healthy again.
    backoff = (0.2, 1.0, 2.0, 5.0, 10.0)
    restart_reset = 60.0
    # How long a request waits for a (re)starting worker before a 503.
    ready_timeout = 300.0
    # A stuck worker (SIGSTOPped, a deadlock, a C call holding the GIL, a decode
    # that never returns) is found and replaced like a dead one.  Once loaded it
    # gets a ping every heartbeat_every seconds, answered by the thread that
    # reads its frames (engine/worker.py): no pong for `timeout` seconds
    # (--worker-timeout), or generations running without a decode step for
    # progress_after times that, or a call unanswered for call_after times
    # that, and it is killed; its requests get WorkerDied naming the model.
    heartbeat_every = 2.0
    timeout = 30.0
    progress_after = 4
    call_after = 10
    # How long a read of the shelf (/slots, /props, /metrics) waits for the
    # worker's answer before it takes the last one.
    peek_timeout = 1.0

    def __init__(self, name, worker_args, max_rss=None, verbose=False, spawn=None,
                 sized_rss=None):
        self.name = name
        self.worker_args = list(worker_args)
        self.argv = worker_command(worker_args)
        # argv -> a started process with binary stdin/stdout pipes (Popen's
        # interface); tests hand in a worker running on threads of their own
        self.spawn = spawn or _popen
        self.max_rss = max_rss              # bytes, or None: no ceiling
        # sizes -> the ceiling, called when the worker reports what its KV caches
        # will take, before it allocates them (the default ceiling depends on it)
        self.sized_rss = sized_rss
        self.verbose = verbose
        self.info = None
        self.on_progress = None             # fraction -> None, while the model loads
        self.state = "loading"              # loading, ready, failed, closed
        self.error = None                   # why it failed to load
        # while restarts cannot load the model for an rpc-server that is down:
        # the RpcUnavailable message requests get at once (None otherwise)
        self.unavailable = None
        self._said_waiting = False          # the log said so once per outage
        self._fatal = None                  # the error a dying worker said its requests get
        self.starts = 0
        self.deaths = 0
        self.last_death = None
        self._cond = threading.Condition()
        self._write_lock = threading.Lock()
        self._pending = {}                  # request id -> Pending
        self._ids = itertools.count(1)
        self._proc = None
        self._killed_for = None
        self._last_rss = 0                  # the watchdog's last reading (bytes)
        # the heartbeat: when the worker last answered, what its last pong said,
        # and since when its decode steps have not moved with generations running
        self._alive_at = self._progress_at = time.monotonic()
        self._steps, self._running = 0, 0
        self._peeked = {}                   # method -> the last answer of a shelf read
        self._peek_missed_at = None         # _alive_at when a shelf read last went unanswered
        self._closing = False
        self._failures = 0
        self._started_at = 0.0

    # -- lifetime -----------------------------------------------------------------------
    def start(self, timeout=None):
        """Start the worker and wait until its model is loaded.

        Raises ModelLoadError if the model does not load (the worker says
        why, or dies saying nothing), Unavailable (503) naming the --rpc
        endpoint that does not answer: that is no fault of the model.
        """
        self._spawn()
        if not self.wait_ready(timeout or self.ready_timeout, raise_unavailable=False):
            if self._closing:
                # close() while it loaded: POST /models/unload, or the server's shutdown
                raise Unavailable("the load of model %s was stopped" % self.name)
            if self.unavailable:
                raise Unavailable(self.unavailable)
            raise ModelLoadError(self.error or "the worker for %s did not start" % self.name)
        return self

    def _spawn(self):
        # the ceiling holds from the worker's first instruction (lifeline.py)
        if self.max_rss:
            self.argv = worker_command(self.worker_args, data_limit(self.max_rss))
        proc = self.spawn(self.argv)
        with self._cond:
            self._proc = proc
            self._killed_for = None
            self._fatal = None
            self.state = "loading"
            self.starts += 1
            self._started_at = time.monotonic()
        threading.Thread(target=self._read, args=(proc,), daemon=True,
                         name="worker-reader-%s" % self.name).start()
        self.watch(proc)

    def watch(self, proc=None):
        """Start the watchdog of the current worker (its memory, its heartbeat) and the
        thread that pings it."""
        proc = proc or self._proc
        if proc is not None:
            threading.Thread(target=self._watch, args=(proc,), daemon=True,
                             name="worker-watchdog-%s" % self.name).start()
            # pings are written by a thread of their own: a write to a worker
            # that stopped reading blocks once the pipe is full, and the
            # watchdog must stay free to kill it
            threading.Thread(target=self._ping, args=(proc,), daemon=True,
                             name="worker-ping-%s" % self.name).start()

    def wait_ready(self, timeout=None, raise_unavailable=True):
        """Wait for a loaded worker; True if ready, else False or Unavailable."""
        with self._cond:
            self._cond.wait_for(lambda: self.state != "loading" or self.unavailable, timeout)
            if self.state == "ready":
                return True
            if self.unavailable and raise_unavailable:
                raise Unavailable(self.unavailable)
        if raise_unavailable:
            if self.state == "failed":
                raise Unavailable("model %s failed to load: %s" % (self.name, self.error))
            raise Unavailable("model %s is loading" % self.name)
        return False

    @property
    def pid(self):
        return self._proc.pid if self._proc is not None else None

    # Seconds a worker gets to write its prompt states to --cache-dir before it goes
    # (engine/statedisk.py): a few hundred MiB at disk speed.
    persist_timeout = 30.0
    # Whether the worker keeps prompt states on disk (launch.py: --cache-dir, not
    # --no-cache-disk): only then is it asked to write them before it goes.
    persist_states = False
    # A worker not heard from (pong, frames) this recently is not asked: a stopped
    # or stuck one would hold its close for persist_timeout.
    persist_heard_within = 5.0

    def close(self, timeout=5.0):
        """End the worker: EOF on its stdin, then SIGKILL if it lingers.  Idempotent.

        A loaded worker that answers first writes its prompt states to disk
        (``save_states``: sleep, unload and shutdown keep them for the next
        worker of the model); one that does not is not waited for."""
        with self._cond:
            persist = (self.persist_states and not self._closing and self.state == "ready"
                       and not self.unresponsive
                       and time.monotonic() - self._alive_at < self.persist_heard_within)
        if persist:
            try:
                self._call("save_states", "save_states", {}, deadline=self.persist_timeout,
                           peek=True)
            except Exception:       # noqa: BLE001 - a cache not written is no error
                pass
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self.state = "closed"
            proc = self._proc
            self._cond.notify_all()
        if proc is None:
            return
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    # -- frames ---------------------------------------------------------------------------
    def _send(self, obj):
        data = protocol.encode(obj)
        with self._write_lock:
            proc = self._proc
            try:
                proc.stdin.write(data)
                proc.stdin.flush()
            except (OSError, ValueError):
                pass    # the worker is gone; its reader fails the request

    def _open(self, what):
        """A new request id and its queue, failed at once if no worker is there."""
        rid = next(self._ids)
        p = Pending("%s (request %d)" % (what, rid))
        with self._cond:
            if self.state != "ready":
                raise Unavailable("model %s is %s" % (self.name, self.state))
            self._pending[rid] = p
        return rid, p

    def _forget(self, rid):
        with self._cond:
            self._pending.pop(rid, None)

    def _read(self, proc):
        """Hand each frame to its request; on EOF, fail them all and restart."""
        out = proc.stdout
        try:
            while True:
                frame, size = protocol.read_frame(out, sized=True)
                if frame is None:
                    break
                op = frame.get("op")
                if op == "ready":
                    with self._cond:
                        if self.unavailable:
                            sys.stderr.write("offgrid: model %s is back\n" % self.name)
                        self.info = protocol.decode_info(frame["info"])
                        self.state = "ready"
                        self._alive_at = self._progress_at = time.monotonic()
                        self._running = 0
                        self.unavailable, self._said_waiting = None, False
                        self._cond.notify_all()
                    continue
                if op == "pong":
                    now = time.monotonic()
                    steps, running = frame.get("steps"), frame.get("running", 0)
                    with self._cond:
                        self._alive_at = now
                        if not running or steps is None or steps != self._steps:
                            self._progress_at = now
                        self._steps, self._running = steps, running
                    continue
                if op == "sizing":
                    # the model's metadata is read, its KV caches not yet made:
                    # the ceiling that depends on them applies from here
                    if self.sized_rss is not None:
                        rss = self.sized_rss(frame)
                        if rss:
                            self.max_rss = rss
                            set_data_limit(proc.pid, rss)
                    continue
                if op == "progress":
                    # loading: the fraction libllama reports, for /models and the terminal
                    if self.on_progress is not None:
                        self.on_progress(frame.get("value", 0.0))
                    continue
                if op in ("failed", "fatal"):
                    # failed: the model did not load; fatal: the worker is about to
                    # abort, and says what its requests should get
                    with self._cond:
                        self.error = frame["error"].get("message")
                        if op == "fatal":
                            self._fatal = frame["error"]
                        if frame["error"].get("kind") == RpcUnavailable.__name__:
                            self.unavailable = self.error
                            self._cond.notify_all()
                    continue
                with self._cond:
                    p = self._pending.get(frame.get("id"))
                if p is not None:
                    if op in ("piece", "delta"):
                        p.put_piece(frame, size)
                    else:
                        p.queue.put(frame)
        except (protocol.ProtocolError, OSError, ValueError) as e:
            log.error("worker for %s: unreadable frames (%s)", self.name, e)
            proc.kill()
        self._died(proc)

    def _died(self, proc):
        returncode, peak = _reap(proc)
        with self._cond:
            how = describe_exit(returncode, self._killed_for)
            if (returncode == -signal.SIGABRT and not self._killed_for and self.max_rss
                    and peak >= self.max_rss * 3 // 4):
                # Past RLIMIT_DATA (lifeline.py) an allocation fails, and in
                # libllama that is std::bad_alloc and an abort: a worker that
                # aborts that close to its ceiling ran out of it
                how += (" (out of memory: it reached %d MiB, near --worker-max-rss %d MiB, "
                        "where an allocation fails)" % (peak // _MIB, self.max_rss // _MIB))
            closing = self._closing
            loaded = self.info is not None
            pending = list(self._pending.values())
            self._pending.clear()
            fatal = self._fatal
            started = self._started_at
            # a restart that found an rpc-server down: no news, it retries below
            waiting = self.unavailable is not None and fatal is None
            say_waiting = waiting and not self._said_waiting
            self._said_waiting = self._said_waiting or waiting
            # in the same critical section: no request may open on a dead worker
            if not closing:
                self.deaths += 1
                self.last_death = how
                if loaded:
                    self.state = "loading"
                else:
                    self.state = "failed"
                    self.error = self.error or "the worker ended while loading (%s)" % how
            self._cond.notify_all()
        for p in pending:
            p.queue.put({"op": "died", "how": how, "error": fatal})
        if closing:
            return
        if not loaded:
            # it never loaded: the model (or the library) is at fault, not a request
            log.error("model %s failed to load: %s", self.name, self.error)
            return
        with self._cond:
            if time.monotonic() - started > self.restart_reset:
                self._failures = 0
            delay = self.backoff[min(self._failures, len(self.backoff) - 1)]
            self._failures += 1
        if not waiting:
            running = ", ".join(p.what for p in pending) or "nothing"
            sys.stderr.write("offgrid: the worker for %s died (%s) while running: %s; "
                             "restarting it\n" % (self.name, fatal and fatal.get("message") or how,
                                                   running))
        elif say_waiting:
            sys.stderr.write("offgrid: model %s waits: %s; retrying every %g s at most\n"
                             % (self.name, self.unavailable, self.backoff[-1]))
        threading.Thread(target=self._restart, args=(delay,), daemon=True,
                         name="worker-restart-%s" % self.name).start()

    def _stuck(self, now):
        """Why the loaded worker counts as stuck now, or None."""
        with self._cond:
            if self.state != "ready":
                return None
            if now - self._alive_at > self.timeout:
                return ("stuck: no answer to its heartbeat for %d s (--worker-timeout)"
                        % (now - self._alive_at))
            if self._running and now - self._progress_at > self.timeout * self.progress_after:
                return ("stuck: %d generation%s running and no decode step for %d s"
                        % (self._running, "" if self._running == 1 else "s",
                           now - self._progress_at))
        return None

    @property
    def unresponsive(self):
        """Whether the loaded worker has missed a few heartbeats (it may be about to be
        found stuck): shelf reads do not ask it, /health says so."""
        return (self.state == "ready"
                and time.monotonic() - self._alive_at > 2 * self.heartbeat_every + 1.0)

    def _kill(self, proc, why):
        with self._cond:
            if self._killed_for is None:
                self._killed_for = why
        try:
            proc.kill()
        except OSError:
            pass

    def _ping(self, proc):
        seq = 0
        while proc.poll() is None and not self._closing:
            time.sleep(self.heartbeat_every)
            if self.state == "ready" and proc is self._proc:
                seq += 1
                self._send({"op": "ping", "seq": seq})

    def _restart(self, delay):
        time.sleep(delay)
        with self._cond:
            if self._closing:
                return
        try:
            self._spawn()
        except OSError as e:
            with self._cond:
                self.state, self.error = "failed", "could not start a worker: %s" % e
                self._cond.notify_all()

    def _watch(self, proc):
        """Kill the worker when its RSS passes max_rss, or when it is stuck; its reader
        then reports the death."""
        while proc.poll() is None:
            rss = rss_of(proc.pid) if self.max_rss else None
            if rss is not None:
                self._last_rss = rss
            why = None
            if rss is not None and rss > self.max_rss:
                why = ("killed: out of memory (RSS %d MiB over --worker-max-rss %d MiB)"
                       % (rss // _MIB, self.max_rss // _MIB))
            elif proc is self._proc:
                why = self._stuck(time.monotonic())
            if why:
                self._kill(proc, why)
                return
            # Near the ceiling, or loading (no decodes to disturb yet), look ten
            # times as often: memory grows hundreds of MB a second at worst, and
            # this catches it before RLIMIT_DATA (lifeline.py), a quarter above,
            # makes the allocation fail in C, where it is an abort.
            near = rss is not None and self.max_rss and rss > self.max_rss // 2
            time.sleep(self.watch_interval / 10 if near or self.state != "ready"
                       else self.watch_interval)

    # -- requests ----------------------------------------------------------------------------
    def call(self, method, what="", **args):
        """Run a worker method; its value, or the engine's exception raised here.

        A call unanswered for call_after x timeout seconds finds the worker
        stuck: it is killed, and this raises WorkerDied saying so."""
        return self._call(method, what, args)

    def peek(self, method):
        """A shelf read (slots, threads, batching): the worker's answer within
        peek_timeout, else the last one it gave (None if none).  Never asks a
        worker that is not loaded or misses its heartbeat."""
        # one unanswered read is enough: the next ones (a /slots reads several)
        # wait for the worker to be heard from again, so a page costs one timeout
        if self.state != "ready" or self.unresponsive or self._peek_missed_at == self._alive_at:
            return self._peeked.get(method)
        try:
            value = self._call(method, method, {}, deadline=self.peek_timeout, peek=True)
        except (OffgridError, Unavailable):
            self._peek_missed_at = self._alive_at
            return self._peeked.get(method)
        self._peeked[method] = value
        return value

    def _call(self, method, what, args, deadline=None, peek=False):
        if not peek:
            self.wait_ready(self.ready_timeout)
        rid, p = self._open(what or method)
        try:
            self._send({"op": "call", "id": rid, "method": method, "args": args})
            deadline = deadline or self.timeout * self.call_after
            try:
                frame = p.queue.get(timeout=deadline)
            except queue.Empty:
                if peek:
                    raise Unavailable("model %s did not answer within %g s"
                                      % (self.name, deadline))
                # stuck on this call: replace the worker; its death answers us
                proc = self._proc
                if proc is not None:
                    self._kill(proc, "stuck: %s unanswered for %d s" % (what or method,
                                                                        deadline))
                frame = p.queue.get()
            return self._outcome(frame)
        finally:
            self._forget(rid)

    def generate(self, session, tokens, gen, cancel, stream=False, chat=None, on_event=None,
                 what="", prepare=None, want_cached=False, on_slow=None, slow_after=0.0):
        """Run a generation on ``session``; returns the worker's result dict.

        ``on_event(frame)`` gets each "piece" or "delta" frame; returning
        False cancels.  ``cancel`` reaches the worker as a cancel frame.
        ``prepare`` instead of ``tokens``: (method, args) of the call that
        makes the prompt, run by the worker first (protocol.py).
        ``want_cached``: the result says which tokens the session's cache
        holds, not only how many.  ``on_slow()`` is called once if the
        request is still running ``slow_after`` seconds from now.
        """
        if on_slow is not None and self.state != "ready":
            on_slow()           # a restart may take seconds: watch the client meanwhile
            on_slow = None
        self.wait_ready(self.ready_timeout)
        rid, p = self._open(what or "generate")

        def hook():
            self._send({"op": "cancel", "id": rid, "reason": cancel.reason})

        def control(action):
            self._send({"op": "control", "id": rid, "action": action})
        try:
            frame = {"op": "generate", "id": rid, "session": session, "tokens": tokens,
                     "gen": protocol.encode_gen(gen), "stream": stream, "chat": chat}
            if prepare is not None:
                frame["prepare"] = {"method": prepare[0], "args": prepare[1]}
            if want_cached:
                frame["want_cached"] = True
            self._send(frame)
            cancel.attach(hook)
            cancel.attach_control(control)
            slow_at = time.monotonic() + slow_after
            try:
                while True:
                    if on_slow is None:
                        frame = p.queue.get()
                    else:
                        left = slow_at - time.monotonic()
                        if left <= 0:
                            on_slow()
                            on_slow = None
                            continue
                        try:
                            frame = p.queue.get(timeout=left)
                        except queue.Empty:
                            continue
                    if frame["op"] in ("piece", "delta"):
                        p.took(frame, cancel)
                        frame = self._burst(p, frame, on_event, cancel)
                        if frame is None:
                            continue
                    return self._outcome(frame)
            finally:
                cancel.detach(hook)
                cancel.detach_control(control)
        finally:
            self._forget(rid)

    @staticmethod
    def _burst(p, frame, on_event, cancel):
        """Hand on ``frame`` and every piece or delta queued behind it, their
        writes to the client gathered into one (server/burst.py); the first
        other frame (the result) if one came behind them, else None."""
        with burst.gathered():
            while True:
                if on_event is not None and on_event(frame) is False:
                    cancel.cancel("client gone")
                try:
                    frame = p.queue.get_nowait()
                except queue.Empty:
                    return None
                if frame["op"] not in ("piece", "delta"):
                    return frame
                p.took(frame, cancel)

    def _outcome(self, frame):
        op = frame["op"]
        if op == "result":
            return frame["value"]
        if op == "error" or frame.get("error"):
            raise protocol.decode_error(frame["error"])
        raise WorkerDied("the worker of model %s died (%s) during this request; it is being "
                         "restarted" % (self.name, frame.get("how")), how=frame.get("how"))
