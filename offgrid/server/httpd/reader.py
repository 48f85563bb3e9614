"""Reading requests off a connection, under limits: deadlines, sizes, bodies, JSON.

Everything a client sends passes through here before a handler sees it, so
this is where what one client can hold is bounded:

    RequestReader       a connection's rfile: every read under the deadline of
                        its phase (waiting for a request, or reading one), header
                        bytes counted, and every header line checked (BadHeaders)
    read_headers        the header lines, checked, as http.client's HTTPMessage
    framing             how a request's body is delimited, or 400 where that is
                        not certain (request smuggling: see below)
    read_body           a body by Content-Length or chunked, never past max_body;
                        a body that is too large is refused before any of it is read
    parse_json_object   the body as a dict, stricter than json.loads
    linger              the bounded drain before closing a connection whose
                        client is still sending

Framing is strict because offgrid may sit behind a proxy: wherever the proxy
and offgrid could disagree on where a request ends (RFC 9112 §6.3, §11.2), the
bytes after it could be read as a second, "smuggled" request that the proxy
never saw.  So header lines that http.server's parser would accept or
silently drop are refused: obs-fold (a line starting with a space or tab),
whitespace before the colon, a bare CR (which the email parser takes as a line
end), NUL and other control bytes; and so are bodies whose length is in doubt:
Transfer-Encoding with Content-Length, a coding other than exactly
``chunked``, Transfer-Encoding in HTTP/1.0, several or malformed
Content-Lengths.  Each is a 400, after which the Handler closes the connection.

Errors are ``server.errors`` HTTPErrors, except the three a read deep inside
http.server can raise (ReadTimeout, HeadersTooLarge, BadHeaders), which the
Handler turns into 408, 431 and 400.
"""

import http.client
import io
import json
import re
import socket
import time

from ... import jsonlimit
from . import tls
from .httperrors import BadRequest, LengthRequired, PayloadTooLarge, RequestTimeout

# A JSON string escape of a UTF-16 surrogate: only with one can a lone
# surrogate hide in a body that decoded as UTF-8.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_CHUNK_SIZE = re.compile(rb"[0-9a-fA-F]{1,8}")
# A header line (RFC 9112 §5, RFC 9110 §5.5): a token, the colon at once, a
# value of visible bytes, spaces and tabs (obs-text too), then CRLF or LF.
_FIELD_LINE = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+:[\t\x20-\x7e\x80-\xff]*\r?\n")
# Content-Length digits beyond which the length is "larger than any limit"
# (int() refuses strings of more than 4300 digits on Python 3.11+)
_MAX_LENGTH_DIGITS = 18
# trailer lines accepted after a chunked body
_MAX_TRAILERS = 100
# http.client's limits: bytes of a header line, header lines in a request
_MAX_LINE = 65536
_MAX_HEADERS = 100


class ReadTimeout(Exception):
    """A read deadline passed.  Not an OSError, so http.server lets it through to us."""


class HeadersTooLarge(Exception):
    """A request's headers exceed the limit."""


class BadHeaders(Exception):
    """A header line that is not one (obs-fold, space before the colon, bare CR, ...)."""


# -- the connection's rfile -------------------------------------------------------------

class _SocketReader(io.RawIOBase):
    """The raw side of a connection's rfile: recv, bounded by a deadline for a whole phase.

    A per-recv timeout alone would let a client that sends a byte a second
    hold its thread for ever; the deadline is for the phase, however it drips.
    """

    def __init__(self, sock):
        self.sock = sock
        self.deadline = None        # time.monotonic() by which the current phase must end

    def readable(self):
        return True

    def readinto(self, buf):
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise ReadTimeout()
            self.sock.settimeout(left)
        try:
            return self.sock.recv_into(buf)
        except socket.timeout:
            raise ReadTimeout() from None


class RequestReader(io.BufferedReader):
    """A connection's rfile: buffered reads under a deadline, header bytes counted."""

    def __init__(self, sock):
        self._source = _SocketReader(sock)
        super().__init__(self._source)
        self.head_left = None       # header bytes still allowed; None outside the headers

    def phase(self, seconds):
        """Start a phase that must end within ``seconds`` (None: no deadline)."""
        self._source.deadline = None if seconds is None else time.monotonic() + seconds

    def readline(self, size=-1):
        line = super().readline(size)
        if self.head_left is not None:
            self.head_left -= len(line)
            if self.head_left < 0:
                raise HeadersTooLarge()
            _check_field_line(line, size)
        return line


