"""Tree scan: one pass of a Mamba2 conv1d + SSM over a packed token tree (STree, Wu et al.).

Length (~450 lines): the Triton kernel, its PyTorch reference and the launcher stay in one file so the reference the
tests hold the kernel to sits beside it.

A tree of N nodes is packed in topological order and described by ``parents[N]`` (-1 for the
root, which continues the accepted prefix). Every node gets the output it would get if its
root path alone were scanned as an ordinary sequence (STree §4, "A_tree"):

    y_i = C_i · ( exp(Acum_i) h0 + Σ_{s ∈ path(i)} exp(Acum_i − Acum_s) dt_s B_s ⊗ x_s ) + D x_i
    Acum_i = Σ_{j ∈ path(i)} dt_j A

The causal depthwise conv1d in front of the SSM reads each node's *ancestors* (the last K−1
nodes of its path, then the accepted prefix's conv state), not its packed neighbours.

``tree_scan_ref`` is the spec (plain PyTorch, any size). ``tree_scan`` runs the whole layer scan
(ancestor conv1d, softplus(dt + bias), the path decay Acum and the SSM contraction) in **one
Triton launch**, from the mixer's raw in_proj slices and the tree's index tensors
(``draftforge/kernels/tree_pack.py``, built once per tree and shared by every layer). Nothing per node is
written besides ``y``: ``tree_scan_replay`` recomputes the SSM and conv state after an accepted
path from the cached raw inputs, in O(path length) (STree's "activation replay").

Legend: B trees in the batch, N nodes, H heads, P head dim, G groups, S state size,
Ch conv channels (H*P + 2*G*S), K conv width, W 32-bit words of the ancestor bitmask.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from draftforge.kernels.tree_pack import (
    PackedTree,
    TreeScanError,
    ancestor_mask,
    chain_tree,
    pack_bitmask,
    pack_tree,
    validate_parents,
)

try:  # the reference path must work without Triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

__all__ = [
    "MAX_KERNEL_NODES", "MAX_KERNEL_STATE", "MAX_KERNEL_CONV", "PackedTree", "TreeScanCache", "TreeScanError",
    "TreeScanOutput", "TreeScanWeights", "ancestor_mask", "pack_bitmask", "pack_tree", "tree_conv", "tree_scan",
    "tree_scan_ref", "tree_scan_replay", "validate_parents",
]

MAX_KERNEL_NODES = 512  # quadratic in N per (tree, head); larger trees use tree_scan_ref
MAX_KERNEL_STATE = 256  # one register block holds the whole state dimension S
MAX_KERNEL_CONV = 8  # conv taps are unrolled in the kernel
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class TreeScanWeights:
    """The per-layer constants of a Mamba2 mixer that the scan needs (read from the layer)."""

    conv_weight_ChK: torch.Tensor
    conv_bias_Ch: torch.Tensor | None
    dt_bias_H: torch.Tensor
    A_H: torch.Tensor  # already negative: A = -exp(A_log)
    D_H: torch.Tensor
    n_groups: int
    head_dim: int
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    activation: str | None = "silu"


@dataclass
class TreeScanCache:
    """The raw inputs of one scan: enough to replay the state after any accepted path."""

    tree: PackedTree
    xBC_BNCh: torch.Tensor  # pre-conv in_proj slice
    dt_BNH: torch.Tensor  # pre-softplus in_proj slice
    weights: TreeScanWeights
    ssm_state_BHPS: torch.Tensor  # h0, fp32
    conv_state_BChK: torch.Tensor


class TreeScanOutput(NamedTuple):
    y_BNHP: torch.Tensor  # fp32, before the gated norm
    cache: TreeScanCache


# ----------------------------------------------------------------------------- validation


def _validate_tensors(xBC_BNCh, dt_BNH, weights, ssm_state, conv_state) -> None:
    if xBC_BNCh.dim() != 3 or dt_BNH.dim() != 3 or dt_BNH.shape[:2] != xBC_BNCh.shape[:2]:
        raise TreeScanError(
            f"xBC must be [B, N, Ch] and dt [B, N, H] with the same B, N; got "
            f"{tuple(xBC_BNCh.shape)} and {tuple(dt_BNH.shape)}."
        )
    if xBC_BNCh.dtype not in _FLOAT_DTYPES or xBC_BNCh.dtype != dt_BNH.dtype:
        raise TreeScanError(
            f"xBC ({xBC_BNCh.dtype}) and dt ({dt_BNH.dtype}) must share one dtype among "
            "float32/float16/bfloat16: cast the mixer inputs once."
        )
    named = {"xBC": xBC_BNCh, "dt": dt_BNH, "conv_weight": weights.conv_weight_ChK,
             "dt_bias": weights.dt_bias_H, "A": weights.A_H, "D": weights.D_H,
             "conv_bias": weights.conv_bias_Ch, "ssm_state": ssm_state, "conv_state": conv_state}
    for name, tensor in named.items():
        if tensor is not None and tensor.device != xBC_BNCh.device:
            raise TreeScanError(
                f"{name} is on {tensor.device} but xBC is on {xBC_BNCh.device}: move all inputs "
                "(layer weights, states, activations) to one device."
            )
    n_heads = dt_BNH.shape[-1]
    groups, head_dim = weights.n_groups, weights.head_dim
    d_state = (xBC_BNCh.shape[-1] - n_heads * head_dim) // (2 * groups)
    if d_state <= 0 or n_heads % groups or n_heads * head_dim + 2 * groups * d_state != xBC_BNCh.shape[-1]:
        raise TreeScanError(
            f"xBC has {xBC_BNCh.shape[-1]} channels, which does not split into x (H*P = "
            f"{n_heads}*{head_dim}) plus B and C ({groups} groups each): check n_groups and head_dim."
        )
    batch = xBC_BNCh.shape[0]
    if ssm_state is not None and ssm_state.shape != (batch, n_heads, head_dim, d_state):
        raise TreeScanError(
            f"ssm_state must be [B, H, P, S] = {(batch, n_heads, head_dim, d_state)}, got {tuple(ssm_state.shape)}."
        )
    k = weights.conv_weight_ChK.shape[-1]
    if conv_state is not None and conv_state.shape != (batch, xBC_BNCh.shape[-1], k):
        raise TreeScanError(
            f"conv_state must be [B, Ch, K] = {(batch, xBC_BNCh.shape[-1], k)}, got {tuple(conv_state.shape)}."
        )



def _start(xBC_BNCh, dt_BNH, parents, weights, ssm_state, conv_state) -> TreeScanCache:
    """Validate everything, fill in empty states, build (or check) the tree's index tensors."""
    _validate_tensors(xBC_BNCh, dt_BNH, weights, ssm_state, conv_state)
    if weights.activation not in (None, "identity", "linear", "silu", "swish"):
        raise TreeScanError(f"conv activation {weights.activation!r} is not supported: use 'silu' or None.")
    batch, n_nodes, n_ch = xBC_BNCh.shape
    n_heads, head_dim = dt_BNH.shape[-1], weights.head_dim
    d_state = (n_ch - n_heads * head_dim) // (2 * weights.n_groups)
    k = weights.conv_weight_ChK.shape[-1]
    tree = pack_tree(parents, batch, n_nodes, k, xBC_BNCh.device)
    if conv_state is None:
        conv_state = xBC_BNCh.new_zeros(batch, n_ch, k)  # no prefix: conv1d's zero padding
    if ssm_state is None:
        ssm_state = torch.zeros(batch, n_heads, head_dim, d_state, device=xBC_BNCh.device)
    return TreeScanCache(tree, xBC_BNCh, dt_BNH, weights, ssm_state.float(), conv_state)


