"""A reduced draft vocabulary: the drafter's head predicts only the target's N most frequent tokens.

At a 49,152-token vocabulary the LM head dominates a small drafter's step. EAGLE-3 keeps the full
input embedding and shrinks the output head to the most frequent tokens, with a `d2t` map from
draft ids to target ids. Here the map is stored in the model's config (`draft_vocab`, the target
ids of the head's rows, ascending), so a checkpoint explains itself; the head is a plain
`Linear(hidden, N)` named `lm_head`, untied from the embedding.

Verification stays lossless because the target checks every token; at T > 0 the drafter's q is a
proper distribution over the full vocabulary that is zero outside the draft vocabulary
(`to_target_logits` puts -inf there), so speculative sampling stays exact. Loading such a checkpoint
(its head does not fit config.vocab_size) is draftforge.loading's `load_causal_lm`.
Legend: B rows, T tokens, V target vocabulary, N draft vocabulary, D hidden size.
"""

from __future__ import annotations

import numpy as np
import torch

from draftforge.errors import CompatibilityError, RecipeError
from draftforge.loading import DRAFT_VOCAB_KEY as CONFIG_KEY


def frequent_tokens(labels_column, vocab_size: int, size: int, always=()) -> list[int]:
    """The `size` most frequent target ids among the loss labels (ties: lower id first), plus `always`."""
    if not 0 < size <= vocab_size:
        raise RecipeError(f"recipe key 'model.draft_vocab': must be in 1..{vocab_size} (the target's vocabulary), "
                          f"got {size}")
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids in labels_column:
        ids = np.asarray(ids, dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < vocab_size)]
        counts += np.bincount(ids, minlength=vocab_size)
    forced = sorted({int(t) for t in always if t is not None and 0 <= t < vocab_size})
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count, descending; then by id
    chosen = forced + [int(t) for t in order if int(t) not in forced][: size - len(forced)]
    return sorted(chosen)


def d2t_of(model) -> torch.Tensor | None:
    """The draft -> target id map of a reduced-vocabulary drafter (None for a full-vocabulary one)."""
    ids = getattr(model.config, CONFIG_KEY, None)
    return None if ids is None else torch.tensor(ids, dtype=torch.long)


def attach_reduced_head(model, d2t: list[int]):
    """Replace the LM head by a head over the draft ids, initialised from the current head's rows."""
    old = model.get_output_embeddings().weight
    check_map(d2t, old.shape[0], "the model")
    head = torch.nn.Linear(old.shape[1], len(d2t), bias=False, dtype=old.dtype, device=old.device)
    with torch.no_grad():
        head.weight.copy_(old[torch.tensor(d2t, device=old.device)])
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    model.set_output_embeddings(head)
    setattr(model.config, CONFIG_KEY, [int(t) for t in d2t])
    return model


def check_map(d2t, target_vocab: int, what: str = "the target") -> None:
    """CompatibilityError when a draft id maps outside the target's vocabulary or twice to one id."""
    ids = list(d2t)
    bad = [t for t in ids if not 0 <= int(t) < target_vocab]
    if bad:
        raise CompatibilityError(f"the drafter's draft vocabulary maps to ids {bad[:5]} outside {what}'s vocabulary "
                                 f"(size {target_vocab}); it was made for another target")
    if len(set(ids)) != len(ids):
        raise CompatibilityError("the drafter's draft vocabulary lists a target id twice; re-export it")


def to_target_logits(logits_BN: torch.Tensor, d2t_N: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """Scatter draft-head logits into the target's vocabulary; ids outside the draft vocabulary get -inf."""
    full_BV = logits_BN.new_full((*logits_BN.shape[:-1], target_vocab), float("-inf"))
    full_BV[..., d2t_N] = logits_BN
    return full_BV


def target_to_draft(target_vocab: int, d2t: list[int]) -> torch.Tensor:
    """t2d [V]: the draft id of every target id, -100 (no loss) where the draft vocabulary lacks it."""
    t2d = torch.full((target_vocab,), -100, dtype=torch.long)
    t2d[torch.tensor(d2t, dtype=torch.long)] = torch.arange(len(d2t))
    return t2d
