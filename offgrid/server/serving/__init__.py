"""Serving requests: the Service, supersede, the disconnect watcher, the counters."""
