"""Task `eesd`: an early-exit drafter on a frozen target (EESD §3.1-3.2, App. C).

Frozen (TaskSpec.frozen): the target's embeddings and layers 1..N. Trained: one decoder layer (a copy of
the target's last layer), a norm (the target's final norm) and an untied LM head (the target's head),
by next-token cross-entropy on self-distilled data (the target's own outputs as `format: tokens` rows,
e.g. from `draftforge generate`) mixed with open data (`eesd.open_sources`) at `eesd.open_fraction`.
The export holds only the trained parts plus the target's identity (draftforge.models.eesd_export).
`model.draft_vocab: N` shrinks the head to the target's N most frequent ids (as the other drafters' heads,
train/lm.py: on SmolLM2 the full 49,152-row head costs as much as several decoder layers per draft step);
labels outside those ids carry no loss.
Legend: B batch, T block size, V vocabulary (N draft ids for a reduced head), D hidden size.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from draftforge.errors import RecipeError
from draftforge.models.eesd import (
    HEAD_INITS,
    LAYER_INITS,
    check_exit_after,
    check_family,
    default_exit_after,
)
from draftforge.recipe import Recipe, doc, require
from draftforge.train.lm import next_token_ce


@dataclass
class EesdConfig:
    exit_after_layer: int | None = doc(None, "N: the exit sits after target layer N (1 <= N < layers); "
                                             "None = about 10% of the target's layers (EESD §5.4)")
    exit_layer: bool = doc(True, "train an exit decoder layer before the norm + head; false = head-only exit "
                                 "(the paper's 'w/o EE layer' ablation)")
    layer_init: str = doc("last", "exit layer init: 'last' (copy of the target's last layer, EESD §3.1), "
                                  "'next' (copy of layer N+1) or 'random'")
    head_init: str = doc("target", "LM head init: 'target' (a copy of the target's head) or 'random'; the norm is "
                                   "a copy of the target's final norm either way")
    open_sources: list[str] = doc([], "open data mixed with data.sources (the self-distilled rows); read like "
                                      "data.sources with format eesd.open_format")
    open_format: str = doc("text", "format of open_sources: text, chat or tokens")
    open_fraction: float = doc(0.5, "share of training blocks taken from open_sources (spec: 50/50)")

    def check(self, at: str) -> None:
        require(self.layer_init in LAYER_INITS, f"{at}.layer_init", f"must be one of {', '.join(LAYER_INITS)}")
        require(self.head_init in HEAD_INITS, f"{at}.head_init", f"must be one of {', '.join(HEAD_INITS)}")
        require(self.open_format in ("text", "chat", "tokens"), f"{at}.open_format", "must be text, chat or tokens")
        require(0.0 < self.open_fraction < 1.0, f"{at}.open_fraction", "must be in (0, 1)")
        require(self.exit_after_layer is None or self.exit_after_layer >= 1, f"{at}.exit_after_layer",
                f"must be >= 1 (the exit needs at least one target layer below it), got {self.exit_after_layer}")


def check_eesd(recipe: Recipe) -> None:
    """eesd's recipe rules, before anything is built: a target, and N inside it."""
    from draftforge.loading import load_config

    require(bool(recipe.model.target), "model.target", "eesd trains an exit head on a frozen target: set model.target")
    if not Path(recipe.model.target).is_dir():
        return  # a Hub id or a path made later: checked when the task is built
    config = load_config(recipe.model.target, "model.target")
    check_family(config.model_type)
    layers = getattr(config, "num_hidden_layers", None)
    cfg = recipe.task_options
    if layers is not None and cfg.exit_after_layer is not None:
        check_exit_after(cfg.exit_after_layer, layers, "eesd.exit_after_layer")


def exit_after(cfg: EesdConfig, num_layers: int) -> int:
    n = cfg.exit_after_layer if cfg.exit_after_layer is not None else default_exit_after(num_layers)
    return check_exit_after(n, num_layers, "eesd.exit_after_layer")


def head_loss(trunk):
    """loss(model, batch): the frozen trunk gives H^N without gradients, the exit head is trained (CE)."""

    def loss(model, batch):
        with torch.no_grad():
            hidden_BTD, position_ids_BT, rope, mask = trunk(batch["input_ids"])
        logits_BTV, _ = model(hidden_BTD, position_ids_BT, rope, mask)
        return next_token_ce(logits_BTV, batch["labels"])

    return loss


def loss_tokens(batch: dict) -> torch.Tensor:
    """Positions with a next-token label (labels shifted by one, -100 = none)."""
    return (batch["labels"][:, 1:] != -100).sum()


