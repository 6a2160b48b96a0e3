"""Micro-benchmarks: kernels, drafter steps, training throughput."""
