"""EESD's early-exit drafter parts (EESD §3.1, Eq. 1): a Llama-family target split after layer N, and the
trainable exit head on top of it, `p(y_t) = softmax(W^T RMSNorm(Transformer^e(H_t^N)))`.

The target's own transformers modules run the layers (its rotary embedding, its mask functions, its
decoder layers); nothing is copied from a modeling file. The trainable `ExitHead` holds one decoder
layer (a copy of the target's last layer by default), a norm and an untied LM head, optionally over a
reduced draft vocabulary (models/draft_vocab.py: N rows for the target's N most frequent ids).

Legend: B batch, T tokens, D hidden size, V vocabulary (the target's, or the N draft ids of a reduced head).
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from transformers.masking_utils import create_causal_mask

from draftforge.errors import CompatibilityError, RecipeError
from draftforge.hfcompat import cache_kwargs

# model_type -> note; their decoder layers share one call signature (hidden, mask, position
# embeddings, position ids, cache) and the model keeps embed_tokens / layers / norm / rotary_emb.
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
LAYER_INITS = ("last", "next", "random")  # copy of the target's last layer, of layer N+1, or fresh
HEAD_INITS = ("target", "random")


@dataclass
class TargetParts:
    """The target's modules, by role (references, not copies)."""

    config: object
    embed: torch.nn.Module
    layers: torch.nn.ModuleList
    rotary: torch.nn.Module
    norm: torch.nn.Module
    head: torch.nn.Linear

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def check_family(model_type: str, missing_parts: bool = False) -> None:
    """CompatibilityError for a target whose decoder layers this module cannot split, naming what it supports."""
    if model_type not in SUPPORTED_FAMILIES or missing_parts:
        raise CompatibilityError(
            f"target {model_type!r} cannot be split after a decoder layer for an early exit; EESD supports "
            f"the Llama family: {', '.join(SUPPORTED_FAMILIES)} (SmolLM2 is a Llama)")


def split_target(model) -> TargetParts:
    """The target's parts, or CompatibilityError naming the supported families."""
    config = model.config
    inner = getattr(model, "model", None)
    missing = [a for a in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(inner, a)]
    check_family(config.model_type, bool(missing))
    sliding = [t for t in (getattr(config, "layer_types", None) or []) if t != "full_attention"]
    if sliding:
        raise CompatibilityError(f"target {config.model_type!r} has {len(sliding)} {sliding[0]} layers; the "
                                 "early-exit harness supports full-attention layers only (disable the sliding window)")
    return TargetParts(config, inner.embed_tokens, inner.layers, inner.rotary_emb, inner.norm,
                       model.get_output_embeddings())


def check_exit_after(n: int, num_layers: int, where: str = "eesd.exit_after_layer") -> int:
    """N must leave at least one target layer for verification: 1 <= N < L."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n < num_layers:
        raise RecipeError(f"recipe key '{where}': must be in [1, {num_layers - 1}] for a target of {num_layers} "
                          f"layers (the exit sits after layer N, and layers N+1..L verify), got {n!r}")
    return n


def default_exit_after(num_layers: int) -> int:
    """≈10% of the layers (EESD §5.4: N = 3 of 40, 5 of 80), at least 1."""
    return max(1, min(num_layers - 1, round(0.1 * num_layers)))


def frozen_fingerprint(parts: TargetParts, n: int) -> str:
    """sha256 of the embeddings and layers 1..N (shapes + values rounded to bf16, so a target loaded in
    another float dtype still matches): an exit head is attached only to the trunk it was trained on."""
    h = hashlib.sha256()
    named = [("embed", parts.embed)] + [(f"layers.{i}", parts.layers[i]) for i in range(n)]
    for prefix, module in named:
        for name, tensor in sorted(module.state_dict().items()):
            h.update(f"{prefix}.{name}:{tuple(tensor.shape)}".encode())
            h.update(tensor.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def causal_mask(config, hidden_BTD, position_ids_BT, cache=None, layer_idx: int = 0):
    """The mask transformers' model would build, sized against cache layer `layer_idx` (None: causal SDPA)."""
    return create_causal_mask(config=config, inputs_embeds=hidden_BTD, attention_mask=None,
                              position_ids=position_ids_BT, layer_idx=layer_idx,
                              **cache_kwargs(create_causal_mask, cache))


def run_layers(layers, hidden_BTD, position_ids_BT, position_embeddings, mask, cache=None):
    """Run decoder layers in order as the target's model does (each writes its own cache layer)."""
    for layer in layers:
        hidden_BTD = layer(hidden_BTD, attention_mask=mask, position_ids=position_ids_BT,
                           position_embeddings=position_embeddings, use_cache=cache is not None,
                           **cache_kwargs(layer, cache))
    return hidden_BTD