def mixed_blocks(recipe: Recipe, tokenizer, vocab_size: int):
    """data.sources blocks, mixed with eesd.open_sources blocks at open_fraction (by block count)."""
    from draftforge.data import build_block_data

    t, cfg = recipe.train, recipe.task_options
    main = build_block_data(recipe.data, tokenizer, t.block_size, t.seed, vocab_size=vocab_size)
    if not cfg.open_sources:
        return main
    if recipe.data.streaming:
        raise RecipeError("recipe key 'eesd.open_sources': mixing needs map-style data (data.streaming: false)")
    open_cfg = dataclasses.replace(recipe.data, sources=list(cfg.open_sources), format=cfg.open_format)
    if recipe.data.eval_sources:  # the held-out set is data.eval_sources alone: all open data trains
        open_cfg = dataclasses.replace(open_cfg, eval_sources=[], eval_fraction=0.0)
    extra = build_block_data(open_cfg, tokenizer, t.block_size, t.seed, vocab_size=vocab_size)
    main.train, n_main, n_open = _mix(main.train, extra.train, cfg.open_fraction, t.seed)
    if extra.eval is not None:
        import datasets

        main.eval = extra.eval if main.eval is None else datasets.concatenate_datasets([main.eval, extra.eval])
    main.stats.update(self_distilled_blocks=n_main, open_blocks=n_open, open_fraction=cfg.open_fraction)
    return main


def _mix(a, b, fraction: float, seed: int):
    """Blocks of `a` and `b` with b's share = fraction. The surplus of whichever has more is dropped at random
    (seeded): blocks sit in the order of their sources, so keeping the first ones would keep only the first
    sources' text."""
    import datasets
    import numpy as np

    n_a, n_b = len(a), len(b)
    want_b = round(n_a * fraction / (1 - fraction))
    if want_b > n_b:
        n_a, want_b = max(1, round(n_b * (1 - fraction) / fraction)), n_b
    n_a = min(n_a, len(a))
    rng = np.random.default_rng(seed)

    def some(blocks, n: int):
        return blocks if n == len(blocks) else blocks.select(np.sort(rng.permutation(len(blocks))[:n]))

    return datasets.concatenate_datasets([some(a, n_a), some(b, want_b)]), n_a, want_b


def build_eesd_task(recipe: Recipe, accelerator, with_data: bool = True):
    """The exit head (trainable), the target's trunk (frozen), blocks of input_ids + labels."""
    from draftforge.data import describe
    from draftforge.loading import load_causal_lm
    from draftforge.models.draft_vocab import target_to_draft
    from draftforge.models.eesd import ExitHead, Trunk, split_target
    from draftforge.models.eesd_export import save_exit_head, target_identity
    from draftforge.train.lm import (
        DRAFT_VOCAB_FILE,
        choose_draft_vocab,
        labels_to_draft_ids,
    )
    from draftforge.train.parts import load_tokenizer
    from draftforge.train.spec import TaskSpec, tensor_collate

    cfg = recipe.task_options
    tokenizer = load_tokenizer(recipe)
    target = load_causal_lm(recipe.model.target, what="target", dtype=torch.float32)
    parts = split_target(target)
    n = exit_after(cfg, parts.num_layers)
    identity = target_identity(parts, n)
    data = None
    if with_data:
        with accelerator.main_process_first():
            data = mixed_blocks(recipe, tokenizer, identity["vocab_size"])
        accelerator.print(f"[draftforge] {describe(data)}")
    # The target stands in for the drafter here: it has no map of its own, and its vocabulary is the one counted.
    d2t = choose_draft_vocab(recipe, target, data, tokenizer)
    head = ExitHead.from_target(parts, n, cfg.exit_layer, cfg.layer_init, cfg.head_init, recipe.train.seed,
                                draft_vocab=d2t)
    trunk = Trunk(parts, n)
    del target, parts  # layers N+1..L, the final norm and the head are not needed any more
    trainable = sum(p.numel() for p in head.parameters())
    head_rows = f"{len(d2t):,}-token draft vocabulary" if d2t is not None else "full vocabulary"
    accelerator.print(f"[draftforge] eesd: exit after layer {n} of {identity['num_layers']}, "
                      f"{'exit layer + ' if cfg.exit_layer else 'head-only: '}norm + head ({head_rows}), "
                      f"{trainable:,} trainable parameters")
    meta = {"exit_after_layer": n}
    collate, run_files = tensor_collate, {}
    if d2t is not None:  # labels become draft ids (-100 outside the draft vocabulary), as for the other drafters
        collate = labels_to_draft_ids(target_to_draft(identity["vocab_size"], d2t))
        run_files[DRAFT_VOCAB_FILE] = json.dumps(d2t)
        meta["draft_vocab_size"] = len(d2t)

    def export(trained, out_dir, metadata, overwrite=False):  # metadata: the caller's + export_metadata (meta)
        return save_exit_head(trained, identity, tokenizer, out_dir, metadata, overwrite=overwrite)

    return TaskSpec(model=head, loss=head_loss(trunk), count=loss_tokens, frozen={"trunk": trunk},
                    train_data=data and data.train, eval_data=data and data.eval, collate=collate, export=export,
                    tokenizer=tokenizer, unit="tokens", export_metadata=meta,
                    data_stats=data.stats if data else {}, run_files=run_files)
