"""A target's states at chosen layers over token rows, stored once (`draftforge harvest hidden`), for task eagle3.

A hidden-state cache is a logits cache (data/logits_cache.py: the same manifest, shards, checks and top-k
entries at every position a loss uses) whose manifest has kind "hidden-cache" and adds
  layers        the target layer ids i whose input states (HF hidden_states[i]) are kept, ascending
  num_layers, hidden_size, state_width = len(layers) · hidden_size, state_bytes, store.states (the dtype)
  pad_to        the length every batch was padded to (max_len), or null (each batch to its longest row)
  rows.tokens   the tokens whose states are kept: each row's first min(len, max_len)
and whose shards add
  token_ptr [R+1]  int64                 row a+i owns states token_ptr[i]:token_ptr[i+1]
  states    [N, A] bfloat16 (or float32) the concat over `layers` of hidden_states[i] at each of the row's
                                         positions 0..n-1, in the dtype the target ran in
Storage: N · A · state_bytes + P · (8K + 12) + 16 per row (+ a header per shard); N tokens, P loss positions.
Legend: N tokens of a shard (or a gather), A state width, K top-k, R rows, P positions.
"""

from __future__ import annotations

import numpy as np
import torch

from draftforge.data.logits_cache import HIDDEN_KIND, LogitsCache, check_rows_match
from draftforge.errors import CompatibilityError, DataError

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STORED = {"float32": np.dtype("<f4"), "bfloat16": np.dtype("<u2"), "float16": np.dtype("<f2")}  # as _memmaps reads them


class HiddenCache(LogitsCache):
    """A complete, verified hidden-state cache (one directory, or one per rows file read as one)."""

    KIND, WHAT, RECIPE_KEY = HIDDEN_KIND, "hidden-state cache", "eagle3.hidden_cache"
    COLUMNS = ("cache", "state")
    CHAIN_KEYS = (*LogitsCache.CHAIN_KEYS, "layers", "state_width", "dtype")

    def __init__(self, cache_dirs):
        super().__init__(cache_dirs)
        m = self.manifest
        self.layers, self.state_width = list(m["layers"]), int(m["state_width"])
        self.state_dtype = m["store"]["states"]
        sizes = [len(mm["states"]) for mm in self.maps]
        self.token_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def _check_layout(self, cache_dir, m: dict, maps: list[dict]) -> None:
        super()._check_layout(cache_dir, m, maps)
        for entry, mm in zip(m["shards"], maps):
            a, b = entry["rows"]
            ok = len(mm["token_ptr"]) == b - a + 1 and int(mm["token_ptr"][-1]) == len(mm["states"])
            if not ok or mm["states"].shape[1:] != (m["state_width"],):
                raise DataError(f"{self.WHAT} shard {cache_dir / entry['file']} does not hold the states of rows "
                                f"{a}..{b}, {m['state_width']} values per token, as its manifest says; {self.fix}")
            want = STORED.get(m["store"]["states"])
            if want is not None and mm["states"].dtype != want:
                raise DataError(f"{self.WHAT} shard {cache_dir / entry['file']} stores its states as "
                                f"{mm['states'].dtype.str[1:]}, but its manifest says {m['store']['states']} "
                                f"({want.str[1:]}): the shard is not this harvest's; {self.fix}")

    def block_columns(self, row: int, n_tokens: int) -> dict[str, list[int]]:
        """The logits cache's `cache` column, and `state`: the global index of each token's states (-100: none)."""
        s, a, b = self.row_span(row, "token_ptr")
        first = int(self.token_starts[s]) + a
        state = [first + j if j < b - a else -100 for j in range(n_tokens)]
        return {**super().block_columns(row, n_tokens), "state": state}

    def check_rows(self, rows: list[dict], block_size: int) -> None:
        """The logits cache's checks, then: each row's states are there for every token a block reads of it."""
        check_rows_match(self, rows, block_size)
        for i, row in enumerate(rows):
            _, a, b = self.row_span(i, "token_ptr")
            if b - a != min(len(row["input_ids"]), self.max_len):
                raise DataError(f"{row['where']}: {self.WHAT} {self.name} holds {b - a} tokens of states for row {i}, "
                                f"which has {len(row['input_ids'])}; the rows changed since the harvest: harvest again")
            if block_size > self.max_len and len(row["input_ids"]) > self.max_len:
                raise DataError(f"{self.WHAT} {self.name} holds states of each row's first {self.max_len} tokens "
                                f"(--max-len {self.max_len}), but train.block_size is {block_size} and {row['where']} "
                                f"has {len(row['input_ids'])}; harvest with --max-len {block_size} or lower "
                                "train.block_size")

    def states(self, index_N: np.ndarray) -> torch.Tensor:
        """The stored states [N, A] of global token indices index_N, in the stored dtype."""
        got = self.take(index_N, self.token_starts, ("states",))["states"]
        if self.state_dtype == "bfloat16":  # stored as its bits (numpy has no bfloat16)
            return torch.from_numpy(got.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(got)

    def check_layers(self, layers: list[int], where: str, settable: bool = True) -> None:
        """CompatibilityError unless the cache holds the states of exactly `layers` (what the head fuses); `where`
        names them, and `settable` says whether the recipe may choose others (a fine-tuned head's are its own)."""
        if list(layers) != self.layers:
            fix = f"set {where}: {self.layers}, or harvest again" if settable else "harvest again"
            raise CompatibilityError(f"{self.WHAT} {self.name} holds the states entering target layers {self.layers}, "
                                     f"but {where} is {list(layers)}; {fix} with --layers "
                                     f"{','.join(map(str, layers))}")
