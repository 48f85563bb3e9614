"""The front's SIGINT/SIGTERM handling (offgrid/__main__.py StopSignals)."""

import os
import signal
import threading
import time

from offgrid.__main__ import StopSignals


def test_sigterm_ends_the_wait_and_a_second_one_would_end_the_process():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    stop = StopSignals()
    try:
        stop.install()
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        t0 = time.monotonic()
        stop.wait(poll=0.05)
        assert time.monotonic() - t0 < 5
        assert stop.received == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL
    finally:
        for s, h in saved.items():
            signal.signal(s, h)

