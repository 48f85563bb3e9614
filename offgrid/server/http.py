"""The HTTP adapter: routing, bodies, auth, JSON and SSE on http.server.

Threading model: ``ThreadingHTTPServer`` gives each connection a thread; a
connection is kept alive between requests (HTTP/1.1).  Generation requests
block their thread inside ``Service.generate`` while they wait for and use a
session; streams write each piece as one chunk of a chunked response.

Errors: handlers raise ``HTTPError`` (or let engine errors through);
``_dispatch`` turns every exception into one JSON error response via
``errors.to_http_error``.  Nothing else writes error bodies.
"""

import hmac
import json
import logging
import socket
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .. import __version__
from ..errors import OffgridError
from . import endpoints
from .errors import (BadRequest, HTTPError, MethodNotAllowed, NotFound, PayloadTooLarge,
                     Unauthorized, Unavailable, to_http_error)

log = logging.getLogger("offgrid.http")


def dumps(obj):
    """JSON bytes; lone surrogates a client sent become U+FFFD rather than an error."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")


class EventStream:
    """A ``text/event-stream`` response written as HTTP/1.1 chunks.

    ``send`` returns False once the client is gone, which the generation loop
    takes as a cancel.
    """

    def __init__(self, handler):
        self.handler = handler
        self.started = False
        self.broken = False

    def start(self):
        h = self.handler
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Cache-Control", "no-cache")
        h.send_header("Transfer-Encoding", "chunked")
        h.send_cors_headers()
        h.end_headers()
        self.started = True

    def send(self, obj):
        data = b"data: " + (obj if isinstance(obj, bytes) else dumps(obj)) + b"\n\n"
        return self._write(b"%x\r\n%s\r\n" % (len(data), data))

    def end(self):
        self._write(b"0\r\n\r\n")

    def _write(self, data):
        if self.broken:
            return False
        if not self.started:
            self.start()
        try:
            self.handler.wfile.write(data)
            return True
        except OSError:
            self.broken = True
            self.handler.close_connection = True
            return False


class Handler(BaseHTTPRequestHandler):
    """One HTTP connection.  Settings are class attributes, set by make_server."""

    # HTTP/1.1: keep-alive by default, so an editor reuses one connection.
    protocol_version = "HTTP/1.1"
    server_version = "offgrid/" + __version__
    # Seconds a connection may sit idle (or a client take to send a request)
    # before its thread gives up; bounds threads held by silent clients.
    timeout = 30
    # Largest request body accepted (bytes); larger ones get 413 unread.
    max_body = 8 * 1024 * 1024
    # API keys (empty: no auth).  Compared in constant time.
    api_keys = ()
    # Origins allowed to make cross-origin requests (empty: CORS off).
    cors_origins = ()
    verbose = False
    # The Service, or None while the models load.
    service = None

    # -- methods ----------------------------------------------------------------
    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def do_OPTIONS(self):
        self._dispatch("OPTIONS")

    def _not_allowed(self):
        self._dispatch(self.command)

    do_PUT = do_DELETE = do_PATCH = do_HEAD = _not_allowed

    # -- dispatch -----------------------------------------------------------------
    def _dispatch(self, method):
        path = self.path.split("?", 1)[0]
        try:
            route = endpoints.ROUTES.get(path)
            if method == "OPTIONS":
                return self._preflight(route)
            if route is None:
                self._drain_body()
                raise NotFound("File Not Found: %s" % path[:200])
            if method not in route.methods:
                self._drain_body()
                raise MethodNotAllowed("%s is not allowed on %s" % (method, path),
                                       headers={"Allow": ", ".join(route.methods)})
            if route.auth:
                self._check_auth()
            body = self._read_json() if method == "POST" else None
            if route.needs_service and self.service is None:
                raise Unavailable("Loading model")
            route.handler(self, body)
        except Exception as exc:           # the one exit for errors
            self._send_exception(exc)

    def _send_exception(self, exc):
        err = to_http_error(exc)
        if err.status >= 500 and not isinstance(exc, (HTTPError, OffgridError)):
            log.exception("internal error on %s %s", self.command, self.path)
        if self.service is not None and err.status >= 500:
            self.service.metrics.error()
        stream = getattr(self, "_stream", None)
        if stream is not None and stream.started:
            # headers are gone: the error becomes the stream's last event
            stream.send(err.body())
            stream.end()
            return
        self.send_json(err.status, err.body(), err.headers)

    # -- requests ---------------------------------------------------------------
    def _check_auth(self):
        if not self.api_keys:
            return
        given = self.headers.get("x-api-key") or ""
        auth = self.headers.get("Authorization") or ""
        if auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        ok = False
        for key in self.api_keys:     # no early exit: time does not tell which key
            ok |= hmac.compare_digest(given.encode("utf-8", "replace"), key.encode("utf-8"))
        if not ok:
            self._drain_body()
            raise Unauthorized("Invalid API Key")

    def _read_body(self):
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._read_chunked()
        length = self.headers.get("Content-Length")
        if length is None:
            return b""
        try:
            n = int(length)
            if n < 0:
                raise ValueError
        except ValueError:
            self.close_connection = True
            raise BadRequest("invalid Content-Length header")
        if n > self.max_body:
            self.close_connection = True    # the unread body must not be parsed as a request
            raise PayloadTooLarge("request body of %d bytes exceeds the limit of %d bytes"
                                  % (n, self.max_body))
        data = self._read_exact(n)
        return data

    def _read_exact(self, n):
        chunks, left = [], n
        while left > 0:
            try:
                chunk = self.rfile.read(min(left, 1 << 16))
            except OSError:
                chunk = b""
            if not chunk:
                self.close_connection = True
                raise BadRequest("request body ended after %d of %d bytes" % (n - left, n))
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _read_chunked(self):
        out, total = [], 0
        while True:
            line = self.rfile.readline(1024)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                self.close_connection = True
                raise BadRequest("malformed chunked request body")
            if size == 0:
                while self.rfile.readline(1024).strip():
                    pass        # trailers
                return b"".join(out)
            total += size
            if total > self.max_body:
                self.close_connection = True
                raise PayloadTooLarge("request body exceeds the limit of %d bytes" % self.max_body)
            out.append(self._read_exact(size))
            self.rfile.readline(8)      # CRLF after the chunk

    def _drain_body(self):
        """Read (and drop) a small body so the connection stays usable."""
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = -1
        if 0 < n <= self.max_body:
            self._read_exact(n)
        elif n != 0:
            self.close_connection = True

    def _read_json(self):
        data = self._read_body()
        if not data.strip():
            raise BadRequest("the request body is empty; send a JSON object")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadRequest("the request body is not valid UTF-8 (byte %d)" % e.start)
        try:
            body = json.loads(text)
        except ValueError as e:
            raise BadRequest("invalid JSON in the request body: %s" % e)
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    # -- responses --------------------------------------------------------------
    def send_json(self, status, obj, headers=None):
        body = dumps(obj)
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_cors_headers()
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            self.close_connection = True

    def send_text(self, status, text, content_type="text/plain; version=0.0.4"):
        body = text.encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_cors_headers()
        self.end_headers()
        self.wfile.write(body)

    def event_stream(self):
        self._stream = EventStream(self)
        return self._stream

    def send_cors_headers(self):
        origin = self.headers.get("Origin") if self.headers else None
        if origin and origin in self.cors_origins:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")

    def _preflight(self, route):
        origin = self.headers.get("Origin")
        if route is None or not origin or origin not in self.cors_origins:
            self._drain_body()
            raise HTTPError("CORS preflight refused", status=403, type="permission_error")
        self.send_response(204)
        self.send_cors_headers()
        self.send_header("Access-Control-Allow-Methods", ", ".join(route.methods + ("OPTIONS",)))
        self.send_header("Access-Control-Allow-Headers",
                         self.headers.get("Access-Control-Request-Headers") or
                         "Authorization, Content-Type")
        self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def send_error(self, code, message=None, explain=None):
        """http.server's own errors (bad request line, huge headers, ...) as JSON."""
        kind = {400: "invalid_request_error", 404: "not_found_error", 408: "invalid_request_error",
                414: "invalid_request_error", 431: "invalid_request_error",
                501: "not_supported_error"}.get(code, "server_error")
        if code == 501:
            code = 405      # an unknown method: the path may exist, the method does not
            kind = "invalid_request_error"
        self.close_connection = True
        try:
            self.send_json(code, {"error": {"code": code, "message": message or explain or "error",
                                            "type": kind}})
        except OSError:
            pass

    def log_message(self, fmt, *args):
        # http.server logs every request line; only in verbose mode, and never
        # headers (they may carry API keys).
        if self.verbose:
            sys.stderr.write("%s - %s\n" % (self.address_string(), fmt % args))

    def handle_one_request(self):
        self._stream = None
        try:
            super().handle_one_request()
        except (ConnectionError, TimeoutError, OSError):
            self.close_connection = True


class Server(ThreadingHTTPServer):
    """ThreadingHTTPServer with our settings."""
    # Handler threads must not keep the process alive past shutdown: the
    # shutdown sequence itself waits for the requests that matter.
    daemon_threads = True
    # Restarting the server right after a stop must not fail on TIME_WAIT.
    allow_reuse_address = True
    request_queue_size = 128


def make_server(host, port, service=None, api_keys=(), cors_origins=(), max_body=None,
                verbose=False, timeout=None):
    """A Server bound to host:port whose Handler class carries these settings."""
    attrs = {"service": service, "api_keys": tuple(api_keys), "cors_origins": tuple(cors_origins),
             "verbose": verbose}
    if max_body is not None:
        attrs["max_body"] = max_body
    if timeout is not None:
        attrs["timeout"] = timeout
    handler = type("OffgridHandler", (Handler,), attrs)
    server_class = Server
    if ":" in host:
        server_class = type("Server6", (Server,), {"address_family": socket.AF_INET6})
    return server_class((host.strip("[]"), port), handler)
