"""The servers under test, started the same way, and a small HTTP client.

``Server`` runs one server process on a free loopback port, waits until it
answers ``/health`` with 200, and stops it with SIGTERM.  ``offgrid()``,
``llama_server()`` (built from our patched source) and ``llama_server_stock()``
(the pinned source as it ships: what users run) build the command lines from
one ``Config`` so they get the same model, threads, batch and context:

* offgrid's ``-c`` is per session; llama-server's ``-c`` is the total its
  ``-np`` slots share, so llama-server gets ``-c ctx * parallel``.
* offgrid always keeps a full-size sliding-window cache (prefix reuse on
  gemma-3 needs it); llama-server gets ``--swa-full`` to match, and
  ``--cache-reuse 256`` as llama.vscode's docs recommend for FIM.
* ``Config.extra`` holds flags for one server only (a speculation type), so a
  scenario can start variants of the same server.

Every wait here is bounded; a server that does not come up within its
startup timeout is killed and its log tail shown.
"""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"


def _vmhwm_kb(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/%d/status" % pid)


def _children(pid):
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open("/proc/%s/stat" % name) as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(name))
            except (OSError, ValueError, IndexError):
                pass
    return out


@dataclass
class Config:
    """What both servers are started with."""
    model: str
    threads: Optional[int] = 2     # None: the server's own default
    ctx: int = 4096             # per session / slot
    parallel: int = 1
    batch: int = 512
    ubatch: int = 512
    extra: tuple = ()           # flags for this server only (--spec-type; rpc.py: --rpc)
    cache_dir: Optional[str] = None     # offgrid's --cache-dir; None: --no-cache-disk


