"""Benchmarks behind ``sparsecomm bench ...``: each returns a result dict (rows + run-level figures)
that the CLI prints as a table and writes as JSON."""
