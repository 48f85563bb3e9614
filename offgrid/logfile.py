"""--log-file (llama-server's): what the server writes goes to a file as well.

llama-server's log writes each line to the console and to the file.  offgrid's
lines come from more than one process: the front, each model's worker (and
libllama inside it, with -v) and the RPC servers write to the descriptors they
inherit.  So the copy is made at the descriptors: 1 and 2 each become a pipe,
whose reader writes what comes to where the descriptor went before and to the
file.  A worker that aborts still gets its last words into the file.
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
        self._pumps = []
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
            fd = stream.fileno()
            r, w = os.pipe()
            before = os.dup(fd)
            os.dup2(w, fd)
            os.close(w)
            pump = threading.Thread(target=self._pump, args=(r, before), daemon=True,
                                    name="log-file %d" % fd)
            pump.start()
            self._pumps.append((stream, fd, before, pump))

    def _pump(self, r, out):
        console = True
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
            with self._lock:
                if not self._file.closed:
                    self._file.write(data)
                    self._file.flush()
        os.close(r)
        os.close(out)

    def close(self, wait=2.0):
        """Put the descriptors back and write the rest: each pipe ends once no
        process holds it (the workers have ended by now); one that outlives this
        gets ``wait`` seconds."""
        for stream, fd, before, _ in self._pumps:
            stream.flush()
            os.dup2(before, fd)
        for _, _, _, pump in self._pumps:
            pump.join(wait)
        self._pumps = []
        with self._lock:
            self._file.close()
