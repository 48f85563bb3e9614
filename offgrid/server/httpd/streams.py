"""Streamed responses: server-sent events and NDJSON, as HTTP/1.1 chunks.

A stream may be opened before its first message (``open``): its headers go
out at once, and while it is quiet (a long prompt being evaluated) one
thread for all streams, the ``Pinger``, writes the stream's keep-alive
every ``PING_EVERY`` seconds, so a client with a read timeout keeps
waiting.
"""

import json
import threading
import time

from . import burst

# Seconds a stream opened early may stay quiet before it gets a keep-alive, by
# default (--sse-ping-interval: Handler.ping_every).  Anthropic's API pings about
# this often; a proxy's or client's idle timeout is rarely under 30 s.
PING_EVERY = 10.0


def dumps(obj):
    """JSON bytes; lone surrogates become U+FFFD rather than an error."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")


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
        self.ended = False
        self.chunked = handler.request_version != "HTTP/1.0"
        # several choices of one request may stream at once (Service.run_choices)
        self._lock = threading.Lock()
        self.last_write = time.monotonic()
        self.keepalive = None       # the bytes of a keep-alive message, once open()ed
        self.ping_every = PING_EVERY

    def open(self, keepalive=None):
        """Send the headers now, and ``keepalive`` (a message's bytes) whenever the stream
        has been quiet the handler's ping_every seconds (none where it is 0 or less),
        until it ends."""
        self._write_now(b"")
        self.ping_every = getattr(self.handler, "ping_every", PING_EVERY)
        if keepalive is not None and not self.broken and self.ping_every > 0:
            self.keepalive = self._chunk(keepalive)
            PINGER.add(self)

    def ping(self, now):
        """The Pinger's call: the keep-alive if the stream has been quiet long enough.
        Never waits for the stream's lock: a writer stuck on a client that stopped
        reading must not hold up the other streams' keep-alives."""
        if now - self.last_write < self.ping_every or not self._lock.acquire(blocking=False):
            return
        try:
            self._write_locked(self.keepalive)
        finally:
            self._lock.release()

    def start(self):
        h = self.handler
        h.send_response(200)
        h.send_header("Content-Type", self.content_type)
        h.send_header("Cache-Control", "no-cache")
        # nginx buffers a proxied response by default (proxy_buffering on) and
        # would hold the stream until it ends; this header turns that off for it
        h.send_header("X-Accel-Buffering", "no")
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

    def _chunk(self, data):
        return b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data

    def send(self, obj, event=None):
        return self._write(self._chunk(self.frame(obj, event)))

    def end(self):
        if self.chunked:
            self._write(b"0\r\n\r\n")
        with self._lock:
            self.ended = True
        if self.keepalive is not None:
            PINGER.remove(self)

    def _write(self, data):
        if self.broken:
            return False
        return burst.write(self._write_now, data)     # held while a burst is handed on

    def _write_now(self, data):
        with self._lock:
            return self._write_locked(data)

    def _write_locked(self, data):
        if self.broken or self.ended:
            return False
        try:
            if not self.started:
                self.start()
            if data:
                self.handler.wfile.write(data)
            self.last_write = time.monotonic()
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




class Pinger:
    """One thread that keeps every open, quiet stream alive (``_ChunkedStream.open``).

    It runs only while some stream is registered; a stream leaves at its end
    (or when its client is gone: a failed write marks it broken).
    """

    def __init__(self, period=1.0):
        self.period = period
        self._streams = set()
        self._cond = threading.Condition()
        self._thread = None

    def add(self, stream):
        with self._cond:
            self._streams.add(stream)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stream-pinger",
                                                daemon=True)
                self._thread.start()

    def remove(self, stream):
        with self._cond:
            self._streams.discard(stream)

    def _run(self):
        while True:
            with self._cond:
                self._streams = {s for s in self._streams if not (s.broken or s.ended)}
                if not self._streams:
                    self._thread = None
                    return
                streams = list(self._streams)
            now = time.monotonic()
            for s in streams:
                s.ping(now)
            time.sleep(self.period)


PINGER = Pinger()
