"""A model's worker on threads of the test process, behind a real WorkerClient.

The front talks to it over real pipes and the real protocol; the test can
reach into its sessions (to inject a libllama fault, say), which a worker in
its own process would not allow.
"""

import os
import threading

from offgrid import protocol
from offgrid.engine.loaded import Loaded
from offgrid.engine.worker import Worker
from offgrid.server.models.entry import ModelEntry
from offgrid.server.models.worker_client import WorkerClient


class InProcessWorker:
    """Popen's interface (stdin, stdout, pid, poll, wait, kill) over a thread."""

    def __init__(self, loaded):
        to_worker_r, to_worker_w = os.pipe()
        to_front_r, to_front_w = os.pipe()
        self.stdin = os.fdopen(to_worker_w, "wb")
        self.stdout = os.fdopen(to_front_r, "rb")
        self.pid = os.getpid()
        self.returncode = None
        inp, out = os.fdopen(to_worker_r, "rb"), os.fdopen(to_front_w, "wb")
        worker = Worker(loaded, out)

        def run():
            worker.send({"op": "ready", "info": protocol.encode_info(loaded.info())})
            worker.serve(inp)
            out.close()
            inp.close()
            self.returncode = 0
        self._thread = threading.Thread(target=run, daemon=True, name="inproc-worker")
        self._thread.start()

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        self._thread.join(timeout)
        return self.returncode

    def kill(self):
        self.stdin.close()


def entry_over(model, sessions, name="tiny"):
    """A started ModelEntry whose worker serves ``sessions`` of ``model`` in this process."""
    loaded = Loaded(model, sessions)
    client = WorkerClient(name, [], spawn=lambda argv: InProcessWorker(loaded))
    return ModelEntry.started(client.start(timeout=30), name)
