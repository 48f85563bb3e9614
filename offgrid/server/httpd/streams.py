"""Streamed responses: server-sent events and NDJSON, as HTTP/1.1 chunks."""

import json
import threading

from . import burst


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


