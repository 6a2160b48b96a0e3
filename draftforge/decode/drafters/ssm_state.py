"""Recurrent-state bookkeeping for SSM drafters (Mamba / Mamba2 caches of transformers >= 5).

transformers keeps, per layer, a conv state [B, C, K] and an SSM state ([B, D, N] Mamba,
[B, H, P, N] Mamba2) that its single-token step updates in place. Tree drafting by batch
expansion (Mamba Drafters §4.1) needs the states of every depth: for a tree shape we allocate, once,
buffers with one row per fed node (a node with children) per depth, B_i = N1·…·N_i for a configuration
(N1..Nγ); depth i's buffer is filled by gathering its nodes' parents' rows from depth i-1 and is then
stepped in place (by a StaticStep of
cuda_graphs.py bound to that buffer, so the buffer addresses never change and the step can be
a CUDA graph). Chain drafting is the configuration (1,)*K, so "the state at each draft position"
is depth i's buffer. Data only moves by copies into these buffers, never by rebinding tensors.

Legend: B batch (tree nodes at one depth).
"""

from __future__ import annotations

import torch

from draftforge.decode.tree_shape import TreeShape


# tokens per forward when an SSM drafter encodes a prompt, by device: small pieces on CPU cost less memory and less
# time, on a GPU each piece is a train of small kernel launches (measurements: drafters/mamba.py)
PROMPT_CHUNK = {"cpu": 512, "cuda": 8192}


def prompt_chunk(device) -> int:
    """PROMPT_CHUNK for `device` (a torch.device); an accelerator other than CUDA gets CUDA's."""
    return PROMPT_CHUNK.get(device.type, PROMPT_CHUNK["cuda"])


def layer_states(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(conv, ssm) state tensors of every layer, as the model will read them next step."""
    return [(layer.conv_states[0], layer.recurrent_states[0]) for layer in cache.layers]


def copy_states(dst: list[tuple[torch.Tensor, torch.Tensor]], src: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy per-layer (conv, ssm) states into dst's tensors in place (their addresses stay fixed)."""
    for (conv, ssm), (conv_src, ssm_src) in zip(dst, src):
        conv.copy_(conv_src)
        ssm.copy_(ssm_src)


class StateBank:
    """Per-depth state buffers for one tree shape, allocated once and reused every round."""

    def __init__(self, shape: TreeShape, live: list[tuple[torch.Tensor, torch.Tensor]]):
        self.shape = shape
        # depth 0 = the root (batch 1); depths 1..γ-1 hold their fed draft nodes (depth γ is never fed)
        sizes = [len(nodes) for nodes in shape.fed]
        self.buffers = [
            [(conv.new_zeros((b, *conv.shape[1:])), ssm.new_zeros((b, *ssm.shape[1:]))) for conv, ssm in live]
            for b in sizes
        ]
        self.parent_index = [None] + [
            torch.tensor(shape.parent_rows(i), device=live[0][0].device) for i in range(1, len(sizes))
        ]

    def save_root(self, live) -> None:
        copy_states(self.buffers[0], live)

    def expand(self, depth: int) -> None:
        """Fill depth's buffer with copies of each node's parent state (the caller then steps it)."""
        index_B = self.parent_index[depth]
        for (conv_buf, ssm_buf), (conv_prev, ssm_prev) in zip(self.buffers[depth], self.buffers[depth - 1]):
            torch.index_select(conv_prev, 0, index_B, out=conv_buf)
            torch.index_select(ssm_prev, 0, index_B, out=ssm_buf)

    def restore(self, live, depth: int, row: int) -> None:
        """Copy the state of node `row` at `depth` into the live batch-1 tensors."""
        copy_states(live, [(conv[row : row + 1], ssm[row : row + 1]) for conv, ssm in self.buffers[depth]])
