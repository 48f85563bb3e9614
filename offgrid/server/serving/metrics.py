"""Metrics: the cumulative counters behind /metrics.

Handler threads count into one Metrics while /metrics reads it from another;
every read and write is under the one lock, and the reader takes a
``snapshot`` rather than walking the live counters (a dict that another
thread inserts into while it is iterated raises RuntimeError).
"""

import threading
import time
from dataclasses import dataclass, field
from typing import Dict

from ...request import FinishReason


@dataclass(frozen=True)
class MetricsSnapshot:
    """The counters at one moment, consistent with each other; the reader's own copy."""
    requests: Dict[str, int] = field(default_factory=dict)     # endpoint -> count
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    cached_tokens: int = 0
    predicted_tokens: int = 0
    predicted_seconds: float = 0.0
    cancelled: int = 0
    errors: int = 0
    started: float = 0.0
    n_decode: int = 0               # llama_decode calls
    draft_tokens: int = 0           # speculation (--spec-type): tokens drafted,
    draft_accepted: int = 0         # ... and of them, those that came true
    draft_steps: int = 0            # ... in this many verify decodes
    n_tokens_max: int = 0           # longest session cache seen (prompt + generation)
    # tokens per second since the previous /metrics read (llama-server's buckets)
    prompt_rate: float = 0.0
    predicted_rate: float = 0.0


class Metrics:
    """Cumulative counters, updated under one lock."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests = {}              # endpoint -> count
        self.prompt_tokens = 0
        self.prompt_seconds = 0.0
        self.cached_tokens = 0
        self.predicted_tokens = 0
        self.predicted_seconds = 0.0
        self.cancelled = 0
        self.errors = 0
        self.started = time.time()
        self.n_decode = 0
        self.draft_tokens = 0
        self.draft_accepted = 0
        self.draft_steps = 0
        self.n_tokens_max = 0
        self._bucket = [0, 0.0, 0, 0.0]     # prompt tokens, seconds; predicted tokens, seconds

    def request(self, endpoint):
        with self._lock:
            self.requests[endpoint] = self.requests.get(endpoint, 0) + 1

    def completion(self, c):
        with self._lock:
            u = c.usage
            self.prompt_tokens += u.evaluated_tokens
            self.cached_tokens += u.cached_tokens
            self.prompt_seconds += u.prompt_ms / 1000.0
            self.predicted_tokens += u.completion_tokens
            self.predicted_seconds += u.generation_ms / 1000.0
            self.n_decode += u.n_decode
            self.draft_tokens += u.draft_tokens
            self.draft_accepted += u.draft_accepted
            self.draft_steps += u.draft_steps
            self.n_tokens_max = max(self.n_tokens_max, c.n_cached)
            b = self._bucket
            b[0] += u.evaluated_tokens
            b[1] += u.prompt_ms / 1000.0
            b[2] += u.completion_tokens
            b[3] += u.generation_ms / 1000.0
            if c.finish_reason is FinishReason.CANCELLED:
                self.cancelled += 1

    def prompt_work(self, n_tokens, seconds, n_decode, longest=0):
        """Prompt tokens decoded for no generation (embeddings, rerank): counted as
        llama-server counts an embedding task's batches, in the prompt counters,
        the decodes and the longest sequence; nothing predicted."""
        with self._lock:
            self.prompt_tokens += n_tokens
            self.prompt_seconds += seconds
            self.n_decode += n_decode
            self.n_tokens_max = max(self.n_tokens_max, longest)
            self._bucket[0] += n_tokens
            self._bucket[1] += seconds

    def error(self):
        with self._lock:
            self.errors += 1

    def snapshot(self, reset_rates=False):
        """A MetricsSnapshot, read under the lock: what /metrics may iterate.

        ``reset_rates``: the throughput gauges start over (a scrape: llama-server's
        gauges are averages over the time between two scrapes).
        """
        with self._lock:
            b = self._bucket
            rates = dict(prompt_rate=b[0] / b[1] if b[1] > 0 else 0.0,
                         predicted_rate=b[2] / b[3] if b[3] > 0 else 0.0)
            if reset_rates:
                self._bucket = [0, 0.0, 0, 0.0]
            return MetricsSnapshot(
                n_decode=self.n_decode, n_tokens_max=self.n_tokens_max,
                draft_tokens=self.draft_tokens, draft_accepted=self.draft_accepted,
                draft_steps=self.draft_steps, **rates,
                requests=dict(self.requests), prompt_tokens=self.prompt_tokens,
                prompt_seconds=self.prompt_seconds, cached_tokens=self.cached_tokens,
                predicted_tokens=self.predicted_tokens,
                predicted_seconds=self.predicted_seconds, cancelled=self.cancelled,
                errors=self.errors, started=self.started)