def _check_field_line(line, size):
    """BadHeaders unless ``line`` is a header line, the blank line after them, or EOF."""
    if line in (b"\r\n", b"\n", b""):
        return          # the end of the headers
    if not line.endswith(b"\n") and 0 <= size <= len(line):
        return          # cut at http.server's line limit: it answers that itself (431)
    if _FIELD_LINE.fullmatch(line):
        return
    if line[:1] in (b" ", b"\t"):
        raise BadHeaders("a header line starts with whitespace (obs-fold is not accepted)")
    if not line.endswith(b"\n"):
        raise BadHeaders("the connection ended inside the headers")
    name = line.split(b":", 1)[0]
    if b":" not in line or not name or name != name.strip():
        raise BadHeaders("malformed header line: a field name, then a colon at once")
    raise BadHeaders("a header has a control character (CR, NUL, ...) in its name or value")


class TooManyHeaders(Exception):
    """More header lines than _MAX_HEADERS."""


class LineTooLong(Exception):
    """A header line longer than _MAX_LINE."""


def read_headers(rfile):
    """A request's header lines, up to the blank line, as an HTTPMessage.

    What http.client.parse_headers returns for them, without its email
    parser, which was 0.05 ms of every request here (a twentieth of a quick
    one): RequestReader has checked each line already, so a line is a
    name, a colon at once and a value, and the value is what the email
    parser keeps (compat32: spaces and tabs before it dropped, CR LF after).
    """
    msg = http.client.HTTPMessage()
    n = 0
    while True:
        line = rfile.readline(_MAX_LINE + 1)
        if len(line) > _MAX_LINE:
            raise LineTooLong("header line")
        if line in (b"\r\n", b"\n", b""):
            return msg
        n += 1
        if n > _MAX_HEADERS:
            raise TooManyHeaders("got more than %d headers" % _MAX_HEADERS)
        name, _, value = line.decode("iso-8859-1").partition(":")
        msg.set_raw(name, value.lstrip(" \t").rstrip("\r\n"))


def unread_bytes(sock):
    """Whether the client has sent bytes the server has not read (without waiting); under
    TLS, bytes decrypted already count too, and any TLS record does (tls.py)."""
    if tls.is_tls(sock) and sock.pending():
        return True
    try:
        return bool(tls.raw_peek(sock))
    except OSError:
        return False


def linger(sock, seconds, max_bytes):
    """Half-close, then drop what the client still sends, for a bounded time and size.

    Closing a socket with unread bytes makes the kernel send a reset, which
    can overtake the answer just written; a client that is still sending a
    body it will never have read gets a moment to read the answer instead.
    """
    try:
        tls.close_notify(sock)
        sock.shutdown(socket.SHUT_WR)
        deadline, left = time.monotonic() + seconds, max_bytes
        while left > 0:
            wait = deadline - time.monotonic()
            if wait <= 0:
                break
            sock.settimeout(wait)
            data = sock.recv(min(left, 1 << 16))
            if not data:
                break
            left -= len(data)
    except OSError:
        pass


# -- bodies -------------------------------------------------------------------------------

def framing(headers, version="HTTP/1.1"):
    """How the body is delimited: None (no body), -1 (chunked) or its length in bytes.

    BadRequest where that is in doubt (RFC 9112 §6.1, §6.3); the connection
    must then be closed, since where the next request would start is in doubt too.
    A length too large for any limit comes back as 2**63.
    """
    te = headers.get_all("Transfer-Encoding")
    lengths = headers.get_all("Content-Length")
    if te is not None:
        if lengths is not None:
            # RFC 9112 §6.1 lets a server read such a request by its chunks or
            # refuse it; no client sends both, only a smuggler or a broken proxy
            # does, so refusing costs nobody and runs nothing it framed its own way
            raise BadRequest("the request has both Transfer-Encoding and Content-Length; "
                             "send one of them")
        if version == "HTTP/1.0":
            raise BadRequest("Transfer-Encoding is not allowed in an HTTP/1.0 request")
        codings = [c.strip().lower() for c in ",".join(te).split(",")]
        if codings != ["chunked"]:
            raise BadRequest("unsupported Transfer-Encoding %r; send the body plain or chunked"
                             % ", ".join(te)[:100])
        return -1
    if lengths is None:
        return None
    if len(lengths) > 1:
        raise BadRequest("more than one Content-Length header")
    length = lengths[0].strip()
    if not (length.isascii() and length.isdigit()):
        raise BadRequest("invalid Content-Length header")
    if len(length.lstrip("0")) > _MAX_LENGTH_DIGITS:
        return 2 ** 63
    return int(length)


