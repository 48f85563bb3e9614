"""DisconnectWatcher: a hang-up cancels its request; nothing else wakes it.

Sockets here are a socketpair standing in for a client connection: the
server holds one end, closing the other is the client going away.
"""

import socket
import time

import pytest

from offgrid.server import watcher as watcher_module
from offgrid.server.watcher import DisconnectWatcher
from offgrid.engine.session import RequestCancel


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
