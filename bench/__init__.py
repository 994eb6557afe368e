"""Benchmarks: tokenmill against its peers (`python -m bench`), the raw limit, engine latency."""
