"""Tests of draftforge/models: builders, GGUF, hybrids, draft vocabularies, the Mamba2 step."""
