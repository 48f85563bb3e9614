"""The HTTP adapter: routing, bodies, auth, JSON, SSE and NDJSON on http.server.

Threading model: each connection gets a thread once it has sent its first
byte (until then it waits in ``lobby``, which has one thread for all of
them); threads are kept for later connections (``offgrid/jobs.py``); a
connection is kept alive between requests (HTTP/1.1).  Generation requests
block their thread inside ``Service.generate`` while they wait for and use a
session; streams write each piece as one chunk of a chunked response.

Errors: handlers raise ``HTTPError`` (or let engine errors through);
``_dispatch`` turns every exception into one JSON error response via
``errors.to_http_error``, its body in the shape of the route's dialect
(``errors.error_body``: OpenAI's object, Ollama's string, Anthropic's
envelope).  Nothing else writes error bodies.

Limits, so that no client can hold a thread or memory for long (the knobs are
Handler's class attributes, set by make_server from the command line; the
reading itself is ``reader``'s):

* idle: a kept-alive connection waits ``timeout`` seconds for its next
  request, then closes;
* read: once a request's first byte arrives, its line, headers and body must
  all arrive within ``read_timeout`` seconds (408), however slowly they drip;
* size: the request line 64 KiB (414), headers ``max_header_bytes`` (431),
  the body ``max_body`` (413, answered before the body is read);
* write: a client that stops reading a response for ``timeout`` seconds is
  treated as gone, which cancels its request;
* framing: a request whose end is in doubt (Content-Length with
  Transfer-Encoding, folded or malformed header lines, ...) gets 400 and its
  connection closes, so nothing after it is read as a request (``reader``);
* connections: a new one waits without a thread in the ``lobby`` until it
  speaks (``Server.first_byte_timeout``, 408 after); then at most
  ``Server.max_connections`` at once, ``Server.peer_share`` of them for one
  peer (503 beyond), with /health answered by the lobby when none is free.

A request answered without reading its body (413, 401, 404 ...) closes its
connection after a short, bounded drain ("lingering close"), so the client
reads the answer rather than a connection reset.

Shutdown: ``Server.drain`` refuses new requests and waits for those being
answered, so the models are freed only once no handler can touch them.
"""

import collections
import errno
import hashlib
import hmac
import ipaddress
import json
import logging
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from .. import __version__
from ..errors import OffgridError
from ..jobs import Threads
from . import burst, endpoints, reader
from .lobby import Lobby
from .errors import (HTTPError, MethodNotAllowed, NotFound, Unauthorized, Unavailable,
                     error_body, error_event, to_http_error)

log = logging.getLogger("offgrid.http")

# An HTTP token (RFC 9110): what a header name in Access-Control-Request-Headers may be.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def dumps(obj):
    """JSON bytes; lone surrogates become U+FFFD rather than an error."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")


# -- responses -------------------------------------------------------------------------

class _ChunkedStream:
    """A streamed 200 response, written as HTTP/1.1 chunks, one message per chunk.

    Headers go out with the first message, so a request refused before its
    first piece still gets its real status.  ``send`` returns False once the
    client is gone, which the generation loop takes as a cancel.  An HTTP/1.0
    client gets the messages unchunked, ended by closing the connection.
    """
    content_type = "application/octet-stream"

    def __init__(self, handler):
        self.handler = handler
        self.started = False
        self.broken = False
        self.chunked = handler.request_version != "HTTP/1.0"
        # several choices of one request may stream at once (Service.run_choices)
        self._lock = threading.Lock()

    def start(self):
        h = self.handler
        h.send_response(200)
        h.send_header("Content-Type", self.content_type)
        h.send_header("Cache-Control", "no-cache")
        if self.chunked:
            h.send_header("Transfer-Encoding", "chunked")
        else:
            h.close_connection = True
            h.send_header("Connection", "close")
        h.send_cors_headers()
        h.end_headers()
        self.started = True

    def frame(self, obj, event=None):
        """One message's bytes on the wire."""
        raise NotImplementedError

    def send(self, obj, event=None):
        data = self.frame(obj, event)
        if self.chunked:
            data = b"%x\r\n%s\r\n" % (len(data), data)
        return self._write(data)

    def end(self):
        if self.chunked:
            self._write(b"0\r\n\r\n")

    def _write(self, data):
        if self.broken:
            return False
        return burst.write(self._write_now, data)     # held while a burst is handed on

    def _write_now(self, data):
        with self._lock:
            if self.broken:
                return False
            try:
                if not self.started:
                    self.start()
                self.handler.wfile.write(data)
                return True
            except OSError:             # gone, or stopped reading for `timeout` seconds
                self.broken = True
                self.handler.close_connection = True
                return False


