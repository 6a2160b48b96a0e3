"""Tree-aware forward of a transformers Mamba2 mixer: verify a packed token tree in one pass (STree §4).

The mixer's own modules are applied per node unchanged (in_proj, gated RMSNorm, out_proj);
only the sequence mixing (conv1d + SSM) is replaced by the tree scan of
``draftforge.kernels.tree_scan``, which reads each node's root path instead of packed order.

Legend: B batch of trees, N nodes, D hidden size, I intermediate size (H*P), Ch conv channels,
V vocab, L layers.
"""

from __future__ import annotations

import torch

from draftforge.decode.tree import root_path  # noqa: F401  (tests and benchmarks use it from here)
from draftforge.errors import CompatibilityError
from draftforge.hfcompat import cache_kwargs
from draftforge.kernels.tree_scan import TreeScanCache, TreeScanWeights, pack_tree, tree_scan, tree_scan_replay

_MIXER_PARTS = ("in_proj", "conv1d", "dt_bias", "A_log", "D", "norm", "out_proj", "n_groups", "head_dim")


def scan_weights(mixer: torch.nn.Module) -> TreeScanWeights:
    """Read the scan constants of a Mamba2-style mixer (Mamba2, Bamba, NemotronH)."""
    missing = [name for name in _MIXER_PARTS if not hasattr(mixer, name)]
    if missing:
        raise CompatibilityError(
            f"{type(mixer).__name__} is not a Mamba2-style mixer (missing {', '.join(missing)}): "
            "the tree forward supports transformers' Mamba2Mixer and mixers with the same parts."
        )
    if hasattr(mixer, "mup_vector") or getattr(mixer, "rms_norm", True) is False:
        # FalconH1 scales the projections (µP) and may skip the norm; not verified against it yet.
        raise CompatibilityError(
            f"{type(mixer).__name__} rescales its projections (mup_vector) or has no gated norm; "
            "the tree forward does not support it yet."
        )
    return TreeScanWeights(
        conv_weight_ChK=mixer.conv1d.weight.squeeze(1),
        conv_bias_Ch=mixer.conv1d.bias,
        dt_bias_H=mixer.dt_bias,
        A_H=-torch.exp(mixer.A_log.float()),
        D_H=mixer.D,
        n_groups=mixer.n_groups,
        head_dim=mixer.head_dim,
        dt_limit=tuple(getattr(mixer, "time_step_limit", (0.0, float("inf")))),
        activation=mixer.activation,
    )


