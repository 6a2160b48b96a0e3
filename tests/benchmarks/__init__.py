"""Tests of the benchmark scripts' own logic, on tiny random models."""
