"""Tests of the package's top-level modules: the CLI, demo, testbed, recipes, loading, export, runtime."""
