"""Bytes a decode holds as context state: the target's KV cache (or SSM state) and the drafter's cache or state.

What grows with the context is what a long-context report must show per length (a Transformer drafter's KV
cache grows linearly; a Mamba drafter's state does not). The figures count the rows held, not spare capacity
(the growing KV cache may allocate up to twice what it holds; benchmarks/micro/target_context.py reports both).
Weights are not counted: they do not depend on the context.
"""

from __future__ import annotations

import torch

# the per-layer tensors a transformers cache (>= 4.56: cache.layers) keeps: attention K/V, SSM conv and recurrent
LAYER_STATE_ATTRS = ("keys", "values", "conv_states", "recurrent_states")


def tensor_bytes(x) -> int:
    """Bytes of a tensor, or of the tensors in a (nested) list, tuple or dict; anything else counts 0. A view
    counts its own elements (the held rows of a growing buffer, not its capacity)."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, dict):
        return sum(tensor_bytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(tensor_bytes(v) for v in x)
    return 0


def reported_bytes(holder) -> int | None:
    """holder.cache_bytes() for a Target or Drafter (None when it keeps nothing countable); None for an object
    without the method (a caller's own stand-in drafter need not implement it)."""
    method = getattr(holder, "cache_bytes", None)
    return None if method is None else method()


def cache_bytes(cache) -> int:
    """Bytes held by a transformers cache: every layer's keys and values (attention) and conv / recurrent states
    (SSM layers); 0 for None."""
    if cache is None:
        return 0
    return sum(tensor_bytes(getattr(layer, name, None)) for layer in getattr(cache, "layers", [])
               for name in LAYER_STATE_ATTRS)
