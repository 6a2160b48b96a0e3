"""Task eagle3 on a `draftforge harvest hidden` cache (recipe key eagle3.hidden_cache): the target never runs.

The task's registered builder and check (`build_task`, `check_task`) are here: a recipe with eagle3.hidden_cache is
built by `build_cached_eagle3_task`, any other by train/eagle3.py's online `build_eagle3_task` (this module builds
on that one's step loop and head, so the dispatch sits here, above both).

The blocks are the online run's (the same rows, held-out split and greedy packing: logits_cache.cached_block_data)
with two more columns, each position's cache entry (the target's top-k there) and each token's stored states. The
collate gathers them into `aux` [B, T, A] (in the stored dtype; zeros on padding, which no scored anchor attends
to) and the t_* top-k tensors (distill.cached_collate). The loss is train/eagle3.py's step loop (scored_steps)
with the K+1-outcome terms of divergences.topk_terms at t + 1 + k instead of full_terms: with K the whole (draft)
vocabulary they are the online loss up to float32 rounding, with a smaller K each is the truncated form whose
bounds docs/methods/distill.md derives. KL needs eagle3.temperature: 1 (the cache holds the target at T=1).

Of the target, only its config, its input embedding (the head reads tokens through it) and, with init: target,
its last layer, final norm and output rows are read, from its safetensors, in the dtype the online run loads it
in (bf16 when training runs bf16). The cache must come from this target (its stored files, else its weights'
fingerprint), this tokenizer, the rows file the recipe trains on, and the layers the head fuses; a reduced head
needs one harvested over its draft ids (--draft-vocab), with K at most N.

A cached row's states are the target's on that row alone: equal to the online run's, bit for bit, when each
block holds one row and the harvest's --max-len is train.block_size (tests/train/test_eagle3_cache.py); a
row packed after another in a block reads that other row online, and not here.
Legend: B batch, T block, A aux width (len(aux_layers) · D), V target vocabulary, N draft vocabulary, K top-k,
P kept positions.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from draftforge.errors import CheckpointError
from draftforge.recipe import Recipe, require
from draftforge.train.divergences import TopK, topk_terms
from draftforge.train.eagle3 import (Eagle3TaskConfig, acceptance_report, derive, kept_by_step, next_labels,
                                     scored_steps, unrolled_anchors)


def build_task(recipe: Recipe, accelerator, with_data: bool = True):
    """Task eagle3's builder: from the cache with eagle3.hidden_cache, else online (train/eagle3.py)."""
    from draftforge.train.eagle3 import build_eagle3_task

    cfg = recipe.task_options or Eagle3TaskConfig()
    build = build_cached_eagle3_task if cfg.hidden_cache else build_eagle3_task
    return build(recipe, accelerator, with_data)


def check_task(recipe: Recipe) -> None:
    """Task eagle3's recipe rules (train/eagle3.py check_eagle3), and a cached run's (check_cached)."""
    from draftforge.train.eagle3 import check_eagle3

    check_eagle3(recipe)
    cfg = recipe.task_options or Eagle3TaskConfig()
    if cfg.hidden_cache:
        check_cached(recipe, cfg)


def cache_dirs(cfg: Eagle3TaskConfig) -> list[str]:
    """eagle3.hidden_cache as a list (one cache per rows file of data.sources)."""
    value = cfg.hidden_cache
    return [] if not value else [value] if isinstance(value, str) else list(value)


def check_cached(recipe: Recipe, cfg: Eagle3TaskConfig) -> None:
    """The recipe rules of a cached run, before anything is built: token rows, one per cache, and T=1 for KL."""
    from draftforge.train.distill import check_cache_sources

    check_cache_sources(recipe.data, cache_dirs(cfg), "eagle3.hidden_cache", "a target's states and distributions")
    require(cfg.temperature == 1.0 or "kl" not in cfg.weights(), "eagle3.temperature",
            "a hidden-state cache holds the target's distribution at T=1 and its tail mass cannot be re-tempered: set "
            "temperature: 1 (or loss: tvd)")


# ---------------------------------------------------------------- the loss on cached blocks

def cached_next(batch) -> torch.Tensor:
    """next_labels where the cache holds the teacher (a row's last token in a packed block has no entry)."""
    return next_labels(batch).masked_fill(batch["cache"] < 0, -100)


def cached_count(batch) -> torch.Tensor:
    return (cached_next(batch)[:, 1:] != -100).sum()


