"""Tree scan: one pass of a Mamba2 conv1d + SSM over a packed token tree (STree, Wu et al.).

A tree of N nodes is packed in topological order and described by ``parents[N]`` (-1 for the
root, which continues the accepted prefix). Every node gets the output it would get if its
root path alone were scanned as an ordinary sequence (STree §4, "A_tree"):

    y_i = C_i · ( exp(Acum_i) h0 + Σ_{s ∈ path(i)} exp(Acum_i − Acum_s) dt_s B_s ⊗ x_s ) + D x_i
    Acum_i = Σ_{j ∈ path(i)} dt_j A

The causal depthwise conv1d in front of the SSM reads each node's *ancestors* (the last K−1
nodes of its path, then the accepted prefix's conv state), not its packed neighbours.

``tree_scan_ref`` is the spec (plain PyTorch, any size); ``tree_scan`` launches one Triton
kernel for the SSM contraction (the conv is a gather in PyTorch); ``tree_scan_replay``
rebuilds the SSM and conv state after an accepted path from the cached activations.

Legend: B trees in the batch, N nodes, H heads, P head dim, G groups, S state size,
Ch conv channels (H*P + 2*G*S), K conv width, W 32-bit words of the ancestor bitmask.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from draftforge.errors import DraftforgeError

try:  # the reference path must work without Triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

MAX_KERNEL_NODES = 512  # quadratic in N per (tree, head); larger trees use tree_scan_ref
MAX_KERNEL_STATE = 256  # one register block holds the whole state dimension S
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class TreeScanError(DraftforgeError, ValueError):
    """Bad tree or bad tensors given to the tree scan."""


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
    """What activation replay needs to rebuild the state after any accepted path."""

    parents_BN: torch.Tensor
    on_path_BNN: torch.Tensor  # [b, i, s]: s is on the root path of i (s == i included)
    xBC_BNCh: torch.Tensor  # raw (pre-conv) inputs: they become the next conv state
    x_BNHP: torch.Tensor
    B_BNGS: torch.Tensor
    C_BNGS: torch.Tensor
    dt_BNH: torch.Tensor  # after bias, softplus and clamp, fp32
    acum_BHN: torch.Tensor  # Acum_i, fp32
    ssm_state_BHPS: torch.Tensor  # h0, fp32
    conv_state_BChK: torch.Tensor


class TreeScanOutput(NamedTuple):
    y_BNHP: torch.Tensor  # fp32, before the gated norm
    cache: TreeScanCache


# ----------------------------------------------------------------------------- validation


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


# ----------------------------------------------------------------------------- tree structure


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


def tree_conv(xBC_BNCh, parents_BN, weight_ChK, bias_Ch, conv_state_BChK, activation):
    """Causal depthwise conv1d where each node reads its K−1 ancestors, then the prefix conv state."""
    batch, n_nodes, _ = xBC_BNCh.shape
    k = weight_ChK.shape[-1]
    device = xBC_BNCh.device
    # Columns of ext: the K prefix columns (oldest first), then node i at column K + i.
    ext_BChT = torch.cat([conv_state_BChK.float(), xBC_BNCh.float().transpose(1, 2)], dim=2)
    node_up_BN = torch.where(parents_BN >= 0, parents_BN + k, torch.full_like(parents_BN, k - 1))
    state_up_BK = (torch.arange(k, device=device) - 1).clamp(min=0).expand(batch, k)
    step_up_BT = torch.cat([state_up_BK, node_up_BN], dim=1)  # the column one token earlier
    cols = [(torch.arange(n_nodes, device=device) + k).expand(batch, n_nodes)]
    for _ in range(k - 1):
        cols.append(step_up_BT.gather(1, cols[-1]))
    window_BNK = torch.stack(cols[::-1], dim=-1)  # oldest tap first, like conv1d's weight
    n_ch = ext_BChT.shape[1]
    taps_BChNK = ext_BChT.gather(2, window_BNK.reshape(batch, 1, -1).expand(-1, n_ch, -1))
    taps_BChNK = taps_BChNK.view(batch, n_ch, n_nodes, k)
    out_BChN = (taps_BChNK * weight_ChK.float()[None, :, None, :]).sum(-1)
    if bias_Ch is not None:
        out_BChN = out_BChN + bias_Ch.float()[None, :, None]
    if activation in ("silu", "swish"):
        out_BChN = F.silu(out_BChN)
    elif activation not in (None, "identity", "linear"):
        raise TreeScanError(f"conv activation {activation!r} is not supported: use 'silu' or None.")
    # Round to the activation dtype like transformers' causal_conv1d_fn does.
    return out_BChN.transpose(1, 2).to(xBC_BNCh.dtype)


# ----------------------------------------------------------------------------- shared preparation


def _prepare(xBC_BNCh, dt_BNH, parents, weights, ssm_state, conv_state) -> TreeScanCache:
    _validate_tensors(xBC_BNCh, dt_BNH, weights, ssm_state, conv_state)
    batch, n_nodes, n_ch = xBC_BNCh.shape
    n_heads, groups, head_dim = dt_BNH.shape[-1], weights.n_groups, weights.head_dim
    d_state = (n_ch - n_heads * head_dim) // (2 * groups)
    device = xBC_BNCh.device
    parents_BN = validate_parents(parents, batch, n_nodes, device)
    k = weights.conv_weight_ChK.shape[-1]
    if conv_state is None:
        conv_state = xBC_BNCh.new_zeros(batch, n_ch, k)  # no prefix: conv1d's zero padding
    if ssm_state is None:
        ssm_state = torch.zeros(batch, n_heads, head_dim, d_state, device=device)
    on_path_BNN = ancestor_mask(parents_BN)
    conv_BNCh = tree_conv(xBC_BNCh, parents_BN, weights.conv_weight_ChK, weights.conv_bias_Ch,
                          conv_state, weights.activation)
    x_BNHP, B_flat, C_flat = conv_BNCh.split([n_heads * head_dim, groups * d_state, groups * d_state], -1)
    dt_BNH = F.softplus(dt_BNH.float() + weights.dt_bias_H.float())
    dt_BNH = dt_BNH.clamp(min=weights.dt_limit[0], max=weights.dt_limit[1])
    dtA_BNH = dt_BNH * weights.A_H.float()
    acum_BHN = torch.einsum("bis,bsh->bhi", on_path_BNN.float(), dtA_BNH)
    return TreeScanCache(
        parents_BN=parents_BN, on_path_BNN=on_path_BNN, xBC_BNCh=xBC_BNCh,
        x_BNHP=x_BNHP.reshape(batch, n_nodes, n_heads, head_dim),
        B_BNGS=B_flat.reshape(batch, n_nodes, groups, d_state),
        C_BNGS=C_flat.reshape(batch, n_nodes, groups, d_state),
        dt_BNH=dt_BNH, acum_BHN=acum_BHN, ssm_state_BHPS=ssm_state.float(), conv_state_BChK=conv_state,
    )


def _per_head(t_BNGS: torch.Tensor, n_heads: int) -> torch.Tensor:
    return t_BNGS.float().repeat_interleave(n_heads // t_BNGS.shape[2], dim=2)


def _ssm_ref(c: TreeScanCache, D_H: torch.Tensor) -> torch.Tensor:
    """The formula of the module docstring, as masked dense contractions (the spec)."""
    n_heads = c.dt_BNH.shape[-1]
    B_BNHS, C_BNHS = _per_head(c.B_BNGS, n_heads), _per_head(c.C_BNGS, n_heads)
    x_BNHP = c.x_BNHP.float()
    seg_BHNN = c.acum_BHN[:, :, :, None] - c.acum_BHN[:, :, None, :]  # Acum_i − Acum_s
    seg_BHNN = seg_BHNN.masked_fill(~c.on_path_BNN[:, None], float("-inf"))
    cb_BHNN = torch.einsum("bihn,bshn->bhis", C_BNHS, B_BNHS)
    weight_BHNN = cb_BHNN * torch.exp(seg_BHNN) * c.dt_BNH.permute(0, 2, 1)[:, :, None, :]
    y_BNHP = torch.einsum("bhis,bshp->bihp", weight_BHNN, x_BNHP)
    from_h0_BNHP = torch.einsum("bihn,bhpn->bihp", C_BNHS, c.ssm_state_BHPS)
    y_BNHP = y_BNHP + torch.exp(c.acum_BHN).permute(0, 2, 1)[..., None] * from_h0_BNHP
    return y_BNHP + D_H.float()[None, None, :, None] * x_BNHP


def tree_scan_ref(xBC_BNCh, dt_BNH, parents, weights: TreeScanWeights, ssm_state_BHPS=None,
                  conv_state_BChK=None) -> TreeScanOutput:
    """Reference tree scan: xBC/dt are the mixer's in_proj slices (pre-conv, pre-softplus)."""
    cache = _prepare(xBC_BNCh, dt_BNH, parents, weights, ssm_state_BHPS, conv_state_BChK)
    return TreeScanOutput(_ssm_ref(cache, weights.D_H), cache)


