"""Measurement scripts, run from the repository root as `python -m benchmarks.GROUP.NAME` (index: README.md)."""
