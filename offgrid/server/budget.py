"""What one request may make the front hold, and the front's own memory ceiling.

Token probabilities are the one part of a response that grows much faster
than its text: with ``n_probs`` N each generated token carries N + 1 entries,
and the front held, per entry, about 1.2 KB at its peak (measured: SmolLM2,
four prompts of 300 tokens with n_probs 20, 28-33 MB more front RSS for a
2.2 MB response; with n_probs 1024 that was the issue's +1.08 MB per token).
So:

  * the fields are capped (``params.MAX_N_PROBS``: 20 alternatives, OpenAI's
    own bound on ``top_logprobs``);
  * a response that is not streamed holds every entry until it is written:
    its worst case (jobs x tokens x (alternatives + 1)) must fit in
    MAX_PROB_ENTRIES, 131072 entries, about 150 MB at the peak, else a 400
    that says how to fit (fewer tokens, alternatives, prompts or choices, or
    stream it);
  * a streamed response holds nothing once written, but pieces wait in the
    front while its client reads slowly: MAX_BUFFERED bytes per job, past
    which the job is cancelled (server/workers.py) rather than buffered
    without end;
  * the front refuses new work with 503 while its own RSS is past three
    quarters of ``--front-max-rss`` and other requests run (FrontMemory), so
    what runs has room to finish below the ceiling; reading the shelf and
    /health still answer.  With nothing else running the request is taken
    whatever the RSS: the memory is then no request's but what the allocator
    kept (glibc keeps freed blocks of up to 32 MB in the heap once one such
    was freed; measured, an 8 MB body left the front 14 MiB larger for good),
    and refusing on it would refuse forever.
"""

import gc
import os
import threading
import time

from .errors import BadRequest, Unavailable

MAX_PROB_ENTRIES = 1 << 17
# bytes of stream frames one job may have waiting for its client
MAX_BUFFERED = 8 << 20
# the default --front-max-rss, MiB (a front serving normally holds 30 to 60)
DEFAULT_FRONT_MAX_RSS = 4096
# the share of the ceiling past which new work is refused
REFUSE_AT = 0.75


def check_probs(gen, n_jobs, n_ctx, stream):
    """Refuse (400) a response that would hold more than MAX_PROB_ENTRIES token
    probabilities: ``n_jobs`` generations of ``gen`` (n_predict, or a whole
    context of ``n_ctx`` when unset), not streamed."""
    if not gen.with_probs or stream:
        return
    tokens = gen.n_predict if gen.n_predict > 0 else n_ctx
    per_token = gen.n_probs + 1
    need = n_jobs * tokens * per_token
    if need > MAX_PROB_ENTRIES:
        raise BadRequest(
            "this response would hold up to %d token probabilities (%d generation%s x %d "
            "tokens x %d each), past the %d a response that is not streamed may hold; ask "
            "for fewer tokens (n_predict, max_tokens), fewer alternatives (n_probs, "
            "top_logprobs, logprobs), fewer prompts or choices, or stream it"
            % (need, n_jobs, "" if n_jobs == 1 else "s", tokens, per_token, MAX_PROB_ENTRIES))


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