def tree_scan_replay(cache: TreeScanCache, last_node) -> tuple[torch.Tensor, torch.Tensor]:
    """SSM state [B,H,P,S] (fp32) and conv state [B,Ch,K] after accepting the root path of ``last_node``.

    ``last_node`` is an int or one index per tree; -1 means nothing was accepted (returns h0).
    """
    batch, n_nodes = cache.parents_BN.shape
    last_B = torch.as_tensor(last_node, dtype=torch.long).reshape(-1).expand(batch).tolist()
    n_heads = cache.dt_BNH.shape[-1]
    k = cache.conv_state_BChK.shape[-1]
    ssm_states, conv_states = [], []
    for b, j in enumerate(last_B):
        if not -1 <= j < n_nodes:
            raise TreeScanError(f"accepted node {j} is out of range for a tree of {n_nodes} nodes.")
        if j == -1:
            ssm_states.append(cache.ssm_state_BHPS[b])
            conv_states.append(cache.conv_state_BChK[b])
            continue
        path = cache.on_path_BNN[b, j].nonzero().squeeze(1)  # ascending = root first
        acum_HL = cache.acum_BHN[b][:, path]
        decay_HL = torch.exp(acum_HL[:, -1:] - acum_HL) * cache.dt_BNH[b, path].T
        B_LHS = _per_head(cache.B_BNGS[b : b + 1, path], n_heads)[0]
        x_LHP = cache.x_BNHP[b, path].float()
        h_HPS = torch.einsum("hl,lhp,lhs->hps", decay_HL, x_LHP, B_LHS)
        ssm_states.append(torch.exp(acum_HL[:, -1])[:, None, None] * cache.ssm_state_BHPS[b] + h_HPS)
        raw_ChT = torch.cat([cache.conv_state_BChK[b], cache.xBC_BNCh[b, path].T.to(cache.conv_state_BChK.dtype)], 1)
        conv_states.append(raw_ChT[:, -k:])
    return torch.stack(ssm_states), torch.stack(conv_states)