def cached_teacher(batch, d2t_N: torch.Tensor | None):
    """terms_at for scored_steps: the cached top-k at t + 1 + k (train/eagle3.py's full_teacher, on a cache)."""
    d2t = None if d2t_N is None else d2t_N.to(batch["t_top1"].device)

    def terms_at(k, keep_BT, s_PS):
        def at(name):
            return batch[name][:, 1 + k :][keep_BT]

        top_P = s_PS.argmax(-1) if d2t is None else d2t[s_PS.argmax(-1)]
        return topk_terms(s_PS, TopK(at("t_ids"), at("t_logp"), at("t_rest"))), top_P == at("t_top1")

    return terms_at


def cached_ttt_loss(cfg: Eagle3TaskConfig, d2t_N: torch.Tensor | None):
    """loss(model, batch) -> (summed weighted loss, step-0 positions, metric sums), as ttt_loss, on cached blocks."""
    weights = cfg.weights()

    def loss(model, batch):
        tokens_BT = F.pad(batch["input_ids"][:, 1:], (0, 1), value=0)  # anchor t consumes x_{t+1}
        next_BT = cached_next(batch)
        logits_by_step = model(tokens_BT, batch["aux"], cfg.steps, unrolled_anchors(next_BT, cfg.steps),
                               kept_by_step(next_BT, cfg.steps))
        return scored_steps(logits_by_step, cached_teacher(batch, d2t_N), next_BT, cfg, weights,
                            evaluating=not model.training)

    return loss


def states_collate(collate, cache):
    """`collate`, then `aux` [B, T, A]: each token's stored states (zeros where a block has none: padding)."""
    from draftforge.data.hidden_cache import TORCH_DTYPES

    def run(columns, device):
        batch = collate(columns, device)
        state_BT = batch.pop("state").cpu()
        have_BT = state_BT >= 0
        aux_BTA = torch.zeros((*state_BT.shape, cache.state_width), dtype=TORCH_DTYPES[cache.state_dtype])
        aux_BTA[have_BT] = cache.states(state_BT[have_BT].numpy())
        batch["aux"] = aux_BTA.to(device)
        return batch

    return run


# ---------------------------------------------------------------- the target, read from its files

def frozen_dtype(recipe: Recipe) -> torch.dtype:
    """The dtype the online run loads the target in (train/eagle3.py load_frozen_target)."""
    from draftforge.runtime import resolve_precision

    return torch.bfloat16 if resolve_precision(recipe.train.precision) == "bf16" else torch.float32


def stored_target(target_dir: str, config, dtype: torch.dtype, whole_layer: bool) -> SimpleNamespace:
    """The parts of a Llama-family target a head reads (train/eagle3.py make_head), from its safetensors without
    building it: `config`, get_input_embeddings() (frozen) and, with whole_layer, what the heads' init_from_target
    copies: model.layers[-1], model.norm and get_output_embeddings() (lm_head, or the embedding it is tied to)."""
    from safetensors import safe_open

    from draftforge.models.target_embed import read_target_embedding

    embedding = torch.nn.Embedding.from_pretrained(read_target_embedding(target_dir).to(dtype), freeze=True)
    last = f"model.layers.{config.num_hidden_layers - 1}."
    tensors = {}
    for file in sorted(Path(target_dir).glob("*.safetensors")) if whole_layer else []:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if key.startswith(last) or key in ("model.norm.weight", "lm_head.weight"):
                    tensors[key.removeprefix(last)] = f.get_tensor(key).to(dtype)
    rows = tensors.pop("lm_head.weight", embedding.weight if config.tie_word_embeddings else None)
    missing = [name for name, have in (("lm_head.weight", rows is not None),
                                       ("model.norm.weight", "model.norm.weight" in tensors)) if not have]
    if whole_layer and missing:
        raise CheckpointError(f"eagle3.init: target copies the target's last layer, but {target_dir} has no "
                              f"{' or '.join(missing)} in its safetensors; use eagle3.init: random")
    norm = SimpleNamespace(weight=tensors.pop("model.norm.weight", None))
    return SimpleNamespace(config=config, model=SimpleNamespace(layers=[_nested(tensors)], norm=norm),
                           get_input_embeddings=lambda: embedding,
                           get_output_embeddings=lambda: SimpleNamespace(weight=rows))


def _nested(flat: dict) -> SimpleNamespace:
    """{"self_attn.q_proj.weight": t, ...} -> an object with .self_attn.q_proj.weight."""
    tree: dict = {}
    for name, value in flat.items():
        *path, leaf = name.split(".")
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value

    def build(node):
        return SimpleNamespace(**{k: build(v) if isinstance(v, dict) else v for k, v in node.items()})

    return build(tree)


# ---------------------------------------------------------------- the task