# ----------------------------------------------------------------------------- reference (the spec)


class _Activations(NamedTuple):
    x_BNHP: torch.Tensor
    B_BNGS: torch.Tensor
    C_BNGS: torch.Tensor
    dt_BNH: torch.Tensor  # after bias, softplus and clamp, fp32
    acum_BHN: torch.Tensor  # Acum_i, fp32


def tree_conv(xBC_BNCh, window_BNK, weight_ChK, bias_Ch, conv_state_BChK, activation):
    """Causal depthwise conv1d where each node reads the columns ``window_BNK`` names (its ancestors)."""
    batch, n_nodes, n_ch = xBC_BNCh.shape
    k = weight_ChK.shape[-1]
    # Columns of ext: the K prefix columns (oldest first), then node i at column K + i.
    ext_BChT = torch.cat([conv_state_BChK.float(), xBC_BNCh.float().transpose(1, 2)], dim=2)
    index = window_BNK.long().reshape(batch, 1, -1).expand(-1, n_ch, -1)
    taps_BChNK = ext_BChT.gather(2, index).view(batch, n_ch, n_nodes, k)
    out_BChN = (taps_BChNK * weight_ChK.float()[None, :, None, :]).sum(-1)
    if bias_Ch is not None:
        out_BChN = out_BChN + bias_Ch.float()[None, :, None]
    if activation in ("silu", "swish"):
        out_BChN = F.silu(out_BChN)
    # Round to the activation dtype like transformers' causal_conv1d_fn does.
    return out_BChN.transpose(1, 2).to(xBC_BNCh.dtype)


