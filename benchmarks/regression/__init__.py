"""Digests that prove a change moved nothing: decoding tokens and training losses, compared across checkouts."""
