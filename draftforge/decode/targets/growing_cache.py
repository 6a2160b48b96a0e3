"""A KV cache whose appends cost the new rows, not the whole cache.

transformers' `DynamicLayer.update` appends with `torch.cat`, so every forward copies the layer's whole cache: at
8k tokens of SmolLM2 context that is 2 x 30 layers x 3 MB per decoded token, more memory traffic than the
attention itself. `GrowingLayer` keeps keys and values in a buffer with spare rows (kernels/kv_buffer.py, the one
the EAGLE-3 head's cache uses; grown by an eighth when full) and hands attention views of the filled part.
Trimming to the accepted path moves only the rows that follow the kept prefix. The values attention reads are the same as with `torch.cat`, so logits are bitwise equal
(tests/decode/test_growing_cache.py).

Legend: B batch, H kv heads, L cached tokens, C capacity (L <= C), D head dim.
"""

from __future__ import annotations

import torch

from draftforge.kernels.kv_buffer import GrowingKV

try:  # transformers >= 4.56: a cache is a list of per-layer objects
    from transformers.cache_utils import DynamicLayer
except ImportError:  # older transformers: the plain DynamicCache is used as it is
    DynamicLayer = None

MIN_CAPACITY = 256


if DynamicLayer is not None:

    class GrowingLayer(DynamicLayer):
        """A DynamicLayer over a GrowingKV buffer (see the module doc)."""

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            super().lazy_initialization(key_states, value_states)
            self.buffer = GrowingKV.like(key_states, MIN_CAPACITY)

        @property
        def keys_BHCD(self) -> torch.Tensor:  # the whole buffer, spare rows included
            return self.buffer.k

        def _views(self) -> None:
            self.keys, self.values = self.buffer.view()

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.buffer.append(key_states, value_states)
            self._views()
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.buffer.length if self.is_initialized else 0

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove > 0:
                raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
            if tokens_to_remove == 0 or not self.is_initialized:
                return
            self.buffer.truncate(max(0, self.buffer.length + tokens_to_remove))
            self._views()

        @torch.inference_mode()  # the buffer was made in the forward's inference mode
        def keep_rows(self, n_prefix: int, extra_K: torch.Tensor) -> None:
            """Keep rows [0, n_prefix) and then rows n_prefix + extra_K (in that order); only those move."""
            if not self.is_initialized:
                return
            self.buffer.keep_rows(n_prefix, extra_K)
            self._views()

        def reset(self) -> None:
            super().reset()
            self.buffer = None

        def batch_repeat_interleave(self, repeats: int) -> None:
            raise NotImplementedError("draftforge's growing KV cache serves batch size 1")

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            raise NotImplementedError("draftforge's growing KV cache serves batch size 1")


def growing(cache):
    """`cache` (a fresh DynamicCache) with its plain full-attention layers replaced by GrowingLayer; sliding-window
    and other layer kinds, and caches of transformers without per-layer objects, stay as they are."""
    layers = getattr(cache, "layers", None)
    if DynamicLayer is None or not isinstance(layers, list):
        return cache
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in layers]
    return cache
