"""Tasks `pretrain` and `sft`: next-token cross-entropy on a drafter (Mamba Drafters §A.3).

`pretrain` trains from scratch on packed text; `sft` starts from a pretrained checkpoint
(`model.init_from`) and trains on chat data with the loss on assistant tokens only (or on
token rows with their own loss mask, e.g. a target's continuations as the ids it emitted),
optionally through LoRA adapters. Both accept any small HF causal LM as the student.
`build_lm_task` returns the whole, frozen TaskSpec; distill (train/distill.py) builds on it with
dataclasses.replace, and the export's own keys are its `export_metadata` (laid over the caller's by
`TaskSpec.write_export`), never a dict the export closure shares.
Legend: B = batch, T = block size, V = vocab.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from draftforge.errors import CheckpointError, RecipeError
from draftforge.models.draft_vocab import attach_reduced_head, d2t_of, frequent_tokens, target_to_draft
from draftforge.recipe import Recipe, require
from draftforge.train.parts import load_tokenizer, model_vocab_size, resolve_checkpoint, target_vocab_size


DRAFT_VOCAB_FILE = "draft_vocab.json"  # in the run dir: the draft -> target ids the run's head predicts


def check_sft(recipe: Recipe) -> None:
    """sft's own rules, checked when the recipe loads (before --overwrite touches the old run)."""
    require(bool(recipe.model.init_from), "model.init_from",
             "sft starts from a pretrained drafter; point it at a pretrain run, an export or a HF model id")
    require(recipe.data.format in ("chat", "tokens"), "data.format",
             "the sft task trains on chat data or token rows with a loss mask: set format: chat or tokens")


def loss_tokens(batch: dict) -> torch.Tensor:
    """Positions that carry a next-token loss (labels shifted by one, -100 = none)."""
    return (batch["labels"][:, 1:] != -100).sum()


