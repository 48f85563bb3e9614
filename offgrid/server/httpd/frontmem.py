"""The front's own memory ceiling, ``--front-max-rss``.

The front refuses new work with 503 while its RSS is past REFUSE_AT of the
ceiling and other requests run, so what runs has room to finish below it;
reading the shelf and /health still answer.  With nothing else running the
request is taken whatever the RSS: the memory is then no request's but what
the allocator kept (glibc keeps freed blocks of up to 32 MB in its heap once
one such was freed; measured, an 8 MB body left the front 14 MiB larger for
good), and refusing on it would refuse forever.  What one request may add is
bounded elsewhere: its body (``Handler.max_body``), its probabilities
(``api/budget.py``), its stream's backlog (``models/worker_client.py``).
"""

import gc
import os
import threading
import time

from .httperrors import Unavailable

# the default --front-max-rss, MiB (a front serving normally holds 30 to 60)
DEFAULT_FRONT_MAX_RSS = 4096
# the share of the ceiling past which new work is refused
REFUSE_AT = 0.75


def ceiling_from_flag(flag):
    """--front-max-rss (MiB) in bytes, None for no ceiling: the flag, else the default,
    or half the machine's RAM where that is less."""
    if flag is not None:
        return int(flag * (1 << 20)) if flag > 0 else None
    ceiling = DEFAULT_FRONT_MAX_RSS << 20
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        ceiling = min(ceiling, ram // 2)
    except (ValueError, OSError, AttributeError):
        pass
    return ceiling


def _rss():
    """This process's resident bytes (Linux), or None."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class FrontMemory:
    """``--front-max-rss``: new work is refused (503) while the front's RSS is past
    REFUSE_AT of it."""

    def __init__(self, max_rss):
        self.max_rss = max_rss          # bytes, or None: no ceiling
        self._lock = threading.Lock()
        self._collected_at = 0.0
        self.refused = 0

    def check(self, others_running):
        """Raise Unavailable if the front is too close to its ceiling to take new work
        while ``others_running`` requests are in flight."""
        if not self.max_rss or others_running <= 0:
            return
        rss = _rss()
        if rss is None or rss <= self.max_rss * REFUSE_AT:
            return
        # what the last requests left may only be waiting for a collection (at
        # most one a second: a flood of refusals must not become one of collections)
        with self._lock:
            now = time.monotonic()
            if now - self._collected_at > 1.0:
                self._collected_at = now
                gc.collect()
        rss = _rss() or 0
        if rss <= self.max_rss * REFUSE_AT:
            return
        self.refused += 1
        raise Unavailable("the server holds %d MiB, past %d%% of its --front-max-rss of %d "
                          "MiB: new work waits until running requests finish"
                          % (rss >> 20, int(REFUSE_AT * 100), self.max_rss >> 20))
