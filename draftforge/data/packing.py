"""Packing token sequences into fixed-size blocks.

Text: documents (each already ending in EOS) are concatenated into one stream and cut
every `block_size` tokens; only the final block is padded. Chat: conversations (each at
most `block_size` tokens) are packed greedily in order; a conversation that does not fit
in the current block's remaining room starts a new block, and the room it leaves is padded.
Padding is `pad_id` with label -100. Legend: N = tokens, B = blocks, S = block_size.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from draftforge.data.chat import IGNORE_INDEX


def flatten_lists(column) -> np.ndarray:
    """A (chunked) arrow list<int> column -> one flat int64 array, in row order."""
    flat = pc.list_flatten(column)
    return np.asarray(flat.to_numpy(zero_copy_only=False), dtype=np.int64)


def pack_stream(tokens_N: np.ndarray, labels_N: np.ndarray, block_size: int, pad_id: int):
    """Cut a token stream into blocks; pad the last one. Returns (input_ids_BS, labels_BS)."""
    n_blocks = -(-len(tokens_N) // block_size)
    input_ids_BS = np.full((n_blocks, block_size), pad_id, dtype=np.int64)
    labels_BS = np.full((n_blocks, block_size), IGNORE_INDEX, dtype=np.int64)
    input_ids_BS.reshape(-1)[: len(tokens_N)] = tokens_N
    labels_BS.reshape(-1)[: len(labels_N)] = labels_N
    return input_ids_BS, labels_BS


def pack_greedy(input_ids: list[list[int]], labels: list[list[int]], block_size: int, pad_id: int):
    """Whole sequences (each <= block_size) into blocks, in order. Returns (input_ids_BS, labels_BS)."""
    starts, block, used = [], 0, 0
    for seq in input_ids:
        if used + len(seq) > block_size:
            block, used = block + 1, 0
        starts.append((block, used))
        used += len(seq)
    n_blocks = block + 1 if input_ids else 0
    input_ids_BS = np.full((n_blocks, block_size), pad_id, dtype=np.int64)
    labels_BS = np.full((n_blocks, block_size), IGNORE_INDEX, dtype=np.int64)
    for (b, at), seq, lab in zip(starts, input_ids, labels):
        input_ids_BS[b, at : at + len(seq)] = seq
        labels_BS[b, at : at + len(lab)] = lab
    return input_ids_BS, labels_BS


def blocks_table(input_ids_BS: np.ndarray, labels_BS: np.ndarray) -> pa.Table:
    """Blocks -> an arrow table of fixed-size list<int32> columns `input_ids`, `labels`."""
    size = input_ids_BS.shape[1]

    def column(a):
        return pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1).astype(np.int32)), size)

    return pa.table({"input_ids": column(input_ids_BS), "labels": column(labels_BS)})


class StreamPacker:
    """Incremental `pack_stream` for streaming: feed documents, get full blocks as dicts."""

    def __init__(self, block_size: int, pad_id: int):
        self.block_size, self.pad_id = block_size, pad_id
        self.ids: list[int] = []
        self.labels: list[int] = []

    def add(self, input_ids: list[int], labels: list[int]):
        self.ids.extend(input_ids)
        self.labels.extend(labels)
        while len(self.ids) >= self.block_size:
            yield {"input_ids": self.ids[: self.block_size], "labels": self.labels[: self.block_size]}
            del self.ids[: self.block_size], self.labels[: self.block_size]

    def add_whole(self, input_ids: list[int], labels: list[int]):
        """Greedy packing: a sequence that does not fit in the current block starts the next one."""
        if len(self.ids) + len(input_ids) > self.block_size:
            yield from self.flush()
        yield from self.add(input_ids, labels)

    def flush(self):
        if self.ids:
            pad = self.block_size - len(self.ids)
            yield {"input_ids": self.ids + [self.pad_id] * pad, "labels": self.labels + [IGNORE_INDEX] * pad}
            self.ids, self.labels = [], []
