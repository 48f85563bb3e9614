"""The HTTP adapter: routing, bodies, auth, JSON, SSE and NDJSON on http.server.

Threading model: each connection gets a thread once it has sent its first
byte (until then it waits in ``lobby``, which has one thread for all of
them); threads are kept for later connections (``offgrid/jobs.py``); a
connection is kept alive between requests (HTTP/1.1).  Generation requests
block their thread inside ``Service.generate`` while they wait for and use a
session; streams write each piece as one chunk of a chunked response.

This layer knows no route: it is handed an ``app`` (``server/api/routes.py``)
with the route table (``app.route``), the call into it (``app.dispatch``)
and the one error exit (``app.error_response``).  With ``--api-prefix`` every
route is served under the prefix, as llama-server registers each of its
routes (the chat page's too) at prefix + path: the prefix comes off a
request's path as its line is read (``route_path``), so the routes and their
handlers see the paths they always do, and a path outside it is a 404.

Errors: handlers raise ``HTTPError`` (or let engine errors through);
``_send_exception`` hands every exception, and http.server's own refusals
(``send_error``), to ``app.error_response``, which maps it to a status and
writes its body in the shape of the route's dialect.  Nothing else writes
error bodies.

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
  peer; beyond, the connection waiting longest for its request head is
  dropped for the newcomer (``seats``), or when none is, 503, with /health
  answered by the lobby when none is free.

A request answered without reading its body (413, 401, 404 ...) closes its
connection after a short, bounded drain ("lingering close"), so the client
reads the answer rather than a connection reset.

Shutdown: ``Server.drain`` refuses new requests and waits for those being
answered, so the models are freed only once no handler can touch them.
"""

import hashlib
import hmac
import logging
import re
import sys
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

from ... import __version__
from . import form, reader
from .httperrors import HTTPError, MethodNotAllowed, NotFound, Unauthorized, Unavailable
from .streams import PING_EVERY, EventStream, NDJSONStream, dumps

log = logging.getLogger("offgrid.http")

# The response header that names the replica (--instance-name).
INSTANCE_HEADER = "X-Offgrid-Instance"