def body_length(headers, max_body, version="HTTP/1.1"):
    """The declared body length, -1 for chunked; 400, 411 or 413 before any of it is read."""
    n = framing(headers, version)
    if n is None:
        raise LengthRequired("the request needs a body: send a Content-Length header or a "
                             "chunked body")
    if n > max_body:
        raise PayloadTooLarge("request body of %d bytes exceeds the limit of %d bytes"
                              % (n, max_body) if n < 2 ** 63 else
                              "request body exceeds the limit of %d bytes" % max_body)
    return n


def read_body(rfile, headers, max_body, read_timeout, version="HTTP/1.1"):
    """The request body's bytes, within ``max_body`` and the read deadline."""
    n = body_length(headers, max_body, version)
    try:
        return _read_chunked(rfile, max_body) if n < 0 else _read_exact(rfile, n)
    except ReadTimeout:
        raise RequestTimeout("the request body did not arrive within %g seconds" % read_timeout)
    except OSError as e:        # the client went away; nobody will read the answer
        raise BadRequest("the request body could not be read: %s" % e)


def _read_exact(rfile, n):
    data = rfile.read(n)
    if len(data) < n:
        raise BadRequest("request body ended after %d of %d bytes" % (len(data), n))
    return data


def _read_chunked(rfile, max_body):
    out, total = [], 0
    while True:
        line = rfile.readline(1024)
        size = line.split(b";", 1)[0].strip()        # a chunk extension is ignored
        if not line.endswith(b"\n") or not _CHUNK_SIZE.fullmatch(size):
            raise BadRequest("malformed chunked request body")
        size = int(size, 16)
        if size == 0:
            for _ in range(_MAX_TRAILERS):
                if not rfile.readline(1024).strip():
                    return b"".join(out)
            raise BadRequest("malformed chunked request body")
        total += size
        if total > max_body:
            raise PayloadTooLarge("request body exceeds the limit of %d bytes" % max_body)
        out.append(_read_exact(rfile, size))
        if rfile.read(2) != b"\r\n":
            raise BadRequest("malformed chunked request body")


# -- JSON ---------------------------------------------------------------------------------

def _no_constant(name):
    raise ValueError("%s is not a JSON value" % name)


def parse_json_object(data, array=False):
    """A request body as a dict (or, with ``array``, a list), or BadRequest saying
    what is wrong with it.

    Stricter than ``json.loads``: ``NaN`` and ``Infinity`` are refused (they
    are not JSON), and so are strings with a lone surrogate such as
    ``"\\ud800"`` (JSON's escapes allow them; Unicode text cannot hold them,
    and the tokenizer would get bytes that are not UTF-8).
    """
    if not data.strip():
        raise BadRequest("the request body is empty; send a JSON object")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest("the request body is not valid UTF-8 (byte %d)" % e.start)
    # measured before json.loads recurses into it, and everything after it
    # (offgrid/jsonlimit.py)
    if jsonlimit.depth_over(text):
        raise BadRequest("the request body nests arrays and objects more than %d levels deep"
                         % jsonlimit.MAX_DEPTH)
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise BadRequest("the request body is nested too deeply")
    except ValueError as e:
        raise BadRequest("invalid JSON in the request body: %s" % e)
    if not isinstance(body, dict) and not (array and isinstance(body, list)):
        raise BadRequest("the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRequest("the request body has a lone UTF-16 surrogate (\\u%04x) in a "
                             "string; strings must be valid Unicode" % ord(e.object[e.start]))
    return body
