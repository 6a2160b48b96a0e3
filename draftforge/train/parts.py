"""Pieces any task builder may need: the tokenizer, where a checkpoint lives, the vocabulary size.

Task modules import these from here, never from another task's module.
"""

from __future__ import annotations

from pathlib import Path

from draftforge.errors import CheckpointError, RecipeError
from draftforge.loading import check_local, load_config


def resolve_checkpoint(path: str) -> str:
    """A run dir resolves to its export; an export dir or a HF id is used as is."""
    p = Path(path)
    if not p.exists():  # a missing local path says so here, before any loader asks the Hub for it
        from draftforge.loading import local_model_dir

        local_model_dir(path, "model.init_from")
    if p.is_dir() and not (p / "config.json").is_file():
        if (p / "export" / "config.json").is_file():
            return str(p / "export")
        raise CheckpointError(f"{p} is neither an export (no config.json) nor a finished run (no export/); "
                              "point model.init_from at an export directory or finish the run first")
    return path


def load_tokenizer(recipe):
    """The recipe's tokenizer: model.tokenizer, else the target's, else init_from's."""
    from transformers import AutoTokenizer

    m = recipe.model
    if m.tokenizer or m.target:
        key, source = ("model.tokenizer", m.tokenizer) if m.tokenizer else ("model.target", m.target)
    else:
        key, source = "model.init_from", resolve_checkpoint(m.init_from)
    check_local(source, key)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise RecipeError(f"recipe key '{key}': cannot load a tokenizer from {source!r} ({e})") from None
    if m.tokenizer and m.target and Path(m.target).is_dir():  # a drafter of another tokenizer trained to the end
        from draftforge.export import tokenizer_fingerprint

        try:
            theirs = AutoTokenizer.from_pretrained(m.target)
        except (OSError, ValueError, TypeError):
            theirs = None  # a bare checkpoint without tokenizer files: token ids alone, nothing to compare
        if theirs is not None and tokenizer_fingerprint(theirs) != tokenizer_fingerprint(tokenizer):
            raise RecipeError(f"recipe key 'model.tokenizer': {m.tokenizer!r} ({len(tokenizer)} tokens) is not the "
                              f"tokenizer of model.target {m.target!r} ({len(theirs)} tokens); a drafter must "
                              "tokenize as its target does: drop model.tokenizer to use the target's")
    return tokenizer


def local_tokenizer(recipe):
    """The recipe's tokenizer when model.tokenizer / model.target is a local directory that holds one, else
    None: tasks on harvested rows (c2t, theta) check the harvest's tokenizer with it, and a bare target
    checkpoint without tokenizer files (usable with token ids alone) leaves nothing to check."""
    from transformers import AutoTokenizer

    source = recipe.model.tokenizer or recipe.model.target
    if not source or not Path(source).is_dir():
        return None
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError):  # the same "no tokenizer here" as decode.loading.load_hf_causal_lm
        return None


def target_vocab_size(recipe) -> int | None:
    if not recipe.model.target:
        return None
    return load_config(recipe.model.target, "model.target").vocab_size


def model_vocab_size(recipe, tokenizer) -> int:
    """Rows of the embedding the model will have: init_from's config, else the target's, else the tokenizer."""
    if recipe.model.init_from:
        return load_config(resolve_checkpoint(recipe.model.init_from), "model.init_from").vocab_size
    return target_vocab_size(recipe) or len(tokenizer)