# An HTTP token (RFC 9110): what a header name in Access-Control-Request-Headers may be.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


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
    # The Service, or None while the models load: opaque here, for the app's handlers.
    service = None
    # --front-max-rss (budget.FrontMemory): new work is refused (503) near it
    front_memory = None
    # The application: route, dispatch, error_response (see the module docstring).
    app = None
    # --instance-name: sent on every response as INSTANCE_HEADER, so whoever stands
    # behind a load balancer (an operator, a test) sees which replica answered
    instance_name = None
    # --api-prefix: the path every route is served under ("/llama"; "": none)
    api_prefix = ""
    # --sse-ping-interval: seconds a stream may stay quiet before a keep-alive (streams.py)
    ping_every = PING_EVERY

    @classmethod
    def route_path(cls, path):
        """A request's path (query string and all) within api_prefix, as the routes know
        it; None where it is outside the prefix.  "/llama/health" is "/health" under
        "/llama", and "/llama" alone is outside it, as llama-server's routes are
        prefix + "/...".  The one place the prefix is read."""
        if not cls.api_prefix:
            return path
        if path.startswith(cls.api_prefix + "/"):
            return path[len(cls.api_prefix):]
        return None

    # -- connection ---------------------------------------------------------------
    def setup(self):
        super().setup()
        self.rfile.close()
        self.rfile = reader.RequestReader(self.connection)
        self._n_served = 0
        self._body_pending = False

    def handle_one_request(self):
        # until its head is in, this connection may be dropped for a newcomer (seats.py)
        self.server.head_waiting(self.connection, self.client_address)
        self._stream = None
        self._body_pending = False
        self.outside_prefix = False
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
        by reader.read_headers rather than the email parser: keep in step; and the
        path taken out of --api-prefix (``route_path``)."""
        self.outside_prefix = False
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
        inside = self.route_path(self.path)
        if inside is None:
            self.outside_prefix = True      # kept as sent, for the 404's message
        else:
            self.path = inside
        self.rfile.head_left = self.max_header_bytes     # the line is in; the headers follow
        try:
            self.headers = reader.read_headers(self.rfile)
            self.server.head_done(self.connection)
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
            if method == "POST" and route.needs_service and self.front_memory is not None:
                # before its body takes any room
                self.front_memory.check(self.server.requests_in_flight() - 1)
            # a multipart/form-data upload's files, where the route takes one (form.py)
            self.files = {}
            if method != "POST":
                body = None
            elif getattr(route, "body_form", False) and \
                    form.boundary_of(self.headers.get("Content-Type")) is not None:
                body = self._read_form()
            else:
                body = self._read_json(getattr(route, "body_optional", False),
                                       getattr(route, "body_array", False))
            self.app.dispatch(self, route, body)
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
        route = None if self.outside_prefix else self.app.route(path)
        if method == "OPTIONS":
            return route
        if route is None:
            raise NotFound("File Not Found: %s" % path[:200])
        allowed = route.methods + (("HEAD",) if "GET" in route.methods else ())
        if method not in allowed:
            raise MethodNotAllowed("%s is not allowed on %s" % (method[:32], path),
                                   headers={"Allow": ", ".join(allowed)})
        return route

    def _send_exception(self, exc, counted=True):
        """The one exit for errors; ``counted``: a 5xx counts in /metrics (not the
        refusals of a request that never parsed as HTTP: ``send_error``)."""
        err, body, event = self.app.error_response(
            exc, "%s %s" % (self.command, (self.path or "").split("?", 1)[0]),
            self.service if counted else None)
        if self._body_pending:
            self.close_connection = True    # the unread body must not be read as a request
        stream = getattr(self, "_stream", None)
        if stream is not None and stream.started:
            # headers are gone: the error becomes the stream's last event (or line)
            stream.send(body, event)
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
    def _read_json(self, optional=False, array=False):
        """The body as a JSON object; with ``optional`` None for a POST that sends
        none (no length, or 0: llama-server's POST /slots/ID?action=erase); with
        ``array`` a JSON array too (POST /lora-adapters)."""
        try:
            if optional and reader.framing(self.headers, self.request_version) in (None, 0):
                self._body_pending = False
                return None
            data = reader.read_body(self.rfile, self.headers, self.max_body, self.read_timeout,
                                    self.request_version)
            self._body_pending = False
            return reader.parse_json_object(data, array)
        except HTTPError:
            # a body that is not what it claimed (a Content-Length that lies, no
            # length at all) leaves the connection out of step: end it
            self.close_connection = True
            raise

    def _read_form(self):
        """A multipart/form-data body's fields (strings, as llama-server reads them, a
        repeated one a list); its files go to ``self.files``."""
        try:
            data = reader.read_body(self.rfile, self.headers, self.max_body, self.read_timeout,
                                    self.request_version)
        except HTTPError:
            self.close_connection = True
            raise
        self._body_pending = False
        fields, self.files = form.parse(data, self.headers.get("Content-Type"))
        return fields

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
        if self.instance_name:
            self.send_header(INSTANCE_HEADER, self.instance_name)

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
        """http.server's own errors (bad request line, huge headers, ...), through the
        one error exit like every other."""
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
        self._stream = None
        self._send_exception(HTTPError(message or explain or "error", status=int(code),
                                       type=kind), counted=False)

    def log_request(self, code="-", size="-"):
        # method and path only: a query string may carry a secret
        if self.verbose:
            self.log_message("%s %s %s", self.command, self.path.split("?", 1)[0][:200],
                             getattr(code, "value", code))

    def log_message(self, fmt, *args):
        # only in verbose mode, and never headers (they may carry API keys)
        if self.verbose:
            sys.stderr.write("%s - %s\n" % (self.address_string(), fmt % args))


