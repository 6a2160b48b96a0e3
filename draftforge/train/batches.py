"""Which rows each process reads at each step: deterministic, resumable, sharded without overlap.

Step s of a run consumes global rows [s*G, (s+1)*G) of an endless stream that walks the data in
a fresh seeded permutation each epoch (map-style) or in stream order (iterable). Process r owns
the global positions p with p % W == r: element j of its micro-step a is position
s*G + (a*B + j)*W + r. The union over processes is the same G rows whatever W is (the loss of a
step is normalised over the whole global batch, so which process holds a row does not matter),
and the data position is simply the step number, valid for any number of processes.

Streaming sources are split with `datasets.distributed.split_dataset_by_node(strategy="examples")`,
which hands process r exactly the stream positions r, r+W, r+2W, ...: each process decodes only
its own rows, and its local row i is global position i*W + r. When a stream ends before the step
budget, `micro_batches` raises `DataExhausted` (a signal the loop turns into a clean finish).
Legend: G = global batch, B = micro-batch, W = processes, A = accumulation steps (G = B*A*W).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch


class DataExhausted(Exception):
    """Signal, not an error: the streaming source has no full global batch for `step` (0-based)."""

    def __init__(self, step: int, rows_read: int):
        super().__init__(f"the stream ended during step {step + 1} after {rows_read} rows on this process")
        self.step, self.rows_read = step, rows_read


class BatchPlan:
    def __init__(self, data, global_batch: int, micro_batch: int, rank: int, world: int, seed: int, collate=None):
        from draftforge.train.spec import tensor_collate

        self.data, self.G, self.B, self.rank, self.W, self.seed = data, global_batch, micro_batch, rank, world, seed
        self.collate = collate or tensor_collate
        if global_batch % (micro_batch * world):
            raise ValueError(f"global batch {global_batch} is not a multiple of {micro_batch} x {world}")
        self.A = global_batch // (micro_batch * world)
        self.streaming = not hasattr(data, "__len__")
        if not self.streaming and len(data) == 0:
            from draftforge.errors import DataError
            raise DataError("the training split has no blocks: add data or lower train.block_size")
        self._perm_cache: dict[int, np.ndarray] = {}
        self._stream = None
        self._local_pos = 0  # next local row index the open stream yields

    def _global_index(self, pos: int) -> int:
        n = len(self.data)
        epoch, i = divmod(pos, n)
        if epoch not in self._perm_cache:
            self._perm_cache = {epoch: np.random.default_rng([self.seed, epoch]).permutation(n)}
        return int(self._perm_cache[epoch][i])

    def rows_for_step(self, step: int) -> list[list[int]]:
        """Global row positions of this process's micro-batches at `step` (0-based)."""
        base = step * self.G
        return [[base + (a * self.B + j) * self.W + self.rank for j in range(self.B)] for a in range(self.A)]

    def micro_batches(self, step: int, device) -> list[dict[str, torch.Tensor]]:
        """This process's micro-batches of `step`: every column of the rows, collated into tensors."""
        if self.streaming:
            rows = self._stream_rows(step)
            chunks = [{k: v[a * self.B:(a + 1) * self.B] for k, v in rows.items()} for a in range(self.A)]
        else:
            chunks = [self.data[[self._global_index(p) for p in positions]] for positions in self.rows_for_step(step)]
        return [self.collate(c, device) for c in chunks]

    # ------------------------------------------------------------------ streaming

    def _local_stream(self):
        """This process's rows in order: global positions rank, rank+W, ... of the source stream."""
        if self.W == 1:
            return iter(self.data)
        try:
            from datasets import IterableDataset
            from datasets.distributed import split_dataset_by_node
        except ImportError:  # pragma: no cover - datasets is a dependency
            IterableDataset = ()
        if isinstance(self.data, IterableDataset):
            return iter(split_dataset_by_node(self.data, rank=self.rank, world_size=self.W, strategy="examples"))
        return itertools.islice(iter(self.data), self.rank, None, self.W)

    def _stream_rows(self, step: int) -> dict[str, list]:
        """Local rows [step*G/W, (step+1)*G/W): the global positions `rows_for_step(step)` names."""
        per_step = self.G // self.W
        start = step * per_step
        if self._stream is None or start < self._local_pos:  # first call, or a step replayed: reopen
            self._stream, self._local_pos = self._local_stream(), 0
        if start > self._local_pos:  # resume: skip the rows earlier steps consumed
            skipped = sum(1 for _ in itertools.islice(self._stream, start - self._local_pos))
            self._local_pos += skipped
            if self._local_pos < start:
                raise DataExhausted(step, self._local_pos)
        rows = list(itertools.islice(self._stream, per_step))
        self._local_pos += len(rows)
        if len(rows) < per_step:
            raise DataExhausted(step, self._local_pos)
        return {k: [r[k] for r in rows] for k in rows[0]}
