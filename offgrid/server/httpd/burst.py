"""A burst: the stream frames a worker wrote together go to the client in one socket write.

The worker groups a fast stream's pieces (engine/pacing.py); the request's
thread takes every frame already queued for it at once (WorkerClient.generate)
and, inside ``gathered()``, each stream's messages are kept and written
together when the burst ends: one chunk of several events, one wake-up of
the client, instead of one each.  Each event is still a message of its own
on the wire; a client reads the same events either way.

Per thread: a request's thread is the only writer of its response, and a
burst is one thread's loop, so nothing is shared.
"""

import contextlib
import threading

_local = threading.local()


@contextlib.contextmanager
def gathered():
    """Writes made through ``write`` on this thread wait for the end of the block."""
    outer = getattr(_local, "pending", None)
    if outer is not None:       # already in a burst: the outer one writes
        yield
        return
    pending = _local.pending = {}       # write function -> [bytes]
    try:
        yield
    finally:
        _local.pending = None
        for write, parts in pending.items():
            write(b"".join(parts))


def write(write_now, data):
    """``write_now(data)``, or kept for the burst this thread is in (True then:
    a client that went away is seen at the burst's write, and the next)."""
    pending = getattr(_local, "pending", None)
    if pending is None:
        return write_now(data)
    pending.setdefault(write_now, []).append(data)
    return True
