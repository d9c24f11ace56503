"""Benchmark tools: `python -m bench.offline` (engine throughput against transformers on
the same weights) and `python -m bench.serve` (online load against any
OpenAI-compatible server). Both print a table and write JSON (and PNG plots)."""
