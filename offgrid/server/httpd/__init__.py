"""HTTP plumbing on http.server: connections, reading, limits, streams. Knows no route."""