def lm_loss(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Summed next-token CE over positions whose label is not -100, and how many there are.

    The labels are shifted (the last position gets -100), not the logits: slicing logits[:, :-1]
    would copy the B x T x V tensor forward and backward.
    """
    return next_token_ce(model(input_ids=batch["input_ids"]).logits, batch["labels"])


def next_token_ce(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(summed CE of each position's logits against the next label, labelled positions, {}); -100 = none."""
    next_BT = F.pad(labels_BT[:, 1:], (0, 1), value=-100)
    loss_sum = F.cross_entropy(logits_BTV.flatten(0, 1).float(), next_BT.flatten(), ignore_index=-100,
                               reduction="sum")
    return loss_sum, (next_BT != -100).sum(), {}


def build_model(recipe: Recipe, tokenizer, data=None):
    """The drafter: fresh or from init_from, with a reduced draft head when model.draft_vocab asks, then LoRA."""
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
        if m.embed_from_target:
            from draftforge.models.target_embed import init_embeddings_from_target

            info = init_embeddings_from_target(model, resolve_checkpoint(m.target))
            if os.environ.get("RANK", "0") == "0":
                print(f"[draftforge] embedding from the target: {info}", flush=True)
    check_vocab_fits(model, tokenizer)
    d2t = choose_draft_vocab(recipe, model, data, tokenizer)
    if d2t is not None and d2t_of(model) is None:
        attach_reduced_head(model, d2t)
    if m.lora.enabled:
        model = add_lora(model, m.lora)
    return model


def choose_draft_vocab(recipe: Recipe, model, data, tokenizer) -> list[int] | None:
    """The draft vocabulary: init_from's own, else counted on the training data, else the run's saved one."""
    want, have = recipe.model.draft_vocab, d2t_of(model)
    if have is not None:
        if want is not None and want != len(have):
            raise RecipeError(f"recipe key 'model.draft_vocab': {want}, but model.init_from already has a draft "
                              f"vocabulary of {len(have)} ids; drop the key or use the same size")
        return have.tolist()
    if want is None:
        return None
    saved = Path(recipe.output_dir) / DRAFT_VOCAB_FILE
    if data is None:  # `draftforge export` rebuilds the model without data: the run wrote its map
        if not saved.is_file():
            raise CheckpointError(f"{saved} is missing: the run's draft vocabulary cannot be rebuilt without it")
        return json.loads(saved.read_text())
    vocab = model.get_input_embeddings().weight.shape[0]
    if recipe.model.draft_vocab_from:
        labels = row_labels(recipe.model.draft_vocab_from, tokenizer)
    elif not hasattr(data.train, "data"):
        raise RecipeError("recipe key 'model.draft_vocab': counting token frequencies needs map-style data "
                          "(streaming: false), or model.draft_vocab_from")
    else:
        # batches of arrow rows, read through the dataset's index map (a mixed or sampled dataset's .data still
        # holds the rows it dropped)
        batches = data.train.with_format("arrow").iter(batch_size=8192)
        labels = (chunk.flatten().to_numpy() for batch in batches for chunk in batch.column("labels").chunks)
    return frequent_tokens(labels, vocab, want, always=(tokenizer.eos_token_id,))


def row_labels(source: str, tokenizer=None):
    """The loss-carrying ids of every token row in `source` (a file, folder or glob), row by row; the files'
    recorded tokenizer is checked against `tokenizer` at once (counts of another tokenizer's ids are noise)."""
    from draftforge.data.provenance import check_row_files
    from draftforge.data.sources import iter_located_rows, normalize_tokens, resolve_local_files

    files = resolve_local_files(source, "**/*")
    check_row_files(files, tokenizer)
    return (normalize_tokens(row, where)["labels"] for path in files for where, row in iter_located_rows(path))


def labels_to_draft_ids(t2d_V: torch.Tensor):
    """A collate that maps target-id labels to draft ids (-100 where the draft vocabulary lacks the token); the
    target ids stay as `target_labels`, so acceptance can count the positions the head cannot get right."""
    from draftforge.train.spec import tensor_collate

    def collate(columns, device):
        batch = tensor_collate(columns, device)
        labels_BT = batch["labels"]
        mapped_BT = t2d_V.to(labels_BT.device)[labels_BT.clamp_min(0)]
        batch["labels"] = torch.where(labels_BT < 0, labels_BT, mapped_BT)
        batch["target_labels"] = labels_BT
        return batch

    return collate


# LoRA's default targets: the projections each family has. A Mamba mixer's out_proj and conv1d are left out:
# its fused CUDA kernel reads their weights directly, past an adapter, and PEFT refuses them for that reason.
LORA_DEFAULT_TARGETS = {"mamba": ["in_proj", "x_proj", "dt_proj"],
                        "attention": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def add_lora(model, lora):
    from peft import LoraConfig, get_peft_model

    family = "mamba" if "mamba" in model.config.model_type else "attention"
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = lora.target_modules or [t for t in LORA_DEFAULT_TARGETS[family] if t in names]
    cfg = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                     task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


def check_context(recipe: Recipe, vocab_size: int) -> None:
    """block_size must fit the model's positions: read from the config, before data or model is built (which also
    checks a fresh model's preset and overrides before minutes of tokenizing)."""
    from transformers import AutoConfig

    m = recipe.model
    if m.init_from:
        config = AutoConfig.from_pretrained(resolve_checkpoint(m.init_from))
    elif m.arch in ("mamba", "mamba2"):
        from draftforge.models.mamba import resolve_mamba_dims

        resolve_mamba_dims(m.arch, m.size or "tiny", m.overrides)  # a preset typo, a bad override
        return  # recurrent: no position limit
    else:
        from draftforge.models.student import resolve_causal_lm_config

        config = resolve_causal_lm_config(m.arch, vocab_size, size=m.size, overrides=m.overrides)
    ctx = getattr(config, "max_position_embeddings", None)
    if ctx is not None and recipe.train.block_size > ctx:
        raise RecipeError(f"recipe key 'train.block_size': {recipe.train.block_size} exceeds the model context "
                          f"({ctx} positions)")


def build_lm_task(recipe: Recipe, accelerator, with_data: bool = True, build_data=None):
    """pretrain / sft: the drafter (or LoRA-wrapped drafter) and packed blocks of input_ids + labels.

    build_data(cfg, tokenizer, block_size, seed, vocab_size=...) -> BlockData replaces the usual blocks (distill
    on a logits cache: the same rows with a column naming each position's cache entry). A task built on this one
    (distill) takes dataclasses.replace of the spec: its loss, collate, frozen modules and export keys."""
    from draftforge.data import build_block_data, describe
    from draftforge.export import export_model, tokenizer_fingerprint
    from draftforge.train.spec import TaskSpec, tensor_collate

    tokenizer = load_tokenizer(recipe)
    data, meta = None, {"tokenizer_fingerprint": tokenizer_fingerprint(tokenizer)}
    if with_data:
        vocab_size = model_vocab_size(recipe, tokenizer)
        check_context(recipe, vocab_size)
        with accelerator.main_process_first():  # rank 0 tokenizes and fills the datasets cache first
            data = (build_data or build_block_data)(recipe.data, tokenizer, recipe.train.block_size,
                                                    recipe.train.seed, vocab_size=vocab_size)
        accelerator.print(f"[draftforge] {describe(data)}")
        meta["data_stats"] = dict(data.stats)
    model = build_model(recipe, tokenizer, data)
    d2t = d2t_of(model)
    collate, run_files = tensor_collate, {}
    if d2t is not None:
        vocab = model.get_input_embeddings().weight.shape[0]
        collate = labels_to_draft_ids(target_to_draft(vocab, d2t.tolist()))
        run_files[DRAFT_VOCAB_FILE] = json.dumps(d2t.tolist())
        meta["draft_vocab_size"] = len(d2t)
        accelerator.print(f"[draftforge] draft vocabulary: {len(d2t):,} of {vocab:,} target tokens (head rows)")

    def export(trained, out_dir, metadata, overwrite=False):  # metadata: the caller's + export_metadata
        return export_model(trained, tokenizer, out_dir, metadata=metadata, overwrite=overwrite)

    return TaskSpec(model=model, loss=lm_loss, count=loss_tokens, train_data=data and data.train,
                    eval_data=data and data.eval, collate=collate, export=export, tokenizer=tokenizer,
                    unit="tokens", export_metadata=meta, data_stats=data.stats if data else {}, run_files=run_files)
