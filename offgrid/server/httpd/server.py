"""The listening side: connections, their limits, several addresses, HTTPS, and shutdown's
drain.

``make_server`` builds a Server whose Handler class carries the settings of
the command line and the application it serves (``app``: the route table,
the dispatch and the one error exit, from ``server/api/routes.py``).  With an
ssl.SSLContext (``tls``) every connection speaks HTTPS, and only that: its
handshake is done on its own thread, before its handler starts (tls.py).
"""

import errno
import hashlib
import ipaddress
import logging
import os
import selectors
import socket
import threading
import time
from http.server import ThreadingHTTPServer

from ...jobs import Threads
from . import tls as tls_layer
from .handler import INSTANCE_HEADER, Handler
from .httperrors import Unavailable
from .frontmem import FrontMemory
from .lobby import Lobby
from .seats import Seats

log = logging.getLogger("offgrid.http")


class _HealthProbe:
    """What the app's /health handler needs of a handler, for the lobby to answer it."""

    def __init__(self, service):
        self.service = service
        self.reply = None

    def send_json(self, status, obj, headers=None):
        self.reply = (status, obj)


class Server(ThreadingHTTPServer):
    """ThreadingHTTPServer with our settings, a connection cap and a drain for shutdown.

    A new connection waits in the ``lobby`` (one thread for all of them)
    until its first byte arrives; only then does it get a handler thread and
    count against the cap.  What a connection may hold, and why:

    * connections that have spoken: ``max_connections`` threads in all, and
      at most ``peer_share`` of them for one peer, beyond which the one that
      has waited longest for a request head is dropped to seat the newcomer
      (``seats.py``: trickling bytes holds a seat only until it is needed),
      and only if none is waiting the lobby answers 503 "too many connections";
    * connections that have not: a place in the lobby (``max_waiting``, the
      oldest dropped when it is full) for ``first_byte_timeout`` seconds, 408
      after;
    * /health: answered by the lobby when there is no slot, so a full server
      still says so to its monitor.
    """
    # Handler threads must not keep the process alive past shutdown: the
    # shutdown sequence itself waits for the requests that matter (drain).
    daemon_threads = True
    # Restarting the server right after a stop must not fail on TIME_WAIT.
    allow_reuse_address = True
    # The listen backlog: connections the kernel completes before accept().
    # A burst past it has its SYNs dropped, and those clients wait a second
    # for the retransmit (seen: /health timing out while 600 connections
    # opened at once against 128, ListenOverflows rising).  Linux caps it at
    # net.core.somaxconn (4096 by default since 5.4).
    request_queue_size = 1024
    # Connections with a handler thread at once; one more gets 503 and is
    # closed, so a flood of clients cannot run the process out of threads.
    max_connections = 512
    # The fraction of max_connections one peer may hold (an IPv4 address, an
    # IPv6 /64: what one host controls).  Half: one misbehaving client or host
    # leaves at least the other half to everyone else.  Every local program is
    # the one peer 127.0.0.1, so together they get 256 connections, far more
    # than editors open (a few each, --parallel sessions serve them anyway).
    peer_share = 0.5
    # Seconds a new connection may stay silent.  Real clients send their
    # request at once; this only bounds how long a silent one holds a socket
    # (never a thread: it waits in the lobby).  --timeout, if shorter, wins.
    first_byte_timeout = 3.0
    # Silent connections held at once (one file descriptor each); past it the
    # oldest is dropped, so a flood of them cannot keep real clients out.
    max_waiting = 1024

    def __init__(self, *args, tls=None, reuse_port=False, **kwargs):
        # an ssl.SSLContext (--ssl-key-file, --ssl-cert-file): HTTPS only; None: HTTP
        self.tls = tls
        # --reuse-port: other processes may listen on the port too (SO_REUSEPORT)
        self.reuse_port = reuse_port
        self._cond = threading.Condition()
        # connections with a thread, per peer, and which wait for a request head
        self.seats = Seats()
        self._n_requests = 0            # requests between _dispatch's start and end
        self._handlers = Threads("http-connection")
        self.closing = False
        # serve_forever's wake-up: shutdown() writes a byte into the pipe
        self._wake = os.pipe()
        self._stop_asked = False
        self._stopped = threading.Event()
        super().__init__(*args, **kwargs)
        name = self.RequestHandlerClass.instance_name
        self.lobby = Lobby(self, min(self.first_byte_timeout, self.RequestHandlerClass.timeout),
                           self.max_waiting, Handler.server_version,
                           "%s: %s\r\n" % (INSTANCE_HEADER, name) if name else "", tls)

    def server_bind(self):
        if self.reuse_port:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()

    # -- the accept loop ----------------------------------------------------------
    def serve_forever(self, poll_interval=None):
        """socketserver's loop, but shutdown() wakes it at once through a pipe
        beside the listening socket, where socketserver's looks for the stop
        only at each poll: every stop of a server waited up to the poll
        interval (0.2 s) before it could drain and exit."""
        self._stopped.clear()
        try:
            with selectors.PollSelector() as selector:
                selector.register(self, selectors.EVENT_READ)
                selector.register(self._wake[0], selectors.EVENT_READ)
                while not self._stop_asked:
                    ready = selector.select(poll_interval)
                    if self._stop_asked:
                        break
                    for key, _ in ready:
                        if key.fileobj is self:
                            self._handle_request_noblock()
                        else:
                            os.read(self._wake[0], 512)
                    self.service_actions()
        finally:
            self._stop_asked = False
            self._stopped.set()

    def shutdown(self):
        """Stop serve_forever (running on another thread) and wait until it has."""
        self._stop_asked = True
        if not self._wake:
            return              # closed by server_close: the loop is gone too
        os.write(self._wake[1], b"x")
        self._stopped.wait()

    # -- connections ----------------------------------------------------------------
    def get_request(self):
        try:
            return super().get_request()
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                # out of descriptors: the listening socket stays readable, and
                # serve_forever would retry accept() in a hot loop
                time.sleep(0.05)
            raise

    def process_request(self, request, client_address):
        self.lobby.add(request, client_address)

    def admit(self, client_address):
        """Give a connection that spoke a slot: None, or why not (the lobby's 503 message)."""
        # full: the connection waiting longest for its request head makes room (seats.py)
        return self.seats.admit(_peer(client_address), self.max_connections, self.peer_share)

    def head_waiting(self, sock, client_address):
        """A connection waits for a request head (its handler, as each request begins):
        it may be dropped for a newcomer until the head is in (head_done)."""
        self.seats.waiting(sock, _peer(client_address))

    def head_done(self, sock):
        self.seats.serving(sock)

    def start_handler(self, request, client_address):
        """A handler thread for an admitted connection (the lobby's thread calls this).

        Threads are kept for the next connection (offgrid/jobs.py): a new
        one per connection cost each request 0.15 ms.
        """
        try:
            self._handlers.submit(self.process_request_thread, request, client_address)
        except BaseException:
            log.exception("could not start a thread for a connection")
            self.seats.ended(request, _peer(client_address))
            self.shutdown_request(request)

    def process_request_thread(self, request, client_address):
        try:
            if self.tls is not None:
                request, ready = self._handshake(request, client_address)
                if not ready:
                    return
            super().process_request_thread(request, client_address)
        finally:
            self.seats.ended(request, _peer(client_address))

    def _handshake(self, sock, client_address):
        """The connection's TLS handshake, within the read timeout (tls.py): (its
        SSLSocket, True), or (the socket, closed, False) where it failed: a client that
        speaks plain HTTP, stalls or leaves has its connection closed, as llama-server's
        does.  Meanwhile it waits for its request head, as one whose head trickles: it
        may be dropped for a newcomer (seats.py)."""
        try:
            tls_sock = tls_layer.wrap(self.tls, sock)
        except OSError as e:
            log.info("TLS with %s failed: %s", client_address[0], e)
            sock.close()
            return sock, False
        self.seats.waiting(tls_sock, _peer(client_address))
        try:
            tls_layer.handshake(tls_sock, self.RequestHandlerClass.read_timeout)
        except OSError as e:
            log.info("TLS handshake with %s failed: %s", client_address[0], e)
            tls_sock.close()
            return tls_sock, False
        return tls_sock, True

    def shutdown_request(self, request):
        tls_layer.close_notify(request)         # HTTPS: TLS's goodbye first
        super().shutdown_request(request)

    def reply_when_full(self, head, refusal):
        """(status, body, head_only) for a request that got no slot: /health, or 503."""
        line = head.split(b"\n", 1)[0].split()
        path = (self.RequestHandlerClass.route_path(line[1].decode("latin-1"))
                if len(line) == 3 else None)
        if len(line) == 3 and line[0] in (b"GET", b"HEAD") and path is not None \
                and path.split("?", 1)[0] in ("/health", "/v1/health"):
            probe = _HealthProbe(self.RequestHandlerClass.service)
            try:
                self.RequestHandlerClass.app.route("/health").handler(probe, None)
            except Exception:
                log.exception("/health failed in the lobby")
            if probe.reply is not None:
                return probe.reply + (line[0] == b"HEAD",)
        path = line[1].split(b"?", 1)[0].decode("latin-1") if len(line) >= 2 else ""
        return self.error_reply(Unavailable(refusal), path) + (False,)

    def error_reply(self, err, path=""):
        """(status, body) of an HTTPError the lobby answers itself, through the app's one
        error exit (the path's dialect, when the head was read)."""
        err, body, _ = self.RequestHandlerClass.app.error_response(err, "- " + path, None)
        return err.status, body

    def stop_accepting(self):
        """Close the listening socket, once ``shutdown`` has stopped accept()ing.

        Left open, it would let the kernel complete new connections that no
        one accepts: a balancer's health check or a request sent during the
        drain would wait there until the process exits, and a balancer
        answers that with a 502 after its timeout.  Closed, a new connection
        is refused at once, which a balancer retries on another replica
        (HAProxy's ``retry-on conn-failure``, nginx's ``proxy_next_upstream
        error``) and takes as this one going down.  The connections the
        kernel has queued already are accepted first and answered as any
        (503 once the service is shutting down), not reset.
        """
        self.socket.setblocking(False)
        while True:
            try:
                request, client_address = self.socket.accept()
            except OSError:         # none left (EAGAIN), or the socket is gone
                break
            request.setblocking(True)
            self.process_request(request, client_address)
        self.socket.close()

    def server_close(self):
        lobby = getattr(self, "lobby", None)     # absent when binding failed in __init__
        if lobby is not None:
            lobby.stop()
        super().server_close()
        # (TCPServer.__init__ calls this itself when it cannot bind)
        fds, self._wake = getattr(self, "_wake", ()), ()
        for fd in fds:
            os.close(fd)

    # -- requests -------------------------------------------------------------------
    def requests_in_flight(self):
        """Requests between begin_request and end_request now (this one included)."""
        return self._n_requests

    def begin_request(self):
        """Count a request in; False once the server is draining."""
        with self._cond:
            if self.closing:
                return False
            self._n_requests += 1
            return True

    def end_request(self):
        with self._cond:
            self._n_requests -= 1
            self._cond.notify_all()

    def drain(self, timeout):
        """Refuse new requests, wait for those being answered; True if they all were."""
        with self._cond:
            self.closing = True
            return self._cond.wait_for(lambda: self._n_requests == 0, timeout)


