"""A real offgrid server in a subprocess, and a small HTTP client for tests.

ServerProcess runs ``python -m offgrid`` on a free loopback port, waits for
its "listening on" line, and stops it with SIGTERM, returning the exit code.
The client helpers use http.client directly, so tests control connections,
bodies and headers exactly (the openai package is used where a test is about
that client).
"""

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Threads a test's server or session decodes with.  `make test` runs two
# pytest workers at once (pytest-xdist) on this 2-core machine: two
# processes of two ggml threads each would spin at every barrier waiting for
# a thread the other holds (the busy-machine collapse of issue 19), so under
# xdist each gets one.  Tests are about behaviour, not speed.
TEST_THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_env(**extra):
    """This process's environment for a make of its own, less the outer make's
    flags (jobserver, MODEL=...), which must not reach it; ``extra`` added."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env.update(extra)
    return env


class ServerProcess:
    """``python -m offgrid`` with the given flags; use as a context manager."""

    # True for a server started through a shell or make: it gets a process group of its
    # own, and stop() signals the whole group, so the server under them stops too
    own_group = False
    # An ssl.SSLContext for a server started with --ssl-key-file and --ssl-cert-file:
    # the client helpers then speak HTTPS, verifying the server's certificate with it
    tls = None

    def __init__(self, model, *args, threads=TEST_THREADS, ctx=2048, startup_timeout=120):
        self.port = free_port()
        self.host = "127.0.0.1"
        self.args = ["-m", str(model), "--port", str(self.port), "-t", str(threads),
                     "-c", str(ctx)] + [str(a) for a in args]
        self.startup_timeout = startup_timeout
        self.proc = None
        self.output = []
        self._reader = None

    @property
    def base(self):
        return "%s://%s:%d" % ("https" if self.tls else "http", self.host, self.port)

    def launch(self):
        """(argv, cwd, env) of the server process: this checkout's offgrid.

        Its XDG cache is a folder of its own (removed by stop): the prompt states a
        server writes there when it stops (engine/statedisk.py) must not reach
        another test's server, nor the user's ~/.cache.  A test of them passes
        --cache-dir."""
        if getattr(self, "cache_home", None) is None:
            self.cache_home = tempfile.mkdtemp(prefix="offgrid-test-cache-")
        return ([sys.executable, "-m", "offgrid"] + self.args, str(ROOT),
                dict(os.environ, PYTHONUNBUFFERED="1", XDG_CACHE_HOME=self.cache_home))

    # free_port() lets go of the port before the server binds it, and another
    # process may take it in between (another test's server, a client's
    # ephemeral port): a server that finds it taken starts again on another
    port_tries = 3

    def start(self):
        for attempt in range(self.port_tries):
            try:
                return self._start()
            except RuntimeError:
                if attempt + 1 == self.port_tries or not any(
                        "Address already in use" in line for line in self.output):
                    raise
            self.output = []
            old, self.port = self.port, free_port()
            self.args = [str(self.port) if a == str(old) and i and self.args[i - 1] == "--port"
                         else a for i, a in enumerate(self.args)]

    def _start(self):
        argv, cwd, env = self.launch()
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=self.own_group)
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.output.append(line)
                if line.startswith(("listening on http://", "listening on https://")):
                    ready.set()
        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + self.startup_timeout
        while not ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                if self.own_group and self.proc.poll() is None:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.kill()
                raise RuntimeError("%s did not start:\n%s" % (" ".join(argv), "".join(self.output)))
        return self

    def stop(self, timeout=60):
        """SIGTERM, then wait; returns the exit code."""
        try:
            return self._stop(timeout)
        finally:
            if getattr(self, "cache_home", None) is not None:
                shutil.rmtree(self.cache_home, ignore_errors=True)
                self.cache_home = None

    def _stop(self, timeout):
        if self.proc.poll() is None:
            if self.own_group:
                os.killpg(self.proc.pid, signal.SIGTERM)
            else:
                self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
            if self.own_group:
                self._wait_group(timeout)
            return code
        except subprocess.TimeoutExpired:
            if self.own_group:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("offgrid did not exit within %ss of SIGTERM:\n%s"
                                 % (timeout, "".join(self.output)))

    def _wait_group(self, timeout):
        """Wait until every process of the server's group is gone (make may exit
        before the server it started has finished shutting down)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            if time.monotonic() > deadline:
                os.killpg(self.proc.pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired("process group %d" % self.proc.pid, timeout)
            time.sleep(0.05)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        if self.proc and self.proc.poll() is None:
            self.stop()
        elif getattr(self, "cache_home", None) is not None:
            shutil.rmtree(self.cache_home, ignore_errors=True)
            self.cache_home = None

    # -- client helpers ------------------------------------------------------
    def conn(self, timeout=120):
        if self.tls is not None:
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout,
                                               context=self.tls)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def request(self, method, path, body=None, headers=None, timeout=120, raw=None):
        """One request on a new connection; returns (status, headers, parsed body)."""
        c = self.conn(timeout)
        try:
            data = raw if raw is not None else (json.dumps(body).encode() if body is not None
                                                else None)
            h = {"Content-Type": "application/json"} if data is not None else {}
            h.update(headers or {})
            c.request(method, path, body=data, headers=h)
            r = c.getresponse()
            payload = r.read()
            ctype = r.getheader("Content-Type", "")
            parsed = json.loads(payload) if "json" in ctype else payload.decode("utf-8", "replace")
            return r.status, dict(r.getheaders()), parsed
        finally:
            c.close()

    def get(self, path, **kw):
        return self.request("GET", path, **kw)

    def post(self, path, body, **kw):
        return self.request("POST", path, body, **kw)

    def stream(self, path, body, headers=None, timeout=120):
        """POST a streaming request; returns (status, [event payloads as parsed JSON or str])."""
        c = self.conn(timeout)
        try:
            h = {"Content-Type": "application/json"}
            h.update(headers or {})
            c.request("POST", path, body=json.dumps(body).encode(), headers=h)
            r = c.getresponse()
            if r.status != 200:
                return r.status, [json.loads(r.read())]
            assert r.getheader("Content-Type", "").startswith("text/event-stream")
            return r.status, parse_sse(r.read().decode("utf-8"))
        finally:
            c.close()

    def metrics(self):
        """/metrics as {name: value} (labels kept in the name)."""
        status, _, text = self.get("/metrics")
        assert status == 200
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def wait_busy(self, busy=1, queued=0, timeout=30):
        """Wait until at least ``busy`` sessions run and ``queued`` requests wait."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["offgrid_sessions_busy"] >= busy and m["offgrid_queue_length"] >= queued:
                return m
            if time.monotonic() > deadline:
                raise AssertionError("never %d busy and %d queued in %ss: %r"
                                     % (busy, queued, timeout, m))
            time.sleep(0.02)

    def wait_cached(self, n_cached, model=None, timeout=30):
        """Wait until a busy session (of ``model``, if given) holds ``n_cached`` tokens:
        /slots shows its cache grow as the prompt is decoded, a batch at a time, then as
        it generates."""
        deadline = time.monotonic() + timeout
        while True:
            _, _, slots = self.get("/slots")
            if any(s["is_processing"] and s["n_cached"] >= n_cached
                   and model in (None, s["model"]) for s in slots):
                return slots
            if time.monotonic() > deadline:
                raise AssertionError("no busy session held %d tokens in %ss: %r"
                                     % (n_cached, timeout, slots))
            time.sleep(0.02)

    def wait_idle(self, timeout=30):
        """Wait until no session is busy and nobody queues; returns the metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["offgrid_sessions_busy"] == 0 and m["offgrid_queue_length"] == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError("sessions still busy after %ss: %r" % (timeout, m))
            time.sleep(0.05)


class Call(threading.Thread):
    """One request on its own connection, in the background.

    ``.result``: (status, body), or for a stream (``stream``; by default the
    body's own "stream") (status, events); ``.done_at``: when it ended and
    ``.elapsed``: how long it took (None while it runs).  start() it, join() it.
    """

    def __init__(self, srv, path, body, stream=None):
        super().__init__(daemon=True)
        self.srv, self.path, self.body = srv, path, body
        self.streamed = bool(body.get("stream")) if stream is None else stream
        self.result = self.done_at = self.elapsed = None

    def run(self):
        t0 = time.monotonic()
        if self.streamed:
            self.result = self.srv.stream(self.path, self.body)
        else:
            status, _, body = self.srv.post(self.path, self.body)
            self.result = (status, body)
        self.done_at = time.monotonic()
        self.elapsed = self.done_at - t0


def parse_sse(text):
    """The data payloads of an event stream, JSON-decoded where they are JSON."""
    events = []
    for block in text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                try:
                    events.append(json.loads(data))
                except ValueError:
                    events.append(data)
    return events