def build_cached_eagle3_task(recipe: Recipe, accelerator, with_data: bool = True):
    """The head (trainable) on cached blocks; the cache is checked (target, tokenizer, rows, layers, vocabulary)
    before anything trains, and the target's model is never built."""
    from draftforge.data import describe
    from draftforge.data.hidden_cache import HiddenCache
    from draftforge.data.logits_cache import cached_block_data, open_cache
    from draftforge.loading import load_config
    from draftforge.models.eagle3 import check_aux_layers, default_aux_layers
    from draftforge.models.eagle3_export import save_head
    from draftforge.train.distill import cached_collate, check_cache_vocab
    from draftforge.train.eagle3 import head_from_export, make_head
    from draftforge.train.lm import DRAFT_VOCAB_FILE, choose_draft_vocab
    from draftforge.train.parts import load_tokenizer
    from draftforge.train.spec import TaskSpec, tensor_collate

    cfg = recipe.task_options
    tokenizer, target_config = load_tokenizer(recipe), load_config(recipe.model.target, "model.target")
    depth = target_config.num_hidden_layers
    dtype = frozen_dtype(recipe)
    fine_tune = bool(recipe.model.init_from)
    target = stored_target(recipe.model.target, target_config, dtype, whole_layer=cfg.init == "target" and
                           not fine_tune)
    if fine_tune:  # an exported head, as the online build starts from it: its body, layers and draft vocabulary
        head, d2t, head_config = head_from_export(recipe, cfg, target)
        layers = list(head_config.aux_layers)
    else:
        layers = check_aux_layers(default_aux_layers(depth) if cfg.aux_layers is None else cfg.aux_layers, depth)
    cache = data = None
    if with_data:  # `draftforge export` rebuilds the head only: no cache needed
        cache = open_cache(cache_dirs(cfg), HiddenCache)
        cache.check_tokenizer(tokenizer)
        how = cache.check_target(recipe.model.target)
        cache.check_layers(layers, *(("model.init_from's head", False) if fine_tune else ("eagle3.aux_layers",)))
        with accelerator.main_process_first():
            data = cached_block_data(recipe.data, tokenizer, recipe.train.block_size, recipe.train.seed,
                                     target_config.vocab_size, cache)
        accelerator.print(f"[draftforge] {describe(data)}")
    if not fine_tune:
        d2t = choose_draft_vocab(recipe, target, data, tokenizer)
        head, _ = make_head(cfg, target, d2t, recipe.train.seed)  # as the online build: the same initial head
    d2t_N = None if d2t is None else torch.tensor(d2t, dtype=torch.long)
    collate = tensor_collate
    if cache is not None:
        collate = states_collate(cached_collate(tensor_collate, cache, check_cache_vocab(cache, head, d2t_N)), cache)
        accelerator.print(f"[draftforge] eagle3: states and teacher = hidden-state cache {cache.name} (layers "
                          f"{cache.layers} in {cache.state_dtype}, top-{cache.k}, {cache.positions:,} positions; "
                          f"target {recipe.model.target}: {how}; only its embedding read, in {dtype}); "
                          f"{cfg.body} head{' from ' + str(recipe.model.init_from) if fine_tune else ''}, "
                          f"{sum(p.numel() for p in head.parameters()):,} trainable parameters, "
                          f"{cfg.steps} steps, loss {cfg.loss}")
        if cache.state_dtype != str(dtype).removeprefix("torch."):
            accelerator.print(f"[draftforge] note: the cache holds {cache.state_dtype} states; an online run at this "
                              f"train.precision would fuse {dtype} ones")

    def export(trained, out_dir, metadata, overwrite=False):
        return save_head(trained, target_config, tokenizer, out_dir, metadata, steps=cfg.steps, overwrite=overwrite)

    meta = {"aux_layers": layers, "ttt_steps": cfg.steps, "hidden_cache": cfg.hidden_cache}
    return TaskSpec(model=head, loss=cached_ttt_loss(cfg, d2t_N), count=cached_count, collate=collate,
                    frozen={"target_embedding": target.get_input_embeddings()}, train_data=data and data.train,
                    eval_data=data and data.eval, export=export, tokenizer=tokenizer, unit="tokens",
                    export_metadata={**meta, **({"draft_vocab_size": len(d2t)} if d2t is not None else {})},
                    data_stats=data.stats if data else {},
                    run_files={DRAFT_VOCAB_FILE: json.dumps(d2t)} if d2t is not None else {},
                    derive_metrics=lambda means: derive(means, cfg.steps, (cfg.draft_cost, cfg.verify_cost)),
                    export_report=acceptance_report)
