"""--log-file (llama-server's): what the server writes goes to a file as well.

llama-server's log writes each line to the console and to the file.  offgrid's
lines come from more than one process: the front, each model's worker (and
libllama inside it, with -v) and the RPC servers write to the descriptors they
inherit.  So the copy is made at the descriptors: 1 and 2 become a pipe whose
reader writes what comes to where the descriptor went before and to the file.
A worker that aborts still gets its last words into the file.

Where 1 and 2 went to one place (``2>&1``, one terminal) they share one pipe,
so that their lines stay in the order written; otherwise each has its own, and
the file gets whole lines of each.
"""

import os
import sys
import threading


class LogFile:
    """Descriptors 1 and 2 copied into ``path`` (made anew, as llama-server's fopen "w")
    until close().  OSError if the file cannot be made."""

    def __init__(self, path):
        self._file = open(path, "wb")
        self._lock = threading.Lock()
        self._restore = []          # (descriptor, a copy of where it went before)
        self._pumps = []
        sys.stdout.flush()
        sys.stderr.flush()
        out, err = os.fstat(1), os.fstat(2)
        shared = (out.st_dev, out.st_ino) == (err.st_dev, err.st_ino)
        for fds in ([1, 2],) if shared else ([1], [2]):
            r, w = os.pipe()
            before = os.dup(fds[0])
            for fd in fds:
                self._restore.append((fd, os.dup(fd)))
                os.dup2(w, fd)
            os.close(w)
            pump = threading.Thread(target=self._pump, args=(r, before), daemon=True,
                                    name="log-file %s" % fds)
            pump.start()
            self._pumps.append(pump)

    def _pump(self, r, out):
        console, partial = True, b""
        while True:
            data = os.read(r, 65536)
            if not data:
                break
            rest = data
            while console and rest:
                try:
                    rest = rest[os.write(out, rest):]
                except OSError:
                    console = False     # the terminal went away: the file goes on
            # whole lines only, so that another pump's never cut one in two
            lines, cut = partial + data, (partial + data).rfind(b"\n") + 1
            partial = lines[cut:]
            self._to_file(lines[:cut])
        self._to_file(partial)
        os.close(r)
        os.close(out)

    def _to_file(self, data):
        with self._lock:
            if data and not self._file.closed:
                self._file.write(data)
                self._file.flush()

    def close(self, wait=2.0):
        """Put the descriptors back and write the rest: each pipe ends once no
        process holds it (the workers have ended by now); one that outlives this
        gets ``wait`` seconds."""
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, before in self._restore:
            os.dup2(before, fd)
            os.close(before)
        self._restore = []
        for pump in self._pumps:
            pump.join(wait)
        self._pumps = []
        with self._lock:
            self._file.close()