def cache_states(cache, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(conv_state [B,Ch,K], ssm_state [B,H,P,S]) of one layer of a transformers Cache, or Nones."""
    if cache is None:
        return None, None
    return cache.get_conv_state(layer_idx), cache.get_recurrent_state(layer_idx)


def mixer_tree_forward(mixer, hidden_BND, parents, conv_state=None, ssm_state=None,
                       impl: str = "auto") -> tuple[torch.Tensor, TreeScanCache]:
    """Per-node outputs [B,N,D] of ``mixer`` over a packed tree, plus the cache for replay.

    ``parents`` is [N] / [B, N] parent indices or a PackedTree (``pack_tree``), which a stack of
    layers builds once and shares. ``conv_state``/``ssm_state`` are the layer's states after the
    accepted prefix (None: empty).
    ``impl`` is passed to ``tree_scan`` ("auto" = kernel on CUDA, reference elsewhere).
    """
    weights = scan_weights(mixer)
    batch, n_nodes, _ = hidden_BND.shape
    dtype = hidden_BND.dtype
    projected_BNX = mixer.in_proj(hidden_BND)
    n_heads = mixer.dt_bias.shape[0]
    intermediate = n_heads * mixer.head_dim
    n_ch = mixer.conv1d.weight.shape[0]
    gate_BNI, xBC_BNCh, dt_BNH = projected_BNX.split([intermediate, n_ch, n_heads], dim=-1)
    if conv_state is not None:
        conv_state = conv_state.to(xBC_BNCh.dtype)
    out = tree_scan(xBC_BNCh, dt_BNH, parents, weights, ssm_state, conv_state, impl=impl)
    y_BNI = mixer.norm(out.y_BNHP.reshape(batch, n_nodes, intermediate), gate_BNI)
    return mixer.out_proj(y_BNI.to(dtype)), out.cache


def replay_states(scan_cache: TreeScanCache, last_node, ssm_dtype=torch.float32):
    """(conv_state, ssm_state) of one layer after accepting the root path of ``last_node``."""
    ssm_BHPS, conv_BChK = tree_scan_replay(scan_cache, last_node)
    return conv_BChK, ssm_BHPS.to(ssm_dtype)


@torch.no_grad()
def mamba2_tree_logits(model, tree_ids_BN, parents, cache=None, impl: str = "auto"):
    """Per-node logits [B,N,V] of a ``Mamba2ForCausalLM`` over a packed tree continuing ``cache``.

    Returns (logits, scan_caches) where scan_caches[l] replays layer l's state after acceptance.
    The block structure (pre-norm, residual, fp32 residual option) mirrors ``Mamba2Block``.
    """
    backbone = model.backbone
    hidden_BND = backbone.embeddings(tree_ids_BN)
    # The tree's index tensors depend on the tree only: built once, read by every layer's scan.
    tree = pack_tree(parents, *tree_ids_BN.shape, model.config.conv_kernel, tree_ids_BN.device)
    scan_caches = []
    for layer_idx, block in enumerate(backbone.layers):
        residual_BND = hidden_BND
        normed_BND = block.norm(hidden_BND.to(dtype=block.norm.weight.dtype))
        if block.residual_in_fp32:
            residual_BND = residual_BND.to(torch.float32)
        conv_state, ssm_state = cache_states(cache, layer_idx)
        mixed_BND, scan_cache = mixer_tree_forward(block.mixer, normed_BND, tree, conv_state, ssm_state, impl)
        hidden_BND = residual_BND + mixed_BND
        scan_caches.append(scan_cache)
    hidden_BND = backbone.norm_f(hidden_BND)
    logits_BNV = model.lm_head(hidden_BND.to(model.lm_head.weight.dtype)).float()
    return logits_BNV, scan_caches


# ----------------------------------------------------------------------------- tree helpers and baseline


def leaf_paths(parents_N) -> list[list[int]]:
    """One root path per leaf: the sequences that "unrolling" the tree would decode."""
    parents_N = [int(p) for p in parents_N]  # a tensor row too
    has_child = set(parents_N)
    return [root_path(parents_N, i) for i in range(len(parents_N)) if i not in has_child]


def full_binary_parents(depth: int) -> list[int]:
    """Parents of a full binary tree with ``depth`` levels, the root counted: 2**depth − 1 nodes."""
    return [-1] + [(i - 1) // 2 for i in range(1, 2**depth - 1)]


def seeded_cache(config, layer_idx: int, conv_state=None, ssm_state=None):
    """A transformers DynamicCache whose layer ``layer_idx`` holds the given states (None: no cache)."""
    from transformers.cache_utils import DynamicCache

    if conv_state is None and ssm_state is None:
        return None
    cache = DynamicCache(config=config)
    cache.update_conv_state(conv_state.clone(), layer_idx, conv_kernel_size=conv_state.shape[-1])
    cache.update_recurrent_state(ssm_state.clone(), layer_idx)
    return cache


@torch.no_grad()
def unrolled_mixer_outputs(mixer, config, hidden_BND, parents_BN, conv_state=None, ssm_state=None):
    """Baseline: every leaf path run through the mixer's own forward as an ordinary sequence.

    Returns per-node outputs [B,N,D] (each node taken from a path that contains it).
    """
    out_BND = torch.zeros_like(hidden_BND)
    for b in range(hidden_BND.shape[0]):
        for path in leaf_paths(parents_BN[b]):
            take = lambda s: None if s is None else s[b : b + 1]  # noqa: E731
            cache = seeded_cache(config, mixer.layer_idx, take(conv_state), take(ssm_state))
            out_BND[b, path] = mixer(hidden_BND[b : b + 1, path], **cache_kwargs(mixer, cache))[0]
    return out_BND