# ----------------------------------------------------------------------------- Triton kernel

if triton is not None:

    @triton.jit
    def _tree_ssm_kernel(
        xbc_ptr, dt_ptr, acum_ptr, words_ptr, h0_ptr, d_ptr, y_ptr,
        N, H, P, S, W, HEADS_PER_GROUP, OFF_B, OFF_C, stride_b, stride_n,
        BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, PRECISION: tl.constexpr,
    ):
        # One program: one row block of nodes, one (tree, head), one block of head-dim channels.
        pid_n, pid_bh, pid_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, h = pid_bh // H, pid_bh % H
        g = h // HEADS_PER_GROUP
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        chans = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
        states = tl.arange(0, BLOCK_S)
        row_ok, chan_ok, state_ok = rows < N, chans < P, states < S
        base = xbc_ptr + b * stride_b
        c_rows = tl.load(base + rows[:, None] * stride_n + OFF_C + g * S + states[None, :],
                         mask=row_ok[:, None] & state_ok[None, :], other=0.0).to(tl.float32)
        acum_rows = tl.load(acum_ptr + (b * H + h) * N + rows, mask=row_ok, other=0.0)
        # Initial-state term: exp(Acum_i) C_i · h0.
        h0 = tl.load(h0_ptr + ((b * H + h) * P + chans[None, :]) * S + states[:, None],
                     mask=state_ok[:, None] & chan_ok[None, :], other=0.0)
        acc = tl.dot(c_rows, h0, input_precision=PRECISION) * tl.exp(acum_rows)[:, None]
        # Ancestors come before their descendants, so column blocks past this row block are empty.
        for start in range(0, (pid_n + 1) * BLOCK_N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            b_cols = tl.load(base + cols[:, None] * stride_n + OFF_B + g * S + states[None, :],
                             mask=col_ok[:, None] & state_ok[None, :], other=0.0).to(tl.float32)
            x_cols = tl.load(base + cols[:, None] * stride_n + h * P + chans[None, :],
                             mask=col_ok[:, None] & chan_ok[None, :], other=0.0).to(tl.float32)
            dt_cols = tl.load(dt_ptr + (b * N + cols) * H + h, mask=col_ok, other=0.0)
            acum_cols = tl.load(acum_ptr + (b * H + h) * N + cols, mask=col_ok, other=0.0)
            words = tl.load(words_ptr + (b * N + rows[:, None]) * W + cols[None, :] // 32,
                            mask=row_ok[:, None] & col_ok[None, :], other=0)
            on_path = ((words >> (cols[None, :] % 32)) & 1) != 0
            seg = tl.where(on_path, acum_rows[:, None] - acum_cols[None, :], float("-inf"))
            cb = tl.dot(c_rows, tl.trans(b_cols), input_precision=PRECISION)
            acc += tl.dot(cb * tl.exp(seg) * dt_cols[None, :], x_cols, input_precision=PRECISION)
        x_rows = tl.load(base + rows[:, None] * stride_n + h * P + chans[None, :],
                         mask=row_ok[:, None] & chan_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.load(d_ptr + h).to(tl.float32) * x_rows
        tl.store(y_ptr + ((b * N + rows[:, None]) * H + h) * P + chans[None, :], acc,
                 mask=row_ok[:, None] & chan_ok[None, :])


def _ssm_triton(c: TreeScanCache, D_H: torch.Tensor) -> torch.Tensor:
    batch, n_nodes, n_heads, head_dim = c.x_BNHP.shape
    groups, d_state = c.B_BNGS.shape[2:]
    # x, B and C are slices of one contiguous conv output: pass it once with channel offsets.
    conv_BNCh = torch.cat([c.x_BNHP.flatten(2), c.B_BNGS.flatten(2), c.C_BNGS.flatten(2)], -1).contiguous()
    words_BNW = pack_bitmask(c.on_path_BNN)
    y_BNHP = torch.empty(batch, n_nodes, n_heads, head_dim, device=conv_BNCh.device, dtype=torch.float32)
    block_n = 16 if n_nodes <= 16 else 32
    block_p = max(16, min(64, triton.next_power_of_2(head_dim)))
    block_s = max(16, triton.next_power_of_2(d_state))
    grid = (triton.cdiv(n_nodes, block_n), batch * n_heads, triton.cdiv(head_dim, block_p))
    _tree_ssm_kernel[grid](
        conv_BNCh, c.dt_BNH.contiguous(), c.acum_BHN.contiguous(), words_BNW,
        c.ssm_state_BHPS.contiguous(), D_H.float().contiguous(), y_BNHP,
        n_nodes, n_heads, head_dim, d_state, words_BNW.shape[-1], n_heads // groups,
        n_heads * head_dim, n_heads * head_dim + groups * d_state,
        conv_BNCh.stride(0), conv_BNCh.stride(1),
        BLOCK_N=block_n, BLOCK_P=block_p, BLOCK_S=block_s,
        PRECISION="ieee" if conv_BNCh.dtype == torch.float32 else "tf32",
    )
    return y_BNHP


def _kernel_usable(xBC_BNCh: torch.Tensor) -> bool:
    return triton is not None and (xBC_BNCh.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def tree_scan(xBC_BNCh, dt_BNH, parents, weights: TreeScanWeights, ssm_state_BHPS=None,
              conv_state_BChK=None, impl: str = "auto") -> TreeScanOutput:
    """Tree scan with the Triton kernel (``impl="triton"``), the reference (``"ref"``), or the
    kernel on CUDA and the reference elsewhere or for trees over the kernel's limits (``"auto"``)."""
    if impl not in ("auto", "ref", "triton"):
        raise TreeScanError(f"impl must be 'auto', 'ref' or 'triton', got {impl!r}.")
    n_nodes = xBC_BNCh.shape[1] if xBC_BNCh.dim() == 3 else 0
    n_heads, groups = dt_BNH.shape[-1], weights.n_groups
    d_state = (xBC_BNCh.shape[-1] - n_heads * weights.head_dim) // max(2 * groups, 1)
    fits = n_nodes <= MAX_KERNEL_NODES and d_state <= MAX_KERNEL_STATE
    if impl == "triton":
        if not fits:
            raise TreeScanError(
                f"the tree scan kernel supports at most {MAX_KERNEL_NODES} nodes and state size "
                f"{MAX_KERNEL_STATE}; got {n_nodes} nodes and state size {d_state}: use impl='ref'."
            )
        if not _kernel_usable(xBC_BNCh):
            raise TreeScanError(
                "impl='triton' needs triton and CUDA tensors (or TRITON_INTERPRET=1 set before "
                "importing triton, for CPU tensors); use impl='ref' or 'auto'."
            )
    use_kernel = impl == "triton" or (impl == "auto" and fits and xBC_BNCh.is_cuda and triton is not None)
    cache = _prepare(xBC_BNCh, dt_BNH, parents, weights, ssm_state_BHPS, conv_state_BChK)
    y_BNHP = _ssm_triton(cache, weights.D_H) if use_kernel else _ssm_ref(cache, weights.D_H)
    return TreeScanOutput(y_BNHP, cache)
