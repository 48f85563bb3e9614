"""One request's place at a worker (WorkerClient): the queue its frames arrive on,
and the bound on what may wait there for a slow client."""

import queue
import threading

# Bytes of stream frames one request may have waiting for its thread (its
# client reads slowly; the socket write blocks for up to --timeout): past it
# the rest are dropped and the request is cancelled, rather than buffered
# without end (issue 37: n_probs made a token's frame kilobytes).
MAX_BUFFERED = 8 << 20


class Pending:
    """A request waiting for its frames."""
    __slots__ = ("queue", "what", "lock", "buffered", "overflow")

    def __init__(self, what):
        self.queue = queue.SimpleQueue()
        self.what = what        # method and path for the log, never content
        # stream frames waiting for the request's thread (its client reads slowly):
        # their bytes, and whether they passed MAX_BUFFERED (then the rest are
        # dropped and the request is cancelled)
        self.lock = threading.Lock()
        self.buffered = 0
        self.overflow = False

    def put_piece(self, frame, n):
        """Queue a piece or delta frame of ``n`` bytes (the reader's thread), unless
        the request has more than MAX_BUFFERED waiting already."""
        with self.lock:
            if self.overflow or self.buffered + n > MAX_BUFFERED:
                self.overflow = True
                return
            self.buffered += n
        frame["_n"] = n
        self.queue.put(frame)

    def took(self, frame, cancel):
        """The request's thread took ``frame`` off its queue."""
        with self.lock:
            self.buffered -= frame.get("_n", 0)
            overflow = self.overflow
        if overflow and not cancel.cancelled:
            cancel.cancel("the client read its stream too slowly (%d MiB of it waited)"
                          % (MAX_BUFFERED >> 20))
