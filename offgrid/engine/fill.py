"""IdleFill: what a prompt budget dropped, brought into the cache while the worker is idle.

promptfit.fit drops extra chunks and far lines of a FIM prompt whose
evaluation would not fit ``t_max_prompt_ms``.  The editor's next request
holds them again, and nothing has put them in the cache since, so left
alone every request drops them again: measured on Qwen2.5-Coder-0.5B, 2
cores (~155 prompt tokens/s), the bench's editor replay answered every
pause from ~35 of its ~2,000 prompt tokens, the cursor's line and little
else, for as long as it ran.

So after a request that dropped something, the worker evaluates that
request's whole prompt, as laid out before the fit, whenever no frame is
being served: a few tokens a decode (ChatSession.fill), each step kept once
done.  Every call or generate frame that comes in stops it first (the
decode's abort flag: within one graph node), losing at most the step under
way, and it goes on from there when the worker is idle again.  The fit of
the next request finds those parts cached, and a cached part is free to
keep (promptfit drops only what costs), so the prompt grows back to the
whole context over the editor's pauses.

One fill is wanted at a time: a newer request's prompt replaces an older
one's, which the editor has moved on from.
"""

import logging
import threading

from ..request import RequestCancel

log = logging.getLogger("offgrid.fill")

# Tokens a fill decode takes: as many as the measured prompt speed evaluates
# in STEP_MS (an editor's keys come ~100 ms apart, and a step cut short is
# lost), within these bounds (smaller batches run far under the speed).
STEP_MS = 100.0
MIN_STEP, MAX_STEP = 16, 256


class IdleFill:
    """The fill a worker wants, and the one it runs when no frame is being served.

    ``busy()`` when a frame's job is read (it stops a running fill), ``wait()``
    before the job touches a session, ``done()`` when the job ends; the fill
    runs on ``jobs`` (a jobs.Threads) once the last job is done.
    """

    def __init__(self, jobs, rate):
        self._jobs = jobs
        self._rate = rate               # promptfit.PromptRate: the step's size
        self._lock = threading.Lock()
        self._busy = 0                  # jobs read and not done
        self._wanted = None             # (session, tokens, cache_reuse)
        self._cancel = None             # the running fill's, or None
        self._stopped = threading.Event()
        self._stopped.set()
        self.n_filled = 0               # fills that got the whole prompt in (tests, logs)

    def want(self, session, tokens, cache_reuse):
        """Fill ``session``'s cache with ``tokens`` when the worker is idle."""
        with self._lock:
            self._wanted = (session, list(tokens), cache_reuse)

    def busy(self):
        """A job was read: stop the fill under way (at once, on the reading thread)."""
        with self._lock:
            self._busy += 1
            if self._cancel is not None:
                self._cancel.cancel("request")

    def wait(self):
        """Until no fill runs (so the job may use the sessions)."""
        self._stopped.wait()

    def done(self):
        """A job ended: when it was the last, the wanted fill starts."""
        with self._lock:
            self._busy -= 1
            if self._busy or self._wanted is None or self._cancel is not None:
                return
            wanted, self._cancel = self._wanted, RequestCancel()
            self._stopped.clear()
        self._jobs.submit(self._run, wanted, self._cancel)

    def _run(self, wanted, cancel):
        session, tokens, cache_reuse = wanted
        complete = False
        try:
            if not session.closed:
                step = int(self._rate.cost_of(STEP_MS)) if self._rate.rate else MIN_STEP
                complete = session.fill(tokens, cancel, cache_reuse,
                                        max(MIN_STEP, min(MAX_STEP, step)))
        except Exception:       # the next request meets the same cache and says why
            log.exception("the idle fill failed")
        finally:
            with self._lock:
                # wanted again only if a request cut it short; done, or
                # impossible (closed, too long, an error), it is forgotten
                if self._wanted is wanted and (complete or not cancel.cancelled):
                    self._wanted = None
                self.n_filled += complete
                self._cancel = None
                self._stopped.set()