class EventStream(_ChunkedStream):
    """A ``text/event-stream`` response (llama-server's and OpenAI's streams)."""
    content_type = "text/event-stream"

    def frame(self, obj, event=None):
        data = b"data: " + (obj if isinstance(obj, bytes) else dumps(obj)) + b"\n\n"
        if event is not None:       # Anthropic's clients read named events only
            data = b"event: " + event.encode("ascii") + b"\n" + data
        return data


class NDJSONStream(_ChunkedStream):
    """An ``application/x-ndjson`` response: one JSON object a line (Ollama's streams)."""
    content_type = "application/x-ndjson"

    def frame(self, obj, event=None):
        return dumps(obj) + b"\n"


class Handler(BaseHTTPRequestHandler):
    """One HTTP connection.  Settings are class attributes, set by make_server."""

    # HTTP/1.1: keep-alive by default, so an editor reuses one connection.
    protocol_version = "HTTP/1.1"
    server_version = "offgrid/" + __version__
    # The Server header names offgrid, not the Python under it.
    sys_version = ""
    # Streams write small chunks; Nagle's algorithm would hold each back.
    disable_nagle_algorithm = True
    # Seconds a kept-alive connection waits for its next request, and a
    # response waits for a client that stopped reading.
    timeout = 30
    # Seconds a request's line, headers and body may take to arrive, in all.
    read_timeout = 30
    # Bytes of headers accepted (the request line has http.server's 64 KiB).
    max_header_bytes = 64 * 1024
    # Largest request body accepted (bytes); larger ones get 413 unread.
    max_body = 8 * 1024 * 1024
    # After answering without reading a body: how long, and how much, to
    # drain before closing, so the client reads the answer, not a reset.
    linger_seconds = 2.0
    linger_bytes = 1 << 20
    # SHA-256 digests of the API keys (empty: no auth); compared in constant time.
    api_keys = ()
    # Origins allowed to make cross-origin requests (empty: CORS off).
    cors_origins = ()
    verbose = False
    # The Service, or None while the models load.
    service = None

    # -- connection ---------------------------------------------------------------
    def setup(self):
        super().setup()
        self.rfile.close()
        self.rfile = reader.RequestReader(self.connection)
        self._n_served = 0
        self._body_pending = False

    def handle_one_request(self):
        self._stream = None
        self._body_pending = False
        # what send_error needs if the request line never arrives whole
        self.command, self.path, self.request_version = "", "", "HTTP/1.1"
        try:
            if not self._wait_for_request():
                self.close_connection = True
                return
            self.rfile.phase(self.read_timeout)
            super().handle_one_request()
        except reader.ReadTimeout:
            self.send_error(408, "the request did not arrive within %g seconds"
                            % self.read_timeout)
        except reader.HeadersTooLarge:
            self.send_error(431, "the request headers exceed %d bytes" % self.max_header_bytes)
        except reader.BadHeaders as exc:
            self._body_pending = True       # whatever follows is not a request: drain, close
            self.send_error(400, str(exc))
        except OSError:
            self.close_connection = True
        finally:
            self._n_served += 1
            self.rfile.head_left = None
            if self._body_pending:
                self.close_connection = True

    def _wait_for_request(self):
        """Wait up to ``timeout`` for a request's first byte; False to close the connection."""
        self.rfile.phase(self.timeout)
        try:
            return bool(self.rfile.peek(1))
        except reader.ReadTimeout:
            if self._n_served == 0:
                # a new connection that never spoke; a kept-alive one just closes
                self.send_error(408, "no request arrived within %g seconds" % self.timeout)
            return False

    def finish(self):
        super().finish()
        if self._body_pending or reader.unread_bytes(self.connection):
            reader.linger(self.connection, self.linger_seconds, self.linger_bytes)

    def parse_request(self):
        """http.server's parse_request (CPython 3.13's checks), the headers read
        by reader.read_headers rather than the email parser: keep in step."""
        self.command = None
        self.request_version = version = self.default_request_version
        self.close_connection = True
        self.requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        words = self.requestline.split()
        if not words:
            return False
        if len(words) >= 3:
            version = words[-1]
            try:
                if not version.startswith("HTTP/"):
                    raise ValueError
                number = version.split("/", 1)[1].split(".")
                if (len(number) != 2 or not all(n.isdigit() for n in number)
                        or any(len(n) > 10 for n in number)):
                    raise ValueError
                number = int(number[0]), int(number[1])
            except (ValueError, IndexError):
                self.send_error(400, "Bad request version (%r)" % version)
                return False
            if number >= (1, 1) and self.protocol_version >= "HTTP/1.1":
                self.close_connection = False
            if number >= (2, 0):
                self.send_error(505, "Invalid HTTP version (%s)" % version.split("/", 1)[1])
                return False
            self.request_version = version
        if not 2 <= len(words) <= 3:
            self.send_error(400, "Bad request syntax (%r)" % self.requestline)
            return False
        command, path = words[:2]
        if len(words) == 2:
            self.close_connection = True
            if command != "GET":
                self.send_error(400, "Bad HTTP/0.9 request type (%r)" % command)
                return False
        self.command, self.path = command, path
        if self.path.startswith("//"):
            self.path = "/" + self.path.lstrip("/")     # gh-87389: no open redirects
        self.rfile.head_left = self.max_header_bytes     # the line is in; the headers follow
        try:
            self.headers = reader.read_headers(self.rfile)
        except reader.LineTooLong as err:
            self.send_error(431, "Line too long", str(err))
            return False
        except reader.TooManyHeaders as err:
            self.send_error(431, "Too many headers", str(err))
            return False
        finally:
            self.rfile.head_left = None
        conntype = self.headers.get("Connection", "").lower()
        if conntype == "close":
            self.close_connection = True
        elif conntype == "keep-alive" and self.protocol_version >= "HTTP/1.1":
            self.close_connection = False
        if (self.headers.get("Expect", "").lower() == "100-continue"
                and self.protocol_version >= "HTTP/1.1" and self.request_version >= "HTTP/1.1"):
            if not self.handle_expect_100():
                return False
        return True

    # -- methods ----------------------------------------------------------------
    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_OPTIONS(self):
        self._dispatch("OPTIONS")

    def _other_method(self):
        self._dispatch(self.command)

    def __getattr__(self, name):
        # any other method (PUT, TRACE, PROPFIND, ...) meets the route table too: 404 or 405
        if name.startswith("do_"):
            return self._other_method
        raise AttributeError(name)

    # -- dispatch -----------------------------------------------------------------
    def _dispatch(self, method):
        self.rfile.head_left = None
        if not self._check_framing():
            return
        if not self.server.begin_request():
            self.close_connection = True
            self._send_exception(Unavailable("server is shutting down"))
            return
        try:
            route = self._route(method)
            if method == "OPTIONS":
                return self._preflight(route)
            if route.auth:
                self._check_origin()
                self._check_auth()
            body = self._read_json() if method == "POST" else None
            if route.needs_service and self.service is None:
                raise Unavailable("Loading model")
            if route.needs_service:
                # the models this request uses are held until it is answered (shelf.py)
                with self.service.request_scope(body):
                    route.handler(self, body)
            else:
                route.handler(self, body)
        except Exception as exc:           # the one exit for errors
            self._send_exception(exc)
        finally:
            self.server.end_request()

    def _check_framing(self):
        """Note whether a body follows; False after answering 400 to doubtful framing.

        Where the body ends is in doubt, so is where a next request would
        start: the connection closes after the answer (RFC 9112 §6.3).
        """
        try:
            n = reader.framing(self.headers, self.request_version)
        except HTTPError as exc:
            self._body_pending = True       # unread bytes of unknown extent: drain, close
            self.close_connection = True
            self._send_exception(exc)
            return False
        self._body_pending = n not in (None, 0)
        return True

    def _route(self, method):
        """The route for this request; NotFound or MethodNotAllowed (OPTIONS: route or None)."""
        path = self.path.split("?", 1)[0]
        route = endpoints.route_of(path)
        if method == "OPTIONS":
            return route
        if route is None:
            raise NotFound("File Not Found: %s" % path[:200])
        allowed = route.methods + (("HEAD",) if "GET" in route.methods else ())
        if method not in allowed:
            raise MethodNotAllowed("%s is not allowed on %s" % (method[:32], path),
                                   headers={"Allow": ", ".join(allowed)})
        return route

    def _send_exception(self, exc):
        err = to_http_error(exc)
        if err.status >= 500 and not isinstance(exc, (HTTPError, OffgridError)):
            log.exception("internal error on %s %s", self.command, self.path.split("?", 1)[0])
        if self.service is not None and err.status >= 500:
            self.service.metrics.error()
        if self._body_pending:
            self.close_connection = True    # the unread body must not be read as a request
        dialect = endpoints.dialect_of(self.path.split("?", 1)[0])
        body = error_body(err, dialect)
        stream = getattr(self, "_stream", None)
        if stream is not None and stream.started:
            # headers are gone: the error becomes the stream's last event (or line)
            stream.send(body, error_event(dialect))
            stream.end()
            return
        self.send_json(err.status, body, err.headers)

    # -- who may ask -------------------------------------------------------------
    def _check_auth(self):
        if not self.api_keys:
            return
        given = self.headers.get("x-api-key") or ""
        auth = self.headers.get("Authorization") or ""
        if auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        # digests have one length, so the comparison time says nothing about the key
        digest = hashlib.sha256(given.encode("latin-1", "replace")).digest()
        ok = False
        for key in self.api_keys:     # no early exit: time does not tell which key
            ok |= hmac.compare_digest(digest, key)
        if not ok:
            raise Unauthorized("Invalid API Key", headers={"WWW-Authenticate": "Bearer"})

    def _origin_allowed(self, origin):
        if origin in self.cors_origins:
            return True
        # llama-server's keyword "localhost": a page on this machine, on any port
        if "localhost" in self.cors_origins:
            try:
                return urlsplit(origin).hostname in ("localhost", "127.0.0.1", "::1")
            except ValueError:
                return False
        return False

    def _check_origin(self):
        """Refuse a web page on another origin, even where CORS would hide the answer.

        A browser sends ``Origin`` with every cross-origin request; without
        this check any page could make it POST to a local server (a "simple"
        request needs no preflight) and spend its CPU.
        """
        origin = self.headers.get("Origin")
        if origin is None or self._origin_allowed(origin):
            return
        try:
            netloc = urlsplit(origin).netloc.lower()
        except ValueError:      # not a URL at all (e.g. "http://[::1")
            netloc = None
        if netloc == (self.headers.get("Host") or "").lower():
            return      # same origin: a page the server itself would have served
        raise HTTPError("requests from the web origin %r are not allowed; start offgrid with "
                        "--cors-origin to allow it" % origin[:200], status=403,
                        type="permission_error")

    # -- request bodies ----------------------------------------------------------
    def _read_json(self):
        try:
            data = reader.read_body(self.rfile, self.headers, self.max_body, self.read_timeout,
                                    self.request_version)
            self._body_pending = False
            return reader.parse_json_object(data)
        except HTTPError:
            # a body that is not what it claimed (a Content-Length that lies, no
            # length at all) leaves the connection out of step: end it
            self.close_connection = True
            raise

    def handle_expect_100(self):
        """Say "100 Continue" only to a body that will be read: right path, key and size."""
        self.rfile.head_left = None
        if not self._check_framing():
            return False
        try:
            route = self._route(self.command)
            if route is not None and route.auth:
                self._check_origin()
                self._check_auth()
            if self.command == "POST":
                reader.body_length(self.headers, self.max_body, self.request_version)
        except HTTPError as exc:
            self._send_exception(exc)
            return False
        return super().handle_expect_100()

    # -- responses --------------------------------------------------------------
    def send_response(self, code, message=None):
        # reading is over: no read deadline, and a stalled write gets the idle limit
        self.rfile.phase(None)
        self.connection.settimeout(self.timeout)
        super().send_response(code, message)

    def send_json(self, status, obj, headers=None):
        self._send_body(status, dumps(obj), "application/json; charset=utf-8", headers)

    def send_raw_json(self, status, body):
        """A body that is JSON already (bytes), as a worker wrote it."""
        self._send_body(status, body, "application/json; charset=utf-8")

    def send_text(self, status, text, content_type="text/plain; version=0.0.4", headers=None):
        self._send_body(status, text.encode("utf-8"), content_type, headers)

    def _send_body(self, status, body, content_type, headers=None):
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_cors_headers()
            if self.close_connection:
                self.send_header("Connection", "close")
            if self.request_version == "HTTP/0.9":      # no head at all: GET only
                self.wfile.write(body)
                return
            # the head and the body in one write: two would wake the client
            # twice, once for the head, again for the body
            self._headers_buffer.append(b"\r\n")
            if self.command != "HEAD":
                self._headers_buffer.append(body)
            self.flush_headers()
        except OSError:
            self.close_connection = True

    def event_stream(self):
        self._stream = EventStream(self)
        return self._stream

    def ndjson_stream(self):
        self._stream = NDJSONStream(self)
        return self._stream

    def send_cors_headers(self):
        headers = getattr(self, "headers", None)     # absent if the request never parsed
        origin = headers.get("Origin") if headers is not None else None
        if origin and self._origin_allowed(origin):
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")

    def _preflight(self, route):
        origin = self.headers.get("Origin")
        if not origin or not self._origin_allowed(origin):
            raise HTTPError("CORS preflight refused: the origin is not allowed", status=403,
                            type="permission_error")
        if route is None:
            raise NotFound("File Not Found: %s" % self.path.split("?", 1)[0][:200])
        asked = self.headers.get("Access-Control-Request-Headers") or ""
        names = [n.strip() for n in asked.split(",") if _TOKEN.fullmatch(n.strip())]
        # 200 with no body, as llama-server answers (204 would do as well for browsers)
        self.send_response(200)
        self.send_cors_headers()
        self.send_header("Access-Control-Allow-Methods", ", ".join(route.methods + ("OPTIONS",)))
        self.send_header("Access-Control-Allow-Headers",
                         ", ".join(names) or "Authorization, Content-Type, X-Api-Key")
        self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def send_error(self, code, message=None, explain=None):
        """http.server's own errors (bad request line, huge headers, ...) as JSON."""
        kind = {404: "not_found_error"}.get(code, "invalid_request_error" if code < 500
                                            else "server_error")
        if code == 501:
            code = 405      # an unknown method: the path may exist, the method does not
            kind = "invalid_request_error"
        if self.request_version == "HTTP/0.9":
            # http.server says so of a request line it could not read; the
            # answer still needs its status line and headers
            self.request_version = "HTTP/1.1"
        self.close_connection = True
        self.send_json(code, {"error": {"code": int(code), "type": kind,
                                        "message": message or explain or "error"}})

    def log_request(self, code="-", size="-"):
        # method and path only: a query string may carry a secret
        if self.verbose:
            self.log_message("%s %s %s", self.command, self.path.split("?", 1)[0][:200],
                             getattr(code, "value", code))

    def log_message(self, fmt, *args):
        # only in verbose mode, and never headers (they may carry API keys)
        if self.verbose:
            sys.stderr.write("%s - %s\n" % (self.address_string(), fmt % args))