def _activations(c: TreeScanCache) -> _Activations:
    """Conv outputs split into x, B, C; dt after softplus; Acum along each root path."""
    w = c.weights
    batch, n_nodes, _ = c.xBC_BNCh.shape
    n_heads, groups = c.dt_BNH.shape[-1], w.n_groups
    d_state = c.ssm_state_BHPS.shape[-1]
    conv_BNCh = tree_conv(c.xBC_BNCh, c.tree.window_BNK, w.conv_weight_ChK, w.conv_bias_Ch,
                          c.conv_state_BChK, w.activation)
    x_flat, B_flat, C_flat = conv_BNCh.split([n_heads * w.head_dim, groups * d_state, groups * d_state], -1)
    dt_BNH = F.softplus(c.dt_BNH.float() + w.dt_bias_H.float()).clamp(min=w.dt_limit[0], max=w.dt_limit[1])
    acum_BHN = torch.einsum("bis,bsh->bhi", c.tree.on_path_BNN.float(), dt_BNH * w.A_H.float())
    return _Activations(
        x_flat.reshape(batch, n_nodes, n_heads, w.head_dim), B_flat.reshape(batch, n_nodes, groups, d_state),
        C_flat.reshape(batch, n_nodes, groups, d_state), dt_BNH, acum_BHN,
    )


