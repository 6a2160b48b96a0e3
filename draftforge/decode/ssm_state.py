"""Recurrent-state bookkeeping for SSM drafters (Mamba / Mamba2 caches of transformers >= 5).

transformers keeps, per layer, a conv state [B, C, K] and an SSM state ([B, D, N] Mamba,
[B, H, P, N] Mamba2) that its single-token step updates in place. Tree drafting by batch
expansion (Mamba Drafters §4.1) needs the states of every depth: for a configuration
(N1..Nγ) we allocate, once, buffers of batch B_i = N1·…·N_i per depth; depth i's buffer is filled
by gathering its parents' rows from depth i-1 and is then stepped in place. Chain drafting is the
configuration (1,)*K, so "the state at each draft position" is depth i's buffer.

Legend: B batch (tree nodes at one depth).
"""

from __future__ import annotations

import torch

from draftforge.decode.tree import level_sizes


def layer_states(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(conv, ssm) state tensors of every layer, as the model will read them next step."""
    return [(layer.conv_states[0], layer.recurrent_states[0]) for layer in cache.layers]


def point_cache_at(cache, states: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Make the model read and step these tensors (in place) from now on."""
    for layer, (conv, ssm) in zip(cache.layers, states):
        layer.conv_states[0], layer.recurrent_states[0] = conv, ssm


class StateBank:
    """Per-depth state buffers for one tree configuration, allocated once and reused every round."""

    def __init__(self, widths: tuple[int, ...], live: list[tuple[torch.Tensor, torch.Tensor]]):
        self.widths = widths
        # depth 0 = the root (batch 1); depths 1..γ-1 are the fed draft nodes (depth γ is never fed)
        sizes = [1] + level_sizes(widths)[:-1]
        self.buffers = [
            [(conv.new_empty((b, *conv.shape[1:])), ssm.new_empty((b, *ssm.shape[1:]))) for conv, ssm in live]
            for b in sizes
        ]
        self.parent_index = [None] + [
            torch.arange(sizes[i - 1], device=live[0][0].device).repeat_interleave(widths[i - 1])
            for i in range(1, len(sizes))
        ]

    def save_root(self, live) -> None:
        for (conv_buf, ssm_buf), (conv, ssm) in zip(self.buffers[0], live):
            conv_buf.copy_(conv)
            ssm_buf.copy_(ssm)

    def expand(self, cache, depth: int) -> None:
        """Fill depth's buffer with copies of each node's parent state and let the model step it."""
        index_B = self.parent_index[depth]
        for (conv_buf, ssm_buf), (conv_prev, ssm_prev) in zip(self.buffers[depth], self.buffers[depth - 1]):
            torch.index_select(conv_prev, 0, index_B, out=conv_buf)
            torch.index_select(ssm_prev, 0, index_B, out=ssm_buf)
        point_cache_at(cache, self.buffers[depth])

    def restore(self, cache, live, depth: int, row: int) -> None:
        """Copy the state of node `row` at `depth` into the live batch-1 tensors."""
        for (conv_buf, ssm_buf), (conv, ssm) in zip(self.buffers[depth], live):
            conv.copy_(conv_buf[row : row + 1])
            ssm.copy_(ssm_buf[row : row + 1])
        point_cache_at(cache, live)
