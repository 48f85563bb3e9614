"""The lobby: where new connections wait, without a thread, until they speak.

ThreadingHTTPServer gives each accepted connection a thread at once, so
connections that send nothing used to hold every slot of the cap, /health
included, for ``--timeout`` seconds; reopened every 30 s they kept the server
down at no cost.  Here the accepting thread hands each new connection to the
lobby, one thread that polls them all, and a connection gets a handler thread
(and counts against the cap) only once its first byte is in (one whose
first byte is in when it is accepted, the usual case, goes straight on):

    accept -> Lobby.add -- first byte --> Server.admit -- yes --> handler thread
                |                              |
                | silent past first_byte_timeout: 408
                | lobby full: the oldest one is dropped
                |                              no (cap, or the peer's share, reached)
                |                              v
                |                 the head read here, without blocking:
                |                 GET or HEAD /health answered here, anything else 503
                v
             (either way, the answer is followed by a short drain, then close)

So /health answers however many connections are held, and answering it can
hold no thread: the lobby never blocks, and a guest that dawdles is dropped
at its deadline.

Under HTTPS (``tls``) a guest is a plain TCP connection until it has a
handler, whose thread does the handshake (tls.py): its first byte is a
ClientHello.  A silent one is dropped at its deadline without a word (a 408
in plain text would be noise to a TLS client); a refused one has its
handshake done here, without blocking, a step each time its socket is
readable, and its head read and answered through TLS as above.

Threading: only the lobby thread touches a guest's socket (the accepting
thread peeks at a connection before it is one).  ``add`` (the
accepting thread) and ``stop`` hand over under the lock and wake it through a
pipe; the server's policy (``admit``, ``start_handler``, ``reply_when_full``)
is called from the lobby thread.  An exception in one turn is logged and the
next turn runs: a dead lobby would be a server that accepts and never answers.
"""

import collections
import http
import json
import logging
import os
import select
import socket
import ssl
import threading
import time

from . import tls
from .httperrors import RequestTimeout, Unavailable

log = logging.getLogger("offgrid.lobby")

_IN = select.POLLIN | select.POLLPRI


def response_bytes(status, obj, server="offgrid", head_only=False, extra=""):
    """A whole HTTP/1.1 response with a JSON body, ending its connection; ``extra``:
    more header lines, each ending in CRLF."""
    body = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    head = ("HTTP/1.1 %d %s\r\nServer: %s\r\nContent-Type: application/json; charset=utf-8\r\n"
            "Content-Length: %d\r\n%sConnection: close\r\n\r\n"
            % (status, http.HTTPStatus(status).phrase, server, len(body), extra)
            ).encode("latin-1")
    return head if head_only else head + body