def _per_head(t_BNGS: torch.Tensor, n_heads: int) -> torch.Tensor:
    return t_BNGS.float().repeat_interleave(n_heads // t_BNGS.shape[2], dim=2)


def _ssm_ref(c: TreeScanCache) -> torch.Tensor:
    """The formula of the module docstring, as masked dense contractions (the spec)."""
    a = _activations(c)
    n_heads = a.dt_BNH.shape[-1]
    B_BNHS, C_BNHS = _per_head(a.B_BNGS, n_heads), _per_head(a.C_BNGS, n_heads)
    x_BNHP = a.x_BNHP.float()
    seg_BHNN = a.acum_BHN[:, :, :, None] - a.acum_BHN[:, :, None, :]  # Acum_i − Acum_s
    seg_BHNN = seg_BHNN.masked_fill(~c.tree.on_path_BNN[:, None], float("-inf"))
    cb_BHNN = torch.einsum("bihn,bshn->bhis", C_BNHS, B_BNHS)
    weight_BHNN = cb_BHNN * torch.exp(seg_BHNN) * a.dt_BNH.permute(0, 2, 1)[:, :, None, :]
    y_BNHP = torch.einsum("bhis,bshp->bihp", weight_BHNN, x_BNHP)
    from_h0_BNHP = torch.einsum("bihn,bhpn->bihp", C_BNHS, c.ssm_state_BHPS)
    y_BNHP = y_BNHP + torch.exp(a.acum_BHN).permute(0, 2, 1)[..., None] * from_h0_BNHP
    return y_BNHP + c.weights.D_H.float()[None, None, :, None] * x_BNHP


def tree_scan_ref(xBC_BNCh, dt_BNH, parents, weights: TreeScanWeights, ssm_state_BHPS=None,
                  conv_state_BChK=None) -> TreeScanOutput:
    """Reference tree scan: xBC/dt are the mixer's in_proj slices (pre-conv, pre-softplus).

    ``parents`` is [N] or [B, N] parent indices, or a PackedTree from ``pack_tree``.
    """
    cache = _start(xBC_BNCh, dt_BNH, parents, weights, ssm_state_BHPS, conv_state_BChK)
    return TreeScanOutput(_ssm_ref(cache), cache)


def tree_scan_replay(cache: TreeScanCache, last_node) -> tuple[torch.Tensor, torch.Tensor]:
    """SSM state [B,H,P,S] (fp32) and conv state [B,Ch,K] after accepting the root path of ``last_node``.

    ``last_node`` is an int or one index per tree; -1 means nothing was accepted (returns h0).
    Only the accepted path is recomputed: its conv, dt and decay, then one contraction.
    """
    batch, n_nodes = cache.tree.parents_BN.shape
    last_B = torch.as_tensor(last_node, dtype=torch.long).reshape(-1).expand(batch).tolist()
    n_heads, k = cache.dt_BNH.shape[-1], cache.conv_state_BChK.shape[-1]
    ssm_states, conv_states = [], []
    for b, j in enumerate(last_B):
        if not -1 <= j < n_nodes:
            raise TreeScanError(f"accepted node {j} is out of range for a tree of {n_nodes} nodes.")
        if j == -1:
            ssm_states.append(cache.ssm_state_BHPS[b])
            conv_states.append(cache.conv_state_BChK[b])
            continue
        path = cache.tree.on_path_BNN[b, j].nonzero().squeeze(1)  # ascending = root first
        xBC_1LCh = cache.xBC_BNCh[b : b + 1, path]
        on_path = TreeScanCache(chain_tree(len(path), k, xBC_1LCh.device), xBC_1LCh, cache.dt_BNH[b : b + 1, path],
                                cache.weights, cache.ssm_state_BHPS[b : b + 1], cache.conv_state_BChK[b : b + 1])
        a = _activations(on_path)
        acum_HL = a.acum_BHN[0]
        decay_HL = torch.exp(acum_HL[:, -1:] - acum_HL) * a.dt_BNH[0].T
        h_HPS = torch.einsum("hl,lhp,lhs->hps", decay_HL, a.x_BNHP[0].float(), _per_head(a.B_BNGS, n_heads)[0])
        ssm_states.append(torch.exp(acum_HL[:, -1])[:, None, None] * cache.ssm_state_BHPS[b] + h_HPS)
        raw_ChT = torch.cat([cache.conv_state_BChK[b], xBC_1LCh[0].T.to(cache.conv_state_BChK.dtype)], 1)
        conv_states.append(raw_ChT[:, -k:])
    return torch.stack(ssm_states), torch.stack(conv_states)


# ----------------------------------------------------------------------------- Triton kernel

if triton is not None:

    @triton.jit
    def _conv_tile(xbc_base, state_base, window_base, w_ptr, bias_ptr, nodes, node_ok, chans, chan_ok,
                   stride_n, stride_sc, stride_sk, K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                   ROWS: tl.constexpr, COLS: tl.constexpr):
        """Conv outputs [ROWS nodes, COLS chans] (fp32, rounded to the input dtype), each node reading its window."""
        ok = node_ok[:, None] & chan_ok[None, :]
        acc = tl.zeros((ROWS, COLS), dtype=tl.float32)
        for k in tl.static_range(K):
            col = tl.load(window_base + nodes * K + k, mask=node_ok, other=K)[:, None]
            # Column col < K is the prefix conv state, col >= K is node col - K (one of the two loads hits).
            from_node = tl.load(xbc_base + (col - K) * stride_n + chans[None, :], mask=ok & (col >= K), other=0.0)
            from_state = tl.load(state_base + chans[None, :] * stride_sc + col * stride_sk, mask=ok & (col < K),
                                 other=0.0)
            w = tl.load(w_ptr + chans * K + k, mask=chan_ok, other=0.0).to(tl.float32)
            acc += (from_node.to(tl.float32) + from_state.to(tl.float32)) * w[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + chans, mask=chan_ok, other=0.0).to(tl.float32)[None, :]
        if SILU:
            acc = acc * tl.sigmoid(acc)
        return _round_like(acc, xbc_base)  # the reference conv rounds to the input dtype too

    @triton.jit
    def _round_like(acc, like_ptr):
        """Round fp32 values to ``like_ptr``'s dtype (kept in fp32), to nearest even like torch."""
        if like_ptr.dtype.element_ty == tl.bfloat16:
            # By hand: the Triton interpreter truncates fp32 -> bf16 casts, CUDA rounds; this does both alike.
            bits = acc.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            return bits.to(tl.float32, bitcast=True)
        else:
            return acc.to(like_ptr.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _dt_tile(dt_base, nodes, node_ok, stride_dn, h, dt_bias, dt_lo, dt_hi):
        """softplus(dt + bias), clamped; 0 outside the tree."""
        raw = tl.load(dt_base + nodes * stride_dn + h, mask=node_ok, other=0.0).to(tl.float32) + dt_bias
        # softplus = max(raw, 0) + log1p(exp(-|raw|)); log1p(u) = log(w)·u/(w−1) with w = 1+u keeps
        # full fp32 accuracy for small u (Goldberg's trick; tl has no log1p on every backend).
        u = tl.exp(-tl.abs(raw))
        w = 1.0 + u
        log1p_u = tl.where(w == 1.0, u, tl.log(w) * u / (w - 1.0))
        dt = tl.minimum(tl.maximum(tl.maximum(raw, 0.0) + log1p_u, dt_lo), dt_hi)
        return tl.where(node_ok, dt, 0.0)

    @triton.jit
    def _acum_tile(words_base, dt_base, nodes, node_ok, end, N, W, stride_dn, h, dt_bias, dt_lo, dt_hi, a_h,
                   BLOCK_N: tl.constexpr):
        """Acum of each node: Σ dt_s·A over s on its root path (ancestors all lie before ``end``)."""
        acum = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, end, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            dta = _dt_tile(dt_base, cols, col_ok, stride_dn, h, dt_bias, dt_lo, dt_hi) * a_h
            words = tl.load(words_base + nodes[:, None] * W + cols[None, :] // 32,
                            mask=node_ok[:, None] & col_ok[None, :], other=0)
            on_path = ((words >> (cols[None, :] % 32)) & 1) != 0
            acum += tl.sum(tl.where(on_path, dta[None, :], 0.0), axis=1)
        return acum

    @triton.jit
    def _tree_scan_kernel(
        xbc_ptr, dt_ptr, state_ptr, window_ptr, words_ptr, convw_ptr, convb_ptr, dtb_ptr, a_ptr, d_ptr,
        h0_ptr, y_ptr, N, H, P, S, W, HEADS_PER_GROUP, OFF_B, OFF_C, dt_lo, dt_hi,
        stride_xb, stride_xn, stride_db, stride_dn, stride_sb, stride_sc, stride_sk,
        K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        # One program: one row block of nodes, one (tree, head), one block of head-dim channels.
        pid_n, pid_bh, pid_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, h = pid_bh // H, pid_bh % H
        g = h // HEADS_PER_GROUP
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        chans = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
        states = tl.arange(0, BLOCK_S)
        row_ok, chan_ok, state_ok = rows < N, chans < P, states < S
        xbc, dts, conv_state = xbc_ptr + b * stride_xb, dt_ptr + b * stride_db, state_ptr + b * stride_sb
        window, words_base = window_ptr + b * N * K, words_ptr + b * N * W
        dt_bias, a_h = tl.load(dtb_ptr + h).to(tl.float32), tl.load(a_ptr + h).to(tl.float32)
        # Ancestors are packed before their descendants: nothing past this row block is read.
        row_end = tl.minimum((pid_n + 1) * BLOCK_N, N)

        x_rows = _conv_tile(xbc, conv_state, window, convw_ptr, convb_ptr, rows, row_ok, h * P + chans, chan_ok,
                            stride_xn, stride_sc, stride_sk, K, HAS_BIAS, SILU, BLOCK_N, BLOCK_P)
        c_rows = _conv_tile(xbc, conv_state, window, convw_ptr, convb_ptr, rows, row_ok, OFF_C + g * S + states,
                            state_ok, stride_xn, stride_sc, stride_sk, K, HAS_BIAS, SILU, BLOCK_N, BLOCK_S)
        acum_rows = _acum_tile(words_base, dts, rows, row_ok, row_end, N, W, stride_dn, h, dt_bias, dt_lo, dt_hi,
                               a_h, BLOCK_N)
        # Initial-state term: exp(Acum_i) C_i · h0. Dots stay full fp32 ("ieee", not TF32): the
        # blocks are small, the launch is latency-bound, and TF32 would cost ~1e-3 relative error.
        h0 = tl.load(h0_ptr + ((b * H + h) * P + chans[None, :]) * S + states[:, None],
                     mask=state_ok[:, None] & chan_ok[None, :], other=0.0)
        acc = tl.dot(c_rows, h0, input_precision="ieee") * tl.exp(acum_rows)[:, None]
        for start in range(0, row_end, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            b_cols = _conv_tile(xbc, conv_state, window, convw_ptr, convb_ptr, cols, col_ok, OFF_B + g * S + states,
                                state_ok, stride_xn, stride_sc, stride_sk, K, HAS_BIAS, SILU, BLOCK_N, BLOCK_S)
            x_cols = _conv_tile(xbc, conv_state, window, convw_ptr, convb_ptr, cols, col_ok, h * P + chans, chan_ok,
                                stride_xn, stride_sc, stride_sk, K, HAS_BIAS, SILU, BLOCK_N, BLOCK_P)
            dt_cols = _dt_tile(dts, cols, col_ok, stride_dn, h, dt_bias, dt_lo, dt_hi)
            acum_cols = _acum_tile(words_base, dts, cols, col_ok, tl.minimum(start + BLOCK_N, N), N, W, stride_dn,
                                   h, dt_bias, dt_lo, dt_hi, a_h, BLOCK_N)
            words = tl.load(words_base + rows[:, None] * W + cols[None, :] // 32,
                            mask=row_ok[:, None] & col_ok[None, :], other=0)
            on_path = ((words >> (cols[None, :] % 32)) & 1) != 0
            seg = tl.where(on_path, acum_rows[:, None] - acum_cols[None, :], float("-inf"))
            cb = tl.dot(c_rows, tl.trans(b_cols), input_precision="ieee")
            acc += tl.dot(cb * tl.exp(seg) * dt_cols[None, :], x_cols, input_precision="ieee")
        acc += tl.load(d_ptr + h).to(tl.float32) * x_rows
        tl.store(y_ptr + ((b * N + rows[:, None]) * H + h) * P + chans[None, :], acc,
                 mask=row_ok[:, None] & chan_ok[None, :])


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _scan_triton(c: TreeScanCache) -> torch.Tensor:
    """One launch: conv + dt + Acum + SSM for every (tree, head, node block, channel block)."""
    w = c.weights
    xBC, dt = _last_dim_contiguous(c.xBC_BNCh), _last_dim_contiguous(c.dt_BNH)  # in_proj slices: no copy
    batch, n_nodes, _ = xBC.shape
    n_heads, groups, head_dim = dt.shape[-1], w.n_groups, w.head_dim
    d_state, k = c.ssm_state_BHPS.shape[-1], w.conv_weight_ChK.shape[-1]
    conv_state = c.conv_state_BChK
    y_BNHP = torch.empty(batch, n_nodes, n_heads, head_dim, device=xBC.device, dtype=torch.float32)
    block_s = max(16, triton.next_power_of_2(d_state))
    block_n = 16 if n_nodes <= 16 or block_s > 128 else 32
    block_p = max(16, min(32, triton.next_power_of_2(head_dim)))
    # Register budget, from `ptxas -v` for sm_90: with these tiles 8 warps keep C/B/h0 tiles (S up
    # to 256) without spills, 4 warps suffice below 2048 node x state elements.
    num_warps = 8 if block_n * block_s >= 2048 else 4
    grid = (triton.cdiv(n_nodes, block_n), batch * n_heads, triton.cdiv(head_dim, block_p))
    bias = w.conv_bias_Ch if w.conv_bias_Ch is not None else w.conv_weight_ChK  # unread when HAS_BIAS=False
    _tree_scan_kernel[grid](
        xBC, dt, conv_state, c.tree.window_BNK, c.tree.words_BNW, w.conv_weight_ChK.contiguous(), bias,
        w.dt_bias_H, w.A_H, w.D_H, c.ssm_state_BHPS.contiguous(), y_BNHP,
        n_nodes, n_heads, head_dim, d_state, c.tree.words_BNW.shape[-1], n_heads // groups,
        n_heads * head_dim, n_heads * head_dim + groups * d_state, float(w.dt_limit[0]), float(w.dt_limit[1]),
        xBC.stride(0), xBC.stride(1), dt.stride(0), dt.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        K=k, HAS_BIAS=w.conv_bias_Ch is not None, SILU=w.activation in ("silu", "swish"),
        BLOCK_N=block_n, BLOCK_P=block_p, BLOCK_S=block_s, num_warps=num_warps,
    )
    return y_BNHP


def _kernel_usable(xBC_BNCh: torch.Tensor) -> bool:
    return triton is not None and (xBC_BNCh.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def _kernel_limits(xBC_BNCh, dt_BNH, weights) -> str | None:
    """Why the kernel cannot take these inputs (None when it can)."""
    n_nodes = xBC_BNCh.shape[1] if xBC_BNCh.dim() == 3 else 0
    d_state = (xBC_BNCh.shape[-1] - dt_BNH.shape[-1] * weights.head_dim) // max(2 * weights.n_groups, 1)
    k = weights.conv_weight_ChK.shape[-1]
    if n_nodes <= MAX_KERNEL_NODES and d_state <= MAX_KERNEL_STATE and k <= MAX_KERNEL_CONV:
        return None
    return (f"the tree scan kernel supports at most {MAX_KERNEL_NODES} nodes, state size {MAX_KERNEL_STATE} "
            f"and conv width {MAX_KERNEL_CONV}; got {n_nodes} nodes, state size {d_state}, conv width {k}")


def tree_scan(xBC_BNCh, dt_BNH, parents, weights: TreeScanWeights, ssm_state_BHPS=None,
              conv_state_BChK=None, impl: str = "auto") -> TreeScanOutput:
    """Tree scan with the Triton kernel (``impl="triton"``), the reference (``"ref"``), or the
    kernel on CUDA and the reference elsewhere or for trees over the kernel's limits (``"auto"``).

    ``parents`` is [N] or [B, N] parent indices, or a PackedTree built once per tree with
    ``pack_tree`` (then the kernel path launches exactly one kernel).
    """
    if impl not in ("auto", "ref", "triton"):
        raise TreeScanError(f"impl must be 'auto', 'ref' or 'triton', got {impl!r}.")
    too_big = _kernel_limits(xBC_BNCh, dt_BNH, weights)
    if impl == "triton":
        if too_big:
            raise TreeScanError(f"{too_big}: use impl='ref'.")
        if not _kernel_usable(xBC_BNCh):
            raise TreeScanError(
                "impl='triton' needs triton and CUDA tensors (or TRITON_INTERPRET=1 set before "
                "importing triton, for CPU tensors); use impl='ref' or 'auto'."
            )
    use_kernel = impl == "triton" or (impl == "auto" and not too_big and xBC_BNCh.is_cuda and triton is not None)
    cache = _start(xBC_BNCh, dt_BNH, parents, weights, ssm_state_BHPS, conv_state_BChK)
    return TreeScanOutput(_scan_triton(cache) if use_kernel else _ssm_ref(cache), cache)