def free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Server:
    """One server process; use as a context manager."""

    startup_timeout = 180.0     # seconds to load the model on a loaded machine
    stop_timeout = 30.0         # seconds from SIGTERM to exit before SIGKILL

    def __init__(self, name, argv_for_port, ready_line=None):
        self.name = name
        self.port = free_port()
        self.argv = argv_for_port(self.port)
        self.ready_line = ready_line
        self.proc = None
        self._logdir = None
        self.log_path = None

    def start(self):
        self._logdir = tempfile.TemporaryDirectory(prefix="offgrid-bench-")
        self.log_path = Path(self._logdir.name) / (self.name + ".log")
        log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(self.argv, cwd=str(ROOT), stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
        finally:
            log.close()
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("%s exited with %s while starting:\n%s"
                                   % (self.name, self.proc.returncode, self.log_tail()))
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("%s did not start within %.0f s:\n%s"
                                   % (self.name, self.startup_timeout, self.log_tail()))
            if self._ready():
                return self
            time.sleep(0.2)

    def _ready(self):
        if self.ready_line and self.ready_line not in self.log_text():
            return False
        try:
            status, _, _ = request(self.port, "GET", "/health", timeout=5)
        except OSError:
            return False
        return status == 200

    def log_text(self):
        try:
            return self.log_path.read_text("utf-8", "replace")
        except OSError:
            return ""

    def log_tail(self, n=30):
        return "\n".join(self.log_text().splitlines()[-n:])

    def peak_rss_mb(self):
        """VmHWM (peak resident set) of the server process plus its children's, in MiB:
        offgrid's models run in worker processes.  A sum of peaks, so never below the
        peak of the sum."""
        return sum(_vmhwm_kb(pid) for pid in [self.proc.pid] + _children(self.proc.pid)) / 1024.0

    def stop(self):
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        try:
            self.stop()
        finally:
            if self._logdir is not None:
                self._logdir.cleanup()


class CpuMeter:
    """How busy the rest of the machine was while a server was measured.

    The load average counts the benchmark's own threads and lags by a
    minute; this counts CPU time instead: the machine's busy time (from
    /proc/stat) minus the server's (with its worker processes) and this
    process's own, as a fraction of all cores over the interval.  0 means nothing else ran; 0.5 on a 2-core
    machine means another process kept one core busy the whole time.
    """

    def __init__(self, *pids):
        self.pids = pids        # the servers being measured
        self.hz = os.sysconf("SC_CLK_TCK")
        self._start = None

    def _sample(self):
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = sum(fields[i] for i in (0, 1, 2, 5, 6, 7) if i < len(fields))
        server = 0
        # offgrid's model runs in a worker process, a child of the server.
        for pid in [p for pid in self.pids for p in [pid] + _children(pid)]:
            try:
                with open("/proc/%d/stat" % pid) as f:
                    rest = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            server += int(rest[11]) + int(rest[12])     # utime, stime (fields 14, 15)
        me = os.times()
        return time.monotonic(), busy / self.hz, server / self.hz, me.user + me.system

    def start(self):
        self._start = self._sample()

    def others(self):
        """Fraction of all cores used by other processes since start()."""
        t1, busy1, srv1, me1 = self._sample()
        t0, busy0, srv0, me0 = self._start
        elapsed = (t1 - t0) * (os.cpu_count() or 1)
        other = (busy1 - busy0) - (srv1 - srv0) - (me1 - me0)
        return max(0.0, other / elapsed) if elapsed > 0 else 0.0


def _threads(cfg, *flags):
    """The thread flags, or none where cfg.threads is None: the server's default."""
    return [] if cfg.threads is None else [x for f in flags for x in (f, str(cfg.threads))]


def offgrid(cfg, bins=None):
    """``python -m offgrid`` from this checkout (bins, llama-server's folders, unused)."""
    def argv(port):
        return [sys.executable, "-m", "offgrid", "-m", cfg.model, "--host", HOST,
                "--port", str(port)] + _threads(cfg, "-t") + [
                "-c", str(cfg.ctx), "-np", str(cfg.parallel), "-b", str(cfg.batch),
                "-ub", str(cfg.ubatch)] + (
                # prompt states in memory only, as llama-server's --cache-ram: none
                # written at stop for the next run's server to find (bench/wake.py
                # gives a folder of its own)
                ["--cache-dir", cfg.cache_dir] if cfg.cache_dir else ["--no-cache-disk"]) + [
                str(x) for x in cfg.extra]
    return Server("offgrid", argv, ready_line="listening on http://")


def _llama_server(name, bindir, cfg):
    def argv(port):
        return [str(Path(bindir) / "llama-server"), "-m", cfg.model, "--host", HOST,
                "--port", str(port)] + _threads(cfg, "-t", "-tb") + [
                "-c", str(cfg.ctx * cfg.parallel), "-np", str(cfg.parallel),
                "-b", str(cfg.batch), "-ub", str(cfg.ubatch),
                "--swa-full", "--cache-reuse", "256", "--metrics", "--no-webui"] + [
                str(x) for x in cfg.extra]
    return Server(name, argv)


def llama_server(cfg, bins):
    """llama-server built from our patched source (bins["llama_server"]), with the
    flags that match offgrid's setup."""
    return _llama_server("llama-server", bins["llama_server"], cfg)


def llama_server_stock(cfg, bins):
    """llama-server built from the unpatched pinned source (bins["llama_server_stock"])."""
    return _llama_server("llama-server-stock", bins["llama_server_stock"], cfg)


SERVERS = {"offgrid": offgrid, "llama_server": llama_server,
           "llama_server_stock": llama_server_stock}


# -- HTTP client ---------------------------------------------------------------

def request(port, method, path, body=None, timeout=300):
    """One request on a new connection: (status, parsed JSON or text, wall seconds)."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers=headers)
        r = conn.getresponse()
        payload = r.read()
        wall = time.perf_counter() - t0
        if "json" in r.getheader("Content-Type", ""):
            return r.status, json.loads(payload), wall
        return r.status, payload.decode("utf-8", "replace"), wall
    finally:
        conn.close()


def post(port, path, body, timeout=300):
    """POST expecting 200; returns (parsed JSON, wall seconds)."""
    status, obj, wall = request(port, "POST", path, body, timeout)
    if status != 200:
        raise RuntimeError("POST %s: HTTP %d: %s" % (path, status, str(obj)[:500]))
    return obj, wall


def stream(port, path, body, timeout=300, on_event=None, origin=None):
    """POST a streaming request; returns [(arrival seconds, event JSON)].

    Arrivals are seconds from the send, or from ``origin`` (a perf_counter
    reading) to share a clock with another client; ``on_event(n)`` is called
    after the n-th event arrives.
    """
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        t0 = time.perf_counter() if origin is None else origin
        conn.request("POST", path, body=json.dumps(dict(body, stream=True)).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError("POST %s: HTTP %d: %s" % (path, r.status, r.read()[:500]))
        events = []
        for _ in range(1_000_000):          # bounded: far more lines than any answer has
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):]
            if data == b"[DONE]":
                break
            events.append((time.perf_counter() - t0, json.loads(data)))
            if events[-1][1].get("stop"):
                break
            if on_event is not None:
                on_event(len(events))
        return events
    finally:
        conn.close()
