"""draftforge.models: drafter and student builders (`build_model` dispatches by architecture)."""

from __future__ import annotations

import torch

from draftforge.errors import CompatibilityError
from draftforge.models.mamba import MAMBA_PRESETS, build_mamba
from draftforge.models.student import LLAMA_PRESETS, build_causal_lm, load_pretrained

__all__ = ["MAMBA_PRESETS", "LLAMA_PRESETS", "build_mamba", "build_causal_lm", "load_pretrained",
           "build_model", "count_parameters", "check_vocab_fits"]


def build_model(arch: str, vocab_size: int, size: str | None = None, overrides: dict | None = None,
                max_position_embeddings: int | None = None, **special_ids) -> torch.nn.Module:
    """A fresh model: Mamba/Mamba2 via `build_mamba` (size defaults to "tiny"), anything else via transformers.

    `max_position_embeddings` only applies to position-embedding models; an SSM has no context limit to set.
    """
    if arch in ("mamba", "mamba2"):
        return build_mamba(arch, vocab_size, size=size or "tiny", overrides=overrides, **special_ids)
    return build_causal_lm(arch, vocab_size, size=size, overrides=overrides,
                           max_position_embeddings=max_position_embeddings, **special_ids)


def count_parameters(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters; tied weights count once (`parameters()` already de-duplicates them)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def check_vocab_fits(model: torch.nn.Module, tokenizer) -> None:
    """CompatibilityError when the tokenizer can emit ids the model's embedding has no row for."""
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        raise CompatibilityError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has {len(tokenizer)} tokens but the model's "
            f"embedding has {rows} rows; use the model's own tokenizer or build it with vocab_size=len(tokenizer)")


# Modules that moved after 0.1.0 (one home per method, sub-packages by role): their old names import the new modules,
# with a DeprecationWarning, until the next release.
from draftforge.deprecation import moved_modules  # noqa: E402

moved_modules({
    "draftforge.models.early_exit_export": "draftforge.models.eesd_export",
    "draftforge.models.early_exit": "draftforge.models.eesd",
    "draftforge.models.theta": "draftforge.models.cali_ts",
})
