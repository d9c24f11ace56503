"""The HTTP edge, before any route's own work: API keys, reading and validating
bodies, error shapes, connections and their limits, browser safety, SSE framing,
start-up and draining."""
