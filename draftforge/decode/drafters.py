"""`load_drafter`: a drafter for a checkpoint, checked against and bound to its target.

The interface every drafter implements lives in drafter_base.py (re-exported here).
"""

from __future__ import annotations

from draftforge.decode.cuda_graphs import use_cuda_graphs
from draftforge.decode.drafter_base import Drafter, propose_children  # noqa: F401  (public names)
from draftforge.decode.drafter_hf import TransformerDrafter
from draftforge.decode.drafter_mamba import MambaDrafter
from draftforge.decode.targets import SSM_MODEL_TYPES, Target, is_recurrent_model, load_hf_causal_lm
from draftforge.errors import CompatibilityError


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
    """A MambaDrafter for Mamba/Mamba2 checkpoints (HF or draftforge export), an EarlyExitDrafter for an EESD
    export (task eesd), else a TransformerDrafter.

    cuda_graphs ("auto" | "on" | "off") applies to Mamba drafters: their per-batch-size decode steps
    are CUDA graphs when on (auto: exactly when the drafter is on CUDA); Transformer drafters ignore it.
    """
    from draftforge.models.early_exit_export import is_eesd_export

    if is_eesd_export(model_or_path):  # an EESD exit head: attached to (and checked against) this target
        from draftforge.decode.early_exit import load_early_exit

        return load_early_exit(model_or_path, target, device=device, dtype=dtype)
    model, found_tokenizer = load_hf_causal_lm(model_or_path, device, dtype, "drafter")
    tokenizer = tokenizer if tokenizer is not None else found_tokenizer
    check_vocab(target, model, tokenizer, allow_vocab_mismatch)
    if model.config.model_type in SSM_MODEL_TYPES:
        drafter = MambaDrafter(model, target.vocab_size, tokenizer, cuda_graphs=cuda_graphs)
    elif is_recurrent_model(model.config):  # a hybrid's recurrent state cannot be cropped like a KV cache
        raise CompatibilityError(
            f"drafter {model.config.model_type!r} is a hybrid/recurrent model; drafters are Mamba / Mamba2 models "
            "or Transformers with a KV cache (distil a Mamba2 drafter from it with task distill)")
    else:
        use_cuda_graphs(cuda_graphs, model.device)  # same validation for every drafter kind
        drafter = TransformerDrafter(model, target.vocab_size, tokenizer)
    drafter.bind(target)
    return drafter
