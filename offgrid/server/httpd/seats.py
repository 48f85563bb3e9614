"""Seats: the connections that hold a handler thread, and which of them may be dropped.

``Server`` (http.py) holds at most ``max_connections`` connections with a
thread, and at most ``peer_share`` of them for one peer.  Those limits used
to refuse the newcomer once reached, and so a few addresses that each opened
their share and sent a header byte a second (300 connections each from
127.0.0.2 and 127.0.0.3) locked every other client out with 503s for as long
as they liked.

A connection that has not sent a complete request head is waiting: between
requests of a kept-alive connection, or while its request line and headers
come in.  When a newcomer finds the server full (or its own peer's share
full), the connection that has waited longest for its head is dropped to
make room, instead of the newcomer being refused: one that sends its whole
request at once (every real client) is never the one waiting longest, and
one that trickles can hold a seat only until the next newcomer needs it.  A
connection being answered is never dropped.  A newcomer is refused only
when nothing is waiting, or every waiting connection started its wait less
than ``min_wait`` seconds ago (a flood of brand-new connections, which the
lobby already bounds).

Threading: every method takes the one lock; ``drop`` shuts the victim's
socket down (never blocks), and the victim's handler thread, whose read
returns at once, ends the connection as it would a client's hang-up; until
it has, its seat counts as free (``_dropping``), so the newcomer is seated
at once and the overshoot is bounded by the drops under way.
"""

import collections
import threading
import time

from . import tls


class Seats:
    """How many connections hold a thread, per peer, and which wait for a request head."""

    # Seconds a connection must have waited for its head before it may be
    # dropped for a newcomer: a real client's head arrives within
    # milliseconds of its first byte.
    min_wait = 0.5

    def __init__(self):
        self._lock = threading.Lock()
        self.n = 0
        self._per_peer = collections.Counter()
        self._waiting = {}          # socket -> (since, peer): no complete request head yet
        self._dropping = {}         # socket -> peer: shut down, its handler not ended yet
        self.dropped = 0            # connections dropped for a newcomer (for tests and logs)

    def admit(self, peer, max_connections, peer_share, now=None):
        """Seat a connection of ``peer`` within ``max_connections``, ``peer_share`` of them
        for one peer: None, or why not (the lobby's 503 message)."""
        now = time.monotonic() if now is None else now
        per_peer_max = max(1, int(max_connections * peer_share))
        with self._lock:
            dropping_of_peer = sum(1 for p in self._dropping.values() if p == peer)
            full = self.n - len(self._dropping) >= max_connections
            peer_full = self._per_peer[peer] - dropping_of_peer >= per_peer_max
            # a peer at its share makes room among its own connections (which
            # frees a seat of the whole too); otherwise anyone's may go
            if (full or peer_full) and not self._drop_oldest(now, peer if peer_full else None):
                return "too many connections" if full else "too many connections from this address"
            self.n += 1
            self._per_peer[peer] += 1
        return None

    def waiting(self, sock, peer):
        """A seated connection now waits for a request head (from its handler's thread)."""
        with self._lock:
            if sock not in self._dropping:
                self._waiting[sock] = (time.monotonic(), peer)

    def serving(self, sock):
        """Its request head is in: it is being answered, and is never dropped."""
        with self._lock:
            self._waiting.pop(sock, None)

    def ended(self, sock, peer):
        """The connection is over (its handler's thread is done with it)."""
        with self._lock:
            self._waiting.pop(sock, None)
            self._dropping.pop(sock, None)
            self.n -= 1
            self._per_peer[peer] -= 1
            if self._per_peer[peer] <= 0:
                del self._per_peer[peer]

    def _drop_oldest(self, now, peer):
        """Drop the connection (of ``peer``, or anyone's) that has waited longest for its
        request head, if it has waited min_wait; whether one was dropped.  Under the lock."""
        victim, oldest = None, now - self.min_wait
        for sock, (since, p) in self._waiting.items():
            if since <= oldest and (peer is None or p == peer):
                victim, oldest = sock, since
        if victim is None:
            return False
        _, victim_peer = self._waiting.pop(victim)
        self._dropping[victim] = victim_peer
        self.dropped += 1
        try:
            # its handler's read returns at once, and it ends the connection (the TCP
            # connection's shutdown: under TLS the handler's thread owns the TLS state)
            tls.raw_shutdown(victim)
        except OSError:
            pass
        return True
