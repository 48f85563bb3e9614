"""Metrics: the cumulative counters behind /metrics."""

import threading
import time

from ..request import FinishReason


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
            if c.finish_reason is FinishReason.CANCELLED:
                self.cancelled += 1

    def error(self):
        with self._lock:
            self.errors += 1