class _HealthProbe:
    """What ``endpoints.health`` needs of a handler, for the lobby to answer /health."""

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
      at most ``peer_share`` of them for one peer, beyond which the lobby
      answers 503 "too many connections";
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

    def __init__(self, *args, **kwargs):
        self._cond = threading.Condition()
        self._n_connections = 0
        self._per_peer = collections.Counter()      # peer -> connections with a thread
        self._n_requests = 0            # requests between _dispatch's start and end
        self._handlers = Threads("http-connection")
        self.closing = False
        super().__init__(*args, **kwargs)
        self.lobby = Lobby(self, min(self.first_byte_timeout, self.RequestHandlerClass.timeout),
                           self.max_waiting, Handler.server_version)

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
        peer = _peer(client_address)
        with self._cond:
            if self._n_connections >= self.max_connections:
                return "too many connections"
            if self._per_peer[peer] >= max(1, int(self.max_connections * self.peer_share)):
                return "too many connections from this address"
            self._n_connections += 1
            self._per_peer[peer] += 1
        return None

    def start_handler(self, request, client_address):
        """A handler thread for an admitted connection (the lobby's thread calls this).

        Threads are kept for the next connection (offgrid/jobs.py): a new
        one per connection cost each request 0.15 ms.
        """
        try:
            self._handlers.submit(self.process_request_thread, request, client_address)
        except BaseException:
            log.exception("could not start a thread for a connection")
            self._connection_ended(client_address)
            self.shutdown_request(request)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._connection_ended(client_address)

    def _connection_ended(self, client_address):
        peer = _peer(client_address)
        with self._cond:
            self._n_connections -= 1
            self._per_peer[peer] -= 1
            if self._per_peer[peer] <= 0:
                del self._per_peer[peer]

    def reply_when_full(self, head, refusal):
        """(status, body, head_only) for a request that got no slot: /health, or 503."""
        line = head.split(b"\n", 1)[0].split()
        if len(line) == 3 and line[0] in (b"GET", b"HEAD") \
                and line[1].split(b"?", 1)[0] in (b"/health", b"/v1/health"):
            probe = _HealthProbe(self.RequestHandlerClass.service)
            try:
                endpoints.health(probe, None)
            except Exception:
                log.exception("/health failed in the lobby")
            if probe.reply is not None:
                return probe.reply + (line[0] == b"HEAD",)
        return 503, {"error": {"code": 503, "type": "unavailable_error", "message": refusal}}, False

    def server_close(self):
        lobby = getattr(self, "lobby", None)     # absent when binding failed in __init__
        if lobby is not None:
            lobby.stop()
        super().server_close()

    # -- requests -------------------------------------------------------------------
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

    def serve_forever(self, poll_interval=0.5):
        for other in self.servers[1:]:
            threading.Thread(target=other.serve_forever, kwargs={"poll_interval": poll_interval},
                             name="http-%s" % other.server_address[0], daemon=True).start()
        self.servers[0].serve_forever(poll_interval)

    def shutdown(self):
        for server in self.servers:
            server.shutdown()

    def drain(self, timeout):
        deadline = time.monotonic() + timeout
        return all([server.drain(max(0.0, deadline - time.monotonic()))
                    for server in self.servers])

    def server_close(self):
        for server in self.servers:
            server.server_close()


def make_server(host, port, service=None, api_keys=(), cors_origins=(), max_body=None,
                verbose=False, timeout=None, read_timeout=None):
    """A Server bound to host:port whose Handler class carries these settings.

    ``host`` may be a comma list of addresses: a Servers, every address on
    the same port (port 0: the one the first address got).
    """
    attrs = {"service": service, "cors_origins": tuple(cors_origins), "verbose": verbose,
             "api_keys": tuple(hashlib.sha256(k.encode("utf-8")).digest() for k in api_keys)}
    if max_body is not None:
        attrs["max_body"] = max_body
    if timeout is not None:
        attrs["timeout"] = timeout
    if read_timeout is not None:
        attrs["read_timeout"] = read_timeout
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
            servers.append(server_class((one.strip("[]"), port), handler))
            port = servers[0].server_address[1]
    except OSError:
        for server in servers:
            server.server_close()
        raise
    return servers[0] if len(servers) == 1 else Servers(servers)
