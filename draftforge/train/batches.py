"""Which rows each process reads at each step: deterministic, resumable, sharded without overlap.

Step s of a run consumes global rows [s*G, (s+1)*G) of an endless stream that walks the data in
a fresh seeded permutation each epoch (map-style) or in stream order (iterable). Within a step,
micro-step a of process r takes rows [a*W*B + r*B, a*W*B + (r+1)*B), so the union over processes
is the same set of rows whatever W is, and the data position is simply the step number.
"""

from __future__ import annotations


import numpy as np
import torch


class BatchPlan:
    def __init__(self, data, global_batch: int, micro_batch: int, rank: int, world: int, seed: int):
        self.data, self.G, self.B, self.rank, self.W, self.seed = data, global_batch, micro_batch, rank, world, seed
        self.streaming = not hasattr(data, "__len__")
        if not self.streaming and len(data) == 0:
            from draftforge.errors import DataError
            raise DataError("the training split has no blocks: add data or lower train.block_size")
        self._perm_cache: dict[int, np.ndarray] = {}
        self._stream = None
        self._stream_pos = 0

    @property
    def reshardable(self) -> bool:
        return True  # the position is a global row count, valid for any number of processes

    def _global_index(self, pos: int) -> int:
        n = len(self.data)
        epoch, i = divmod(pos, n)
        if epoch not in self._perm_cache:
            self._perm_cache = {epoch: np.random.default_rng([self.seed, epoch]).permutation(n)}
        return int(self._perm_cache[epoch][i])

    def rows_for_step(self, step: int) -> list[list[int]]:
        """Global row positions of this process's micro-batches at `step` (0-based)."""
        A = self.G // (self.B * self.W)
        base = step * self.G
        return [[base + a * self.W * self.B + self.rank * self.B + j for j in range(self.B)] for a in range(A)]

    def micro_batches(self, step: int, device) -> list[dict[str, torch.Tensor]]:
        out = []
        for positions in self.rows_for_step(step):
            rows = self._stream_rows(positions) if self.streaming else self.data[
                [self._global_index(p) for p in positions]]
            out.append({k: torch.tensor(rows[k], device=device) for k in ("input_ids", "labels")})
        return out

    def _stream_rows(self, positions: list[int]) -> dict[str, list]:
        # Every process walks the whole stream and keeps its own rows; this is exact and resumable
        # (a resumed run skips forward), at the cost of reading rows other processes use.
        want = dict.fromkeys(positions)
        if self._stream is None or positions[0] < self._stream_pos:
            self._stream, self._stream_pos = iter(self.data), 0
        rows = {}
        while len(rows) < len(want):
            try:
                row = next(self._stream)
            except StopIteration:
                from draftforge.errors import DataError
                raise DataError(f"the streaming dataset ended after {self._stream_pos} blocks, before the step "
                                "budget; lower train.max_steps or add data") from None
            if self._stream_pos in want:
                rows[self._stream_pos] = row
            self._stream_pos += 1
        ordered = [rows[p] for p in positions]
        return {k: [r[k] for r in ordered] for k in ("input_ids", "labels")}