class Trunk(torch.nn.Module):
    """The frozen embeddings + layers 1..N of a target (shared modules): ids -> H^N."""

    def __init__(self, parts: TargetParts, n: int):
        super().__init__()
        self.config, self.n = parts.config, n
        self.embed, self.rotary = parts.embed, parts.rotary
        self.layers = torch.nn.ModuleList(parts.layers[:n])

    def forward(self, input_ids_BT):
        """(H^N [B, T, D], position ids, position embeddings, mask) of whole sequences (training)."""
        hidden_BTD = self.embed(input_ids_BT)
        position_ids_BT = torch.arange(input_ids_BT.shape[1], device=input_ids_BT.device)[None]
        rope = self.rotary(hidden_BTD, position_ids_BT)
        mask = causal_mask(self.config, hidden_BTD, position_ids_BT)
        return run_layers(self.layers, hidden_BTD, position_ids_BT, rope, mask), position_ids_BT, rope, mask


class ExitHead(torch.nn.Module):
    """The trainable drafter part: [decoder layer] -> norm -> untied head (no layer = head-only exit).

    It speaks the bit of a transformers model's interface that models/draft_vocab.py uses (`config.draft_vocab`,
    get/set_output_embeddings, `device`), so a reduced head is attached, read and checked by the same helpers
    as every other drafter's, and `config.hidden_size`, which a θ predictor checks its drafter by."""

    def __init__(self, layer: torch.nn.Module | None, norm: torch.nn.Module, lm_head: torch.nn.Linear):
        super().__init__()
        self.layer, self.norm, self.lm_head = layer, norm, lm_head
        # draft_vocab: target ids of the head's rows (None = the full vocabulary)
        self.config = SimpleNamespace(draft_vocab=None, hidden_size=lm_head.in_features)
        if layer is not None:
            _set_layer_idx(layer, 0)  # the exit layer keeps its own one-layer cache

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, head: torch.nn.Linear) -> None:
        self.lm_head = head

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @classmethod
    def from_target(cls, parts: TargetParts, n: int, with_layer: bool = True, layer_init: str = "last",
                    head_init: str = "target", seed: int = 0, draft_vocab: list[int] | None = None) -> ExitHead:
        """Init per EESD §3.1: layer <- the target's last layer, norm/head <- its final norm and head (with
        `draft_vocab`, the head's rows at those target ids: a Linear(D, N))."""
        layer = None
        if with_layer:
            source = parts.layers[-1] if layer_init != "next" else parts.layers[n]
            layer = copy.deepcopy(source)
            if layer_init == "random":
                _reinit(layer, parts.config, seed)
        norm = copy.deepcopy(parts.norm)
        head = torch.nn.Linear(parts.head.in_features, parts.head.out_features, bias=parts.head.bias is not None)
        with torch.no_grad():
            if head_init == "target":
                head.weight.copy_(parts.head.weight)  # a copy: untied from the target's embeddings
                if head.bias is not None:
                    head.bias.copy_(parts.head.bias)
            else:
                _reinit(head, parts.config, seed)
        exit_head = cls(layer, norm, head.to(parts.head.weight.dtype))
        if draft_vocab is not None:
            from draftforge.models.draft_vocab import attach_reduced_head

            attach_reduced_head(exit_head, draft_vocab)
        return exit_head

    @classmethod
    def empty_like(cls, parts: TargetParts, with_layer: bool, draft_vocab: list[int] | None = None) -> ExitHead:
        """The right shapes for loading exported weights (values are overwritten)."""
        return cls.from_target(parts, 1, with_layer=with_layer, layer_init="last", head_init="target",
                               draft_vocab=draft_vocab)

    def forward(self, hidden_BTD, position_ids_BT=None, position_embeddings=None, mask=None, cache=None):
        """(logits [B, T, V] (N draft ids for a reduced head), post-norm state [B, T, D]) of H^N rows."""
        if self.layer is not None:
            hidden_BTD = run_layers([self.layer], hidden_BTD, position_ids_BT, position_embeddings, mask, cache)
        normed_BTD = self.norm(hidden_BTD)
        return self.lm_head(normed_BTD), normed_BTD


def _set_layer_idx(module: torch.nn.Module, idx: int) -> None:
    for sub in module.modules():
        if hasattr(sub, "layer_idx"):
            sub.layer_idx = idx


def _reinit(module: torch.nn.Module, config, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    std = getattr(config, "initializer_range", 0.02)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif "norm" in name or "layernorm" in name:
                p.fill_(1.0)
            else:
                p.zero_()
