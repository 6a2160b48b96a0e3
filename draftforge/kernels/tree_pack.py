"""Tree structure for the tree scan, built once per draft tree and shared by every layer.

A packed tree of N nodes (topological order, ``parents[i] < i``, one root with parent −1) is
described to the scan by three index tensors that depend only on ``parents`` and the conv width:

* ``on_path_BNN``: [b, i, s] true when s is on the root path of i (i itself included);
* ``words_BNW``: the same mask packed 32 bits per int32 word (what the kernel reads);
* ``window_BNK``: for each node, the K columns its causal conv reads, oldest first, indexing
  ``[prefix conv state (K columns) | node 0 .. node N−1]``: the node, its K−1 nearest ancestors,
  then the accepted prefix's conv state when the path is shorter than K.

Building them costs a few small launches; a verification step builds them once and passes the
``PackedTree`` to every layer, so each layer's scan is one kernel launch.

Legend: B trees in the batch, N nodes, K conv width, W 32-bit words per mask row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftforge.errors import DraftforgeError


class TreeScanError(DraftforgeError, ValueError):
    """Bad tree or bad tensors given to the tree scan."""


@dataclass(frozen=True)
class PackedTree:
    parents_BN: torch.Tensor  # int64
    on_path_BNN: torch.Tensor  # bool
    words_BNW: torch.Tensor  # int32
    window_BNK: torch.Tensor  # int32

    @property
    def shape(self) -> tuple[int, int, int]:
        """(batch, nodes, conv width)."""
        return (*self.parents_BN.shape, self.window_BNK.shape[-1])


def validate_parents(parents, batch: int, n_nodes: int, device) -> torch.Tensor:
    """Check that ``parents`` is one topologically ordered tree per batch row; return [B, N] int64."""
    parents_BN = torch.as_tensor(parents, dtype=torch.long, device=device)
    if parents_BN.dim() == 1:
        parents_BN = parents_BN.unsqueeze(0).expand(batch, -1)
    if parents_BN.shape != (batch, n_nodes):
        raise TreeScanError(
            f"parents has shape {tuple(parents_BN.shape)} but the packed tree has batch {batch} and "
            f"{n_nodes} nodes: pass parents as [N] or [B, N]."
        )
    if n_nodes == 0:
        raise TreeScanError("the tree is empty: pass at least the root node.")
    bad = (parents_BN < -1) | (parents_BN >= n_nodes)
    if bad.any():
        b, i = bad.nonzero()[0].tolist()
        raise TreeScanError(
            f"parent index {parents_BN[b, i].item()} of node {i} (tree {b}) is out of range: "
            f"use -1 for the root or an index in [0, {n_nodes})."
        )
    roots_B = (parents_BN == -1).sum(dim=1)
    if (roots_B != 1).any():
        b = int((roots_B != 1).nonzero()[0])
        raise TreeScanError(
            f"tree {b} has {int(roots_B[b])} roots (parent -1): a packed tree has exactly one root."
        )
    later = parents_BN >= torch.arange(n_nodes, device=device)
    if later.any():
        b, i = later.nonzero()[0].tolist()
        raise TreeScanError(
            f"node {i} (tree {b}) has parent {parents_BN[b, i].item()}, which is not before it: "
            "pack the tree in topological order (parent before child)."
        )
    return parents_BN


def ancestor_mask(parents_BN: torch.Tensor) -> torch.Tensor:
    """[B, N, N] bool, [b, i, s] true when s is on the root path of i (itself included)."""
    batch, n_nodes = parents_BN.shape
    eye_NN = torch.eye(n_nodes, dtype=torch.float32, device=parents_BN.device)
    reach_BNN = eye_NN.expand(batch, -1, -1).clone()
    has_parent = parents_BN >= 0
    b_idx, i_idx = has_parent.nonzero(as_tuple=True)
    reach_BNN[b_idx, i_idx, parents_BN[b_idx, i_idx]] = 1.0
    # Transitive closure by repeated squaring: after k steps paths of length 2^k are covered.
    for _ in range(max(1, math.ceil(math.log2(max(n_nodes, 2))))):
        reach_BNN = (reach_BNN @ reach_BNN).clamp_(max=1.0)
    return reach_BNN > 0


def pack_bitmask(on_path_BNN: torch.Tensor) -> torch.Tensor:
    """Pack the ancestor mask into int32 words [B, N, W], bit s % 32 of word s // 32."""
    batch, n_nodes, _ = on_path_BNN.shape
    n_words = (n_nodes + 31) // 32
    padded = F.pad(on_path_BNN.long(), (0, n_words * 32 - n_nodes))
    shifts = torch.arange(32, device=on_path_BNN.device, dtype=torch.long)
    words = (padded.view(batch, n_nodes, n_words, 32) << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # reinterpret as signed int32
    return words.to(torch.int32).contiguous()


def conv_windows(parents_BN: torch.Tensor, width: int) -> torch.Tensor:
    """[B, N, K] columns of ``[prefix conv state | nodes]`` that each node's causal conv reads.

    Column t < K is prefix state column t (oldest first); column K + i is node i. Walking up one
    step from node i goes to its parent, from the root to the last prefix column, and from a prefix
    column to the one before it: the same window transformers' single-token step keeps.
    """
    batch, n_nodes = parents_BN.shape
    device = parents_BN.device
    node_up_BN = torch.where(parents_BN >= 0, parents_BN + width, torch.full_like(parents_BN, width - 1))
    state_up_BK = (torch.arange(width, device=device) - 1).clamp(min=0).expand(batch, width)
    step_up_BT = torch.cat([state_up_BK, node_up_BN], dim=1)  # the column one token earlier
    cols = [(torch.arange(n_nodes, device=device) + width).expand(batch, n_nodes)]
    for _ in range(width - 1):
        cols.append(step_up_BT.gather(1, cols[-1]))
    return torch.stack(cols[::-1], dim=-1).to(torch.int32).contiguous()  # oldest tap first


def pack_tree(parents, batch: int, n_nodes: int, conv_width: int, device) -> PackedTree:
    """Validate ``parents`` ([N] or [B, N], or a PackedTree to check) and build the index tensors."""
    if isinstance(parents, PackedTree):
        if parents.shape != (batch, n_nodes, conv_width) or parents.parents_BN.device != torch.device(device):
            raise TreeScanError(
                f"the PackedTree was built for (batch, nodes, conv width) {parents.shape} on "
                f"{parents.parents_BN.device}, but the inputs are {(batch, n_nodes, conv_width)} on {device}."
            )
        return parents
    parents_BN = validate_parents(parents, batch, n_nodes, device)
    on_path_BNN = ancestor_mask(parents_BN)
    return PackedTree(parents_BN, on_path_BNN, pack_bitmask(on_path_BNN), conv_windows(parents_BN, conv_width))


def chain_tree(length: int, conv_width: int, device) -> PackedTree:
    """A single path of ``length`` nodes (what replay scans)."""
    return pack_tree(list(range(-1, length - 1)), 1, length, conv_width, device)