def _peer(client_address):
    """Who a connection is from, for the per-peer share: the IPv4 address or IPv6 /64."""
    host = client_address[0] if isinstance(client_address, tuple) else ""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if ip.version == 6:
        if ip.ipv4_mapped is not None:     # an IPv4 client of a dual-stack socket
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network("%s/64" % ip, strict=False))
    return str(ip)


def _raise_fd_limit(need):
    """Raise the soft descriptor limit towards ``need`` (each connection holds one)."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = need if hard == resource.RLIM_INFINITY else min(need, hard)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass        # not POSIX, or not allowed: the limits below still bound threads


class Servers:
    """Several listening addresses served as one Server (llama-server's ``--host A,B``).

    Each address is a Server of its own (its lobby, its connection limits),
    all with the one Handler class, so the service set on it reaches them all.
    """

    def __init__(self, servers):
        self.servers = servers
        self.RequestHandlerClass = servers[0].RequestHandlerClass
        self.server_address = servers[0].server_address

    def serve_forever(self, poll_interval=None):
        for other in self.servers[1:]:
            threading.Thread(target=other.serve_forever, kwargs={"poll_interval": poll_interval},
                             name="http-%s" % other.server_address[0], daemon=True).start()
        self.servers[0].serve_forever(poll_interval)

    def shutdown(self):
        for server in self.servers:
            server.shutdown()

    def stop_accepting(self):
        for server in self.servers:
            server.stop_accepting()

    def drain(self, timeout):
        deadline = time.monotonic() + timeout
        return all([server.drain(max(0.0, deadline - time.monotonic()))
                    for server in self.servers])

    def server_close(self):
        for server in self.servers:
            server.server_close()


def make_server(host, port, app, service=None, api_keys=(), cors_origins=(), max_body=None,
                verbose=False, timeout=None, read_timeout=None, front_max_rss=None,
                instance_name=None, tls=None, api_prefix=None, reuse_port=False):
    """A Server bound to host:port serving ``app``, whose Handler class carries these
    settings.

    ``host`` may be a comma list of addresses: a Servers, every address on
    the same port (port 0: the one the first address got).  ``tls``: an
    ssl.SSLContext with the server's certificate and key, for HTTPS on every
    address; ``api_prefix``: the path every route is served under
    (``Handler.api_prefix``); ``reuse_port``: SO_REUSEPORT on every listening socket.
    """
    attrs = {"app": app, "service": service, "cors_origins": tuple(cors_origins), "verbose": verbose,
             "api_keys": tuple(hashlib.sha256(k.encode("utf-8")).digest() for k in api_keys)}
    if max_body is not None:
        attrs["max_body"] = max_body
    if timeout is not None:
        attrs["timeout"] = timeout
    if read_timeout is not None:
        attrs["read_timeout"] = read_timeout
    if front_max_rss:
        attrs["front_memory"] = FrontMemory(front_max_rss)
    if instance_name:
        attrs["instance_name"] = instance_name
    if api_prefix:
        attrs["api_prefix"] = api_prefix
    handler = type("OffgridHandler", (Handler,), attrs)
    # descriptors for the cap, the lobby, and the models, pipes and logs beside them
    _raise_fd_limit(Server.max_connections + Server.max_waiting + 256)
    hosts = [h.strip() for h in host.split(",") if h.strip()] or [host]
    servers = []
    try:
        for one in hosts:
            server_class = Server
            if ":" in one:
                server_class = type("Server6", (Server,), {"address_family": socket.AF_INET6})
            servers.append(server_class((one.strip("[]"), port), handler, tls=tls,
                                        reuse_port=reuse_port))
            port = servers[0].server_address[1]
    except OSError:
        for server in servers:
            server.server_close()
        raise
    return servers[0] if len(servers) == 1 else Servers(servers)