def _has_bytes(sock):
    """Whether bytes wait on the socket now (never blocks)."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:         # BlockingIOError: nothing yet; others: the lobby sees them
        return False


class _Guest:
    """One connection in the lobby."""

    __slots__ = ("sock", "addr", "deadline", "head", "refusal", "shaking")

    def __init__(self, sock, addr, deadline):
        self.sock = sock
        self.addr = addr
        self.deadline = deadline
        self.head = None            # bytearray once it is read here (no slot for it)
        self.refusal = None         # why it got no slot: the 503's message
        self.shaking = False        # a refused HTTPS guest whose handshake is under way


class Lobby:
    """New connections until their first byte; refused ones until their answer is out."""

    # Bytes of a refused request's head read in the lobby, to see whether it
    # asks for /health; a /health request is far shorter.
    head_bytes = 2048
    # Seconds a refused connection's answer gets before the close: closing
    # with the client's bytes unread would send a reset that can overtake it.
    linger_seconds = 1.0

    def __init__(self, server, first_byte_timeout, max_waiting, server_name="offgrid",
                 extra_headers="", tls_context=None):
        self.server = server
        self.tls_context = tls_context          # an ssl.SSLContext: the guests speak HTTPS
        self.first_byte_timeout = first_byte_timeout
        self.max_waiting = max_waiting
        self.server_name = server_name
        self.extra_headers = extra_headers      # header lines for every answer (the instance)
        self._lock = threading.Lock()
        self._arrivals = []             # (socket, address) from add(), under _lock
        self._stopping = False          # under _lock
        # fd -> _Guest; the lobby thread's own.  _silent is in arrival order,
        # so its first guest has the nearest deadline; _refused is short.
        self._silent = collections.OrderedDict()
        self._refused = {}              # refused connections: head being read, or lingering
        self._poller = select.poll()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, select.POLLIN)
        self._thread = threading.Thread(target=self._run, name="http-lobby", daemon=True)
        self._thread.start()

    # -- from other threads -------------------------------------------------------
    def add(self, sock, addr):
        """Seat a just-accepted connection (the accepting thread).

        One whose first bytes are in already (a client sends its request
        right after the connect) and that gets a slot goes to its handler at
        once, saving the hop through the lobby's thread; the lobby takes the
        rest.  Looking costs one non-blocking recv: nothing here waits.
        """
        with self._lock:
            if self._stopping:
                _close(sock)
                return
        try:
            if _has_bytes(sock) and self.server.admit(addr) is None:
                self.server.start_handler(sock, addr)
                return
        except Exception:       # the lobby's turn meets it again, and survives it
            log.exception("lobby: seating a connection at once failed; it waits instead")
        with self._lock:
            if self._stopping:
                _close(sock)
                return
            self._arrivals.append((sock, addr))
            if len(self._arrivals) == 1:        # one wake-up per batch
                self._wake()

    def stop(self):
        """Close every connection still here and end the thread (idempotent)."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            self._wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)

    def _wake(self):
        try:
            os.write(self._wake_w, b"\0")
        except OSError:
            pass                    # the pipe is full: a wake-up is pending already

    # -- the thread ---------------------------------------------------------------
    def _run(self):
        try:
            while True:
                with self._lock:
                    if self._stopping:
                        break
                try:
                    self._turn()
                except Exception:
                    log.exception("lobby: a turn failed; serving on")
                    time.sleep(0.05)        # no hot loop if it fails again
        finally:
            with self._lock:
                self._stopping = True       # from here add() closes, and nothing writes the pipe
                arrivals, self._arrivals = self._arrivals, []
            for sock, _ in arrivals:
                _close(sock)
            for guests in (self._silent, self._refused):
                for g in guests.values():
                    _close(g.sock)
                guests.clear()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _turn(self):
        with self._lock:
            arrivals, self._arrivals = self._arrivals, []
        now = time.monotonic()
        for sock, addr in arrivals:
            self._seat(sock, addr, now)
        deadlines = [g.deadline for g in self._refused.values()]
        if self._silent:
            deadlines.append(next(iter(self._silent.values())).deadline)
        wait = None if not deadlines else max(0.0, min(deadlines) - now)
        ready = self._poller.poll(None if wait is None else wait * 1000 + 1)
        for fd, _ in ready:
            if fd == self._wake_r:
                os.read(self._wake_r, 4096)
            elif fd in self._silent:
                self._spoke(fd)
            elif fd in self._refused:
                self._more(fd)
        self._expire(time.monotonic())

    def _seat(self, sock, addr, now):
        if len(self._silent) + len(self._refused) >= self.max_waiting:
            # full: the oldest guest goes, without a word, a silent one first;
            # a real client speaks, and a /health is answered, within
            # milliseconds, so it is rarely the oldest (refusing the newcomer
            # instead would let whoever fills the lobby keep everyone out)
            self._leave(next(iter(self._silent or self._refused)))
        try:
            sock.setblocking(False)
            fd = sock.fileno()
            self._poller.register(fd, _IN)
        except (OSError, ValueError):
            _close(sock)
            return
        self._silent[fd] = _Guest(sock, addr, now + self.first_byte_timeout)

    def _leave(self, fd, close=True):
        g = self._silent.pop(fd, None) or self._refused.pop(fd, None)
        try:
            self._poller.unregister(fd)
        except (KeyError, ValueError):
            pass
        if close and g is not None:
            _close(g.sock)
        return g

    def _spoke(self, fd):
        """A silent guest's socket is readable: its first byte, or its leaving."""
        g = self._silent[fd]
        try:
            first = g.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return
        except OSError:
            first = b""
        if not first:
            self._leave(fd)         # connected, then left without a word
            return
        refusal = self.server.admit(g.addr)
        if refusal is None:
            self._leave(fd, close=False)
            g.sock.setblocking(True)
            self.server.start_handler(g.sock, g.addr)
            return
        # no slot: read its head here, to answer /health or refuse it
        del self._silent[fd]
        g.head, g.refusal = bytearray(), refusal
        g.deadline = time.monotonic() + self.first_byte_timeout
        self._refused[fd] = g
        if self.tls_context is not None:
            try:           # the same descriptor, still non-blocking: the poller keeps it
                g.sock = self.tls_context.wrap_socket(g.sock, server_side=True,
                                                      do_handshake_on_connect=False)
            except (OSError, ValueError):
                self._leave(fd)
                return
            g.shaking = True
        self._more(fd)

    def _more(self, fd):
        """A refused guest sent more: its handshake's next step, its head read, or what
        follows its answer drained."""
        g = self._refused[fd]
        if g.shaking:
            try:
                g.sock.do_handshake()
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return              # more of it to come (a write blocks only past its deadline)
            except (OSError, ValueError):
                self._leave(fd)     # not TLS (plain HTTP, say), or gone
                return
            g.shaking = False
        while True:
            try:
                data = g.sock.recv(1 << 16 if g.head is None
                                   else self.head_bytes - len(g.head))
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return
            except (OSError, ValueError):
                data = b""
            if not data:
                self._leave(fd)
                return
            if g.head is None:
                return              # answered already: draining
            g.head += data
            if b"\r\n\r\n" in g.head or b"\n\n" in g.head:
                status, obj, head_only = self.server.reply_when_full(bytes(g.head),
                                                                     g.refusal)
                self._answer(fd, status, obj, head_only)
                return
            if len(g.head) >= self.head_bytes:
                self._answer(fd, *self.server.error_reply(Unavailable(g.refusal)))
                return
            # TLS: the rest of its head may be decrypted already, where poll() does not
            # see it (tls.py); a plain socket has none such
            if not (tls.is_tls(g.sock) and g.sock.pending()):
                return

    def _answer(self, fd, status, obj, head_only=False):
        """Write the one answer, half-close, and drain for linger_seconds."""
        g = self._refused[fd]
        try:
            g.sock.send(response_bytes(status, obj, self.server_name, head_only,
                                       self.extra_headers))
            tls.close_notify(g.sock)
            g.sock.shutdown(socket.SHUT_WR)     # (TLS: from here the socket reads as plain)
        except (OSError, ValueError):
            self._leave(fd)
            return
        g.head = None
        g.deadline = time.monotonic() + self.linger_seconds

    def _expire(self, now):
        while self._silent:
            fd, g = next(iter(self._silent.items()))
            if g.deadline > now:
                break
            # the 408 a handler would have sent; into an empty socket buffer
            # it cannot block (none in plain text to a TLS client)
            if self.tls_context is None:
                try:
                    g.sock.send(response_bytes(*self.server.error_reply(RequestTimeout(
                        "no request arrived within %g seconds" % self.first_byte_timeout)),
                        server=self.server_name, extra=self.extra_headers))
                except OSError:
                    pass
            self._leave(fd)
        for fd, g in list(self._refused.items()):
            if g.deadline <= now:
                if g.head is not None and not g.shaking:    # its head never came whole
                    self._answer(fd, *self.server.error_reply(Unavailable(g.refusal)))
                    continue
                self._leave(fd)


def _close(sock):
    try:
        sock.close()
    except OSError:
        pass
