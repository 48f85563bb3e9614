"""DisconnectWatcher: a hang-up cancels its request; nothing else wakes it.

Sockets here are a socketpair standing in for a client connection: the
server holds one end, closing the other is the client going away.
"""

import os
import socket
import ssl
import threading
import time

import pytest

from offgrid.server.serving import watcher as watcher_module
from offgrid.server.serving.watcher import DisconnectWatcher
from offgrid.engine.session import RequestCancel

try:
    from .test_tls import make_cert
except ImportError:
    from test_tls import make_cert


@pytest.fixture(params=["rdhup", "interval"])
def watcher(request, monkeypatch):
    if request.param == "interval":         # the fallback where poll has no POLLRDHUP
        monkeypatch.setattr(watcher_module, "_POLLRDHUP", 0)
        monkeypatch.setattr(watcher_module, "_GONE",
                            watcher_module._GONE & ~watcher_module.select.POLLRDHUP)
    w = DisconnectWatcher()
    yield w
    w.stop()


def _wait(cancel, timeout=2.0):
    return cancel.wait(timeout)


def test_a_client_hanging_up_cancels_its_request(watcher):
    server_end, client_end = socket.socketpair()
    cancel = RequestCancel()
    watcher.watch(server_end, cancel)
    client_end.close()
    assert _wait(cancel)
    assert cancel.reason == "client disconnected"
    watcher.unwatch(server_end)
    server_end.close()


def test_unread_bytes_are_not_a_hang_up(watcher):
    # a pipelined next request: readable, but the client is still there
    server_end, client_end = socket.socketpair()
    cancel = RequestCancel()
    watcher.watch(server_end, cancel)
    client_end.sendall(b"GET /health HTTP/1.1\r\n\r\n")
    assert not _wait(cancel, 0.3)
    client_end.close()
    assert _wait(cancel)
    watcher.unwatch(server_end)
    server_end.close()


def test_the_watcher_sleeps_while_requests_run():
    if not watcher_module._POLLRDHUP:
        pytest.skip("this platform's poll has no POLLRDHUP: the watcher looks every 50 ms")
    w = DisconnectWatcher()
    try:
        server_end, client_end = socket.socketpair()
        cancel = RequestCancel()
        looks = []
        original = w._look
        w._look = lambda: (looks.append(1), original())
        w.watch(server_end, cancel)
        time.sleep(0.5)
        # the wake-up for watch() and nothing more (at 20 looks a second: 10)
        assert len(looks) <= 2
        w.unwatch(server_end)
        server_end.close()
        client_end.close()
    finally:
        w.stop()


class _FlakyCancel(RequestCancel):
    """A RequestCancel whose first look raises, as a bug anywhere in a look would."""

    def __init__(self):
        super().__init__()
        self.looks = 0

    @property
    def cancelled(self):
        self.looks += 1
        if self.looks == 1:
            raise RuntimeError("injected")
        return super().cancelled


def test_the_watcher_survives_an_exception_and_keeps_cancelling(watcher, caplog):
    flaky_end, flaky_client = socket.socketpair()
    watcher.watch(flaky_end, _FlakyCancel())       # its look raises RuntimeError
    server_end, client_end = socket.socketpair()
    cancel = RequestCancel()
    watcher.watch(server_end, cancel)
    client_end.close()
    assert _wait(cancel), "the watcher stopped watching after an exception"
    assert watcher._thread.is_alive()
    assert any("injected" in (r.exc_text or "") or r.exc_info for r in caplog.records)
    for s in (server_end, flaky_end, flaky_client):
        watcher.unwatch(s)
        s.close()


def test_watch_and_unwatch_after_stop_raise_nothing_and_write_nowhere():
    w = DisconnectWatcher()
    w.stop()
    w._thread.join(2)
    assert not w._thread.is_alive()
    # the closed pipe's numbers are free again: a new pipe probably gets them,
    # and a stray write to the old write end would land in it
    r, wr = os.pipe()
    try:
        os.set_blocking(r, False)
        server_end, client_end = socket.socketpair()
        w.watch(server_end, RequestCancel())
        w.unwatch(server_end)
        w.stop()
        with pytest.raises(BlockingIOError):
            os.read(r, 1)
        server_end.close()
        client_end.close()
    finally:
        os.close(r)
        os.close(wr)


def test_unwatch_finds_a_socket_its_handler_already_closed(watcher):
    server_end, client_end = socket.socketpair()
    watcher.watch(server_end, RequestCancel())
    server_end.close()                      # fileno() is -1 from here on
    watcher.unwatch(server_end)
    assert not watcher._watched
    client_end.close()


def test_a_tls_client_hanging_up_cancels_its_request(watcher, tmp_path):
    # an HTTPS connection's server end is an SSLSocket, which refuses recv(MSG_PEEK):
    # the watcher looks at the TCP connection under it (httpd/tls.py).  TCP, not a
    # socketpair: a client's FIN is no POLLHUP, so the fallback must look
    key, cert = make_cert(tmp_path)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(str(cert), str(key))
    # no TLS 1.3 session tickets: left unread by the client, they would make its close a
    # reset (POLLHUP) rather than the FIN of a client that read everything
    server_ctx.num_tickets = 0
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client_raw = socket.create_connection(listener.getsockname())
        server_raw, _ = listener.accept()
    client_end = ssl.create_default_context(cafile=str(cert)).wrap_socket(
        client_raw, server_hostname="localhost", do_handshake_on_connect=False)
    shake = threading.Thread(target=client_end.do_handshake)
    shake.start()
    server_end = server_ctx.wrap_socket(server_raw, server_side=True)
    shake.join(10)
    cancel = RequestCancel()
    watcher.watch(server_end, cancel)
    client_end.sendall(b"GET /health HTTP/1.1\r\n\r\n")     # bytes are not a hang-up
    assert not _wait(cancel, 0.3)
    assert server_end.recv(100)         # the handler reads its request, as the server's does
    client_end.close()
    assert _wait(cancel)
    assert cancel.reason == "client disconnected"
    watcher.unwatch(server_end)
    server_end.close()
