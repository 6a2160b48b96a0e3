"""Tests of draftforge/data: sources, packing, chat, token rows, generate, logits cache."""
