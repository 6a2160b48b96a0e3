"""Drafter interface, child proposal shared by all drafters, and `load_drafter`.

A drafter sees the committed sequence, proposes a DraftTree for a configuration (N1..Nγ), and is
told which root path the target accepted. Any future drafter (EESD early exit, distilled SSM)
implements `draft` and `accept`; the engine needs nothing else.

Legend: B rows (tree nodes at one depth), V vocabulary.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from draftforge.decode.cuda_graphs import use_cuda_graphs
from draftforge.decode.sampling import SamplingParams, match_vocab, probs_from_logits, sample
from draftforge.decode.targets import SSM_MODEL_TYPES, Target, load_hf_causal_lm
from draftforge.decode.tree import DraftTree
from draftforge.errors import CompatibilityError


class Drafter(ABC):
    """Base class: `draft` proposes a tree for `seq`, `accept(path)` rolls state to the accepted prefix."""

    kind = "abstract"  # "mamba", "transformer", ... (hf_assisted needs "transformer")
    model = None
    tokenizer = None
    vocab_size: int  # the target's vocabulary width that drafts and q distributions use

    @abstractmethod
    def reset(self) -> None:
        """Forget all state (a new prompt starts)."""

    @abstractmethod
    def draft(self, seq: list[int], widths: tuple[int, ...], params: SamplingParams, generator) -> DraftTree:
        """Propose a tree with configuration `widths` continuing `seq` (prompt + committed tokens)."""

    @abstractmethod
    def accept(self, path: list[int]) -> None:
        """The target accepted these nodes (root path, depth 1 first) of the last draft."""

    @property
    def steps_per_draft(self) -> str:
        return "one drafter forward per depth"


def propose_children(logits_BV: torch.Tensor, width: int, params: SamplingParams, vocab: int, generator):
    """Children tokens [B, width] and, at T>0, the distribution q [B, V] they were drawn from.

    Greedy: the `width` most likely distinct tokens. T>0: i.i.d. draws from q, which multi-step
    speculative sampling needs to stay lossless (SpecInfer §4.2).
    """
    logits_BV = match_vocab(logits_BV, vocab)
    if params.greedy:
        return torch.topk(logits_BV, width, dim=-1).indices, None
    q_BV = probs_from_logits(logits_BV, params)
    return sample(q_BV.to(generator.device), generator, width).to(logits_BV.device), q_BV


def check_vocab(target: Target, model, tokenizer, allow_vocab_mismatch: bool) -> None:
    """Refuse a drafter whose tokenizer differs from the target's (named in the error).

    Compares tokenizer vocabularies when both exist, else the config vocab sizes. With
    allow_vocab_mismatch=True the ids are used as they are (no mapping): drafter logits are cut or
    padded to the target's width. Output stays lossless (the target verifies every token) but
    acceptance is only meaningful if the two tokenizers agree on the ids they share.
    """
    t_name = getattr(target.tokenizer, "name_or_path", None) or target.model.config.name_or_path or "target"
    d_name = getattr(tokenizer, "name_or_path", None) or model.config.name_or_path or "drafter"
    if target.tokenizer is not None and tokenizer is not None:
        same = target.tokenizer.get_vocab() == tokenizer.get_vocab()
        detail = f"tokenizers differ: target {t_name!r} ({len(target.tokenizer)} tokens) vs drafter {d_name!r} ({len(tokenizer)} tokens)"
    else:
        t_vocab, d_vocab = target.model.config.vocab_size, model.config.vocab_size
        same = t_vocab == d_vocab
        detail = f"vocab sizes differ: target {t_name!r} has {t_vocab}, drafter {d_name!r} has {d_vocab}"
    if not same and not allow_vocab_mismatch:
        raise CompatibilityError(
            f"{detail}; train the drafter with the target's tokenizer, or pass allow_vocab_mismatch=True "
            "(--allow-vocab-mismatch) to use token ids as they are"
        )


def load_drafter(model_or_path, target: Target, device="cpu", dtype=None, allow_vocab_mismatch=False, tokenizer=None,
                 cuda_graphs="auto"):
    """A MambaDrafter for Mamba/Mamba2 checkpoints (HF or draftforge export), else a TransformerDrafter.

    cuda_graphs ("auto" | "on" | "off") applies to Mamba drafters: their per-batch-size decode steps
    are CUDA graphs when on (auto: exactly when the drafter is on CUDA); Transformer drafters ignore it.
    """
    from draftforge.decode.drafter_hf import TransformerDrafter
    from draftforge.decode.drafter_mamba import MambaDrafter

    model, found_tokenizer = load_hf_causal_lm(model_or_path, device, dtype, "drafter")
    tokenizer = tokenizer if tokenizer is not None else found_tokenizer
    check_vocab(target, model, tokenizer, allow_vocab_mismatch)
    if model.config.model_type in SSM_MODEL_TYPES:
        return MambaDrafter(model, target.vocab_size, tokenizer, cuda_graphs=cuda_graphs)
    use_cuda_graphs(cuda_graphs, model.device)  # same validation for every drafter kind
    return TransformerDrafter(model, target.vocab_size, tokenizer)
