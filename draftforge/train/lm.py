"""Tasks `pretrain` and `sft`: next-token cross-entropy on a drafter (Mamba Drafters §A.3).

`pretrain` trains from scratch on packed text; `sft` starts from a pretrained checkpoint
(`model.init_from`) and trains on chat data with the loss on assistant tokens only (or on
token rows with their own loss mask, e.g. a target's continuations as the ids it emitted),
optionally through LoRA adapters. Both accept any small HF causal LM as the student.
Legend: B = batch, T = block size, V = vocab.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from draftforge.errors import CheckpointError, RecipeError
from draftforge.recipe import Recipe


def lm_loss(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Summed next-token CE over positions whose label is not -100, and how many there are."""
    logits_BTV = model(input_ids=batch["input_ids"]).logits
    labels_BT = batch["labels"][:, 1:]
    loss_sum = F.cross_entropy(logits_BTV[:, :-1].flatten(0, 1).float(), labels_BT.flatten(),
                               ignore_index=-100, reduction="sum")
    return loss_sum, (labels_BT != -100).sum(), {}


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


def load_tokenizer(recipe: Recipe):
    from transformers import AutoTokenizer

    m = recipe.model
    source = m.tokenizer or m.target or resolve_checkpoint(m.init_from)
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise RecipeError(f"recipe key 'model.tokenizer': cannot load a tokenizer from {source!r} ({e})") from None


def target_vocab_size(recipe: Recipe) -> int | None:
    if not recipe.model.target:
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(recipe.model.target).vocab_size
    except (OSError, ValueError) as e:
        raise RecipeError(f"recipe key 'model.target': cannot read the target config ({e})") from None


def model_vocab_size(recipe: Recipe, tokenizer) -> int:
    """Rows of the embedding the model will have: init_from's config, else the target's, else the tokenizer."""
    if recipe.model.init_from:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(resolve_checkpoint(recipe.model.init_from)).vocab_size
    return target_vocab_size(recipe) or len(tokenizer)


def build_model(recipe: Recipe, tokenizer):
    from draftforge.models import build_model as build_fresh
    from draftforge.models import check_vocab_fits
    from draftforge.models.student import load_pretrained

    m = recipe.model
    if m.init_from:
        model = load_pretrained(resolve_checkpoint(m.init_from))
    else:
        vocab = target_vocab_size(recipe) or len(tokenizer)
        model = build_fresh(m.arch, vocab, size=m.size, overrides=m.overrides,
                            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id)
    check_vocab_fits(model, tokenizer)
    if m.lora.enabled:
        model = add_lora(model, m.lora)
    return model


def add_lora(model, lora):
    from peft import LoraConfig, get_peft_model

    targets = lora.target_modules or (["in_proj", "out_proj"] if "mamba" in model.config.model_type
                                      else ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    cfg = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                     task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


def check_context(recipe: Recipe, vocab_size: int) -> None:
    """block_size must fit the model's positions: read from the config, before data or model is built."""
    from transformers import AutoConfig

    m = recipe.model
    if m.init_from:
        config = AutoConfig.from_pretrained(resolve_checkpoint(m.init_from))
    elif m.arch in ("mamba", "mamba2"):
        return  # recurrent: no position limit
    else:
        from draftforge.models.student import resolve_causal_lm_config

        config = resolve_causal_lm_config(m.arch, vocab_size, size=m.size, overrides=m.overrides)
    ctx = getattr(config, "max_position_embeddings", None)
    if ctx is not None and recipe.train.block_size > ctx:
        raise RecipeError(f"recipe key 'train.block_size': {recipe.train.block_size} exceeds the model context "
                          f"({ctx} positions)")


def build_lm_task(recipe: Recipe, accelerator):
    from draftforge.data import build_block_data, describe
    from draftforge.export import tokenizer_fingerprint
    from draftforge.train.loop import TaskParts

    tokenizer = load_tokenizer(recipe)
    vocab_size = model_vocab_size(recipe, tokenizer)
    check_context(recipe, vocab_size)
    with accelerator.main_process_first():  # rank 0 tokenizes and fills the datasets cache first
        data = build_block_data(recipe.data, tokenizer, recipe.train.block_size, recipe.train.seed,
                                vocab_size=vocab_size)
    accelerator.print(f"[draftforge] {describe(data)}")
    model = build_model(recipe, tokenizer)
    meta = {"tokenizer_fingerprint": tokenizer_fingerprint(tokenizer), "data_stats": data.stats}
    return TaskParts(model=model, tokenizer=tokenizer, train_data=data.train, eval_data=data.eval,
                     loss_fn=lm_loss, export_metadata=meta, data_stats=data.stats)

