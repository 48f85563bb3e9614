"""The HTTP server: http (adapter) -> endpoints -> service (pool, supersede) -> engine."""
