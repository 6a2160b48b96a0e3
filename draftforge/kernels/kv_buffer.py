"""Keys and values in a buffer with spare rows along the sequence (dim -2), doubled when full: an append writes
only the new rows (no torch.cat of the whole cache), dropping the newest rows is free, and keeping a prefix plus
some later rows moves only those rows. Used by the EAGLE-3 head's own cache ([G, K, E]) and by the KV-cache
target's transformers layers ([B, H, K, D], decode/targets/growing_cache.py)."""

from __future__ import annotations

import math

import torch


class GrowingKV:
    """`prefix`: the dims before the sequence (an int = one dim); tensors are [*prefix, rows, head_dim]."""

    def __init__(self, prefix, head_dim: int, dtype, device, capacity: int = 256):
        prefix = (prefix,) if isinstance(prefix, int) else tuple(prefix)
        self.k = torch.empty(*prefix, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.length = 0

    @classmethod
    def like(cls, rows: torch.Tensor, capacity: int) -> GrowingKV:
        """An empty buffer for tensors shaped as `rows` (any number of rows)."""
        return cls(rows.shape[:-2], rows.shape[-1], rows.dtype, rows.device, capacity)

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        need = self.length + k_new.shape[-2]
        if need > self.k.shape[-2]:
            grown = max(need, 2 * self.k.shape[-2])
            for name in ("k", "v"):
                old = getattr(self, name)
                new = old.new_empty(*old.shape[:-2], grown, old.shape[-1])
                new[..., : self.length, :] = old[..., : self.length, :]
                setattr(self, name, new)
        self.k[..., self.length : need, :] = k_new
        self.v[..., self.length : need, :] = v_new
        self.length = need

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[..., : self.length, :], self.v[..., : self.length, :]

    def truncate(self, length: int) -> None:
        self.length = length

    def keep_rows(self, n_prefix: int, extra: torch.Tensor) -> None:
        """Keep rows [0, n_prefix) and then rows n_prefix + extra (in that order); only those move."""
        rows = n_prefix + extra
        for buf in (self.k, self.v):
            buf[..., n_prefix : n_prefix + len(extra), :] = buf.index_select(-2, rows)
        self.length = n_prefix + len(extra)

    def nbytes(self) -> int:
        """Bytes of the rows held (not the spare capacity)."""
        return 2 * self.length * math.prod(self.k.shape[:-2]) * self.k.shape[-1] * self.k.element_size()
