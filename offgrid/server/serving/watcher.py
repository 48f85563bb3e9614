"""DisconnectWatcher: cancels a running request when its client hangs up.

One daemon thread for the whole process; ``Service.generate`` calls
``watch`` as a request starts and ``unwatch`` as it ends, from handler
threads, and ``Service.shutdown`` calls ``stop`` once.  The thread must
outlive anything one request can do to it: an exception in a look is logged
and the next look runs, since a dead watcher would silently end
cancel-on-disconnect for the life of the process.
"""

import logging
import os
import select
import threading

from ..httpd import tls

log = logging.getLogger("offgrid.watcher")

# Linux's "peer closed its end" poll event.  Elsewhere the watcher falls back
# to looking every `interval` seconds for a readable socket with nothing in it.
_POLLRDHUP = getattr(select, "POLLRDHUP", 0)
_GONE = select.POLLHUP | select.POLLERR | select.POLLNVAL | _POLLRDHUP


class DisconnectWatcher:
    """Cancels requests whose client closed its connection.

    One thread waits in poll() on the sockets of running requests and on a
    pipe that watch() writes to, so it wakes only when a client hangs up or a
    request starts.  (It used to wake 20 times a second: on 2
    cores each wake-up takes a core from one of ggml's spinning threads, and
    the other waits at the next barrier; measured in one process, a 20 Hz
    poller took 2 to 4% off prompt speed.)
    While a request runs its client has nothing more to send, so a hang-up
    is the only event; it cancels the request, which also aborts a prompt
    evaluation in progress.

    The pipe is written and closed only under the lock, and closed once: after
    ``stop`` a write would land on a closed descriptor, or on whatever file
    the process opened next under the same number.
    """

    interval = 0.05     # seconds between looks where poll has no POLLRDHUP

    def __init__(self):
        self._lock = threading.Lock()
        # socket -> [RequestCancel, ...]: every job of the request on that
        # connection (prompts x choices run at once, each registering its own
        # cancel, or the one they share); a hang-up fires them all.  Keyed by
        # the socket, not its fileno, so that unwatch finds the entry even
        # after the handler closed the socket.
        self._watched = {}
        self._stop = threading.Event()
        self._pipe_open = True          # under _lock: the wake-up pipe may be written
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="disconnect-watcher", daemon=True)
        self._thread.start()

    def watch(self, sock, cancel, wake=True):
        """Cancel ``cancel`` when ``sock``'s peer hangs up.

        ``wake=False`` leaves the thread as it is: the socket is polled from
        its next look on, which ``wake()`` (or any other watch) brings.  A
        request that may be over in a few milliseconds registers so and wakes
        the thread only if it is not: the wake-up, a thread switch on the
        request's path, was 0.1 ms of each quick request on 2 cores.
        """
        with self._lock:
            self._watched.setdefault(sock, []).append(cancel)
            if wake:
                self._wake()

    def wake(self):
        """Make the thread look again now, at every socket watched."""
        with self._lock:
            self._wake()

    def unwatch(self, sock, cancel=None):
        """Forget one registration of ``cancel`` on ``sock`` (None: all of the socket's)."""
        # No wake-up (it cost every request a thread switch): the thread's poll
        # may still hold this socket until the next watch() or hang-up wakes
        # it; a hang-up then cancels a request that is over, which does nothing.
        with self._lock:
            cancels = self._watched.get(sock)
            if cancels is None:
                return
            if cancel is not None:
                for i, c in enumerate(cancels):
                    if c is cancel:
                        del cancels[i]
                        break
            if cancel is None or not cancels:
                del self._watched[sock]

    def stop(self):
        """End the thread (idempotent); watch and unwatch do nothing harmful after it."""
        with self._lock:
            if self._stop.is_set():
                return
            # set first, then the last wake-up: a thread woken before the flag
            # was set would poll again, for good
            self._stop.set()
            if self._pipe_open:
                try:
                    os.write(self._wake_w, b"\0")
                except OSError:
                    pass

    def _wake(self):
        """Make the thread look again (under _lock); a no-op once stopped."""
        if self._stop.is_set() or not self._pipe_open:
            return
        try:
            os.write(self._wake_w, b"\0")
        except OSError:
            pass                    # the pipe is full: a wake-up is already pending

    def _close_pipe(self):
        with self._lock:
            if self._pipe_open:
                self._pipe_open = False
                os.close(self._wake_r)
                os.close(self._wake_w)

    # -- the thread -----------------------------------------------------------
    def _run(self):
        try:
            while not self._stop.is_set():
                try:
                    self._look()
                except Exception:
                    # a bug or a surprise in one look must not end the watching
                    log.exception("disconnect watcher: a look failed; watching on")
                    self._stop.wait(self.interval)     # no hot loop if it fails again
        finally:
            self._close_pipe()

    def _look(self):
        with self._lock:
            # a cancelled request's socket stays watched until its handler
            # unwatches it; polling it again would return at once, forever
            items = [(sock.fileno(), sock, live) for sock, live in
                     ((sock, [c for c in cancels if not c.cancelled])
                      for sock, cancels in self._watched.items()) if live]
        items = [item for item in items if item[0] >= 0]        # -1: closed already
        # poll, not select: select cannot watch descriptors past 1023,
        # which a busy server's sockets reach
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        for fd, _, _ in items:
            poller.register(fd, _POLLRDHUP or select.POLLIN | select.POLLPRI)
        try:
            ready = dict(poller.poll(None if _POLLRDHUP else self.interval * 1000))
        except OSError:
            return
        if ready.pop(self._wake_r, 0):
            os.read(self._wake_r, 4096)
        for fd, sock, cancels in items:
            events = ready.get(fd, 0)
            if events & _GONE or (events and self._closed(sock)):
                for cancel in cancels:
                    cancel.cancel("client disconnected")
        if ready and not _POLLRDHUP:
            self._stop.wait(self.interval)      # a socket with unread bytes stays readable

    @staticmethod
    def _closed(sock):
        # the TCP connection's bytes, also under TLS (whose socket refuses MSG_PEEK):
        # EOF is a hang-up either way; a client's bytes, or its TLS close_notify
        # alert before its FIN, are not yet
        try:
            return tls.raw_peek(sock) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True
