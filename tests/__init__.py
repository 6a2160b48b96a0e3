"""The test suite, laid out like the package (tests/decode tests draftforge/decode, ...); shared test models
and helpers are in tests/fixtures, pytest fixtures in the conftest.py files."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the repository root
