"""Tests of draftforge/decode: the harness, every method, lossless against the target's own generate()."""
