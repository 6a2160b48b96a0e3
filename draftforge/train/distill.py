"""Task `distill`: a small SSM drafter trained on a frozen target's distributions (STree §5.2).

The student minimises `distill.loss` (forward KL at a temperature, TVD = 1 − α, their mix, or CE on the target's
top-1; train/divergences.py) against the target's next-token distribution, computed on the fly by a frozen teacher
or read from a `draftforge harvest logits` cache (`distill.logits_cache`; the teacher is then never loaded). A
reduced draft head is trained against the teacher restricted to its ids. Acceptance (α, top-1, per-depth α, τ)
is logged at every eval and kept in the export. The spec is the LM task's, composed with `dataclasses.replace`.
The whole story, with the cache's checks and the reduced head's rules: docs/methods/distill.md.

Legend: B batch, T block size, V vocabulary, N draft vocabulary, S student vocabulary (V or N), K top-k,
P kept positions, D hidden size.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from draftforge.errors import CompatibilityError, RecipeError
from draftforge.models.draft_vocab import d2t_of
from draftforge.recipe import Recipe, doc, require
from draftforge.train.divergences import TopK, chain_sums, derive_acceptance, full_terms, topk_terms

LOSSES = ("kl", "tvd", "mix", "ce")


@dataclass
class DistillConfig:
    loss: str = doc("kl", "the divergence: 'kl' (kl_weight·KL at τ), 'tvd' (tvd_weight·(1 − Σ min(p, q)) at T=1, "
                          "one minus speculative sampling's acceptance), 'mix' (kl_weight·KL + tvd_weight·TVD) or "
                          "'ce' (CE on the target's own top-1 token, weight 1); ce_weight adds the data's CE to any")
    temperature: float = doc(1.0, "softmax temperature τ of teacher and student in the KL (the KL is scaled by τ²); "
                                  "TVD, CE and the acceptance metrics are at T=1")
    kl_weight: float = doc(1.0, "weight of KL(p_target ‖ p_student) with loss kl or mix (STree's recipe: 1.0)")
    tvd_weight: float = doc(1.0, "weight of TVD = 1 − Σ min(p_target, p_student) with loss tvd or mix")
    ce_weight: float = doc(0.0, "weight of the next-token CE on the data, added to any loss (STree's recipe: 0.0)")
    logits_cache: str | list[str] | None = doc(None, "a `draftforge harvest logits` directory: the loss reads the "
                                                     "target's stored top-k distribution and the teacher is never "
                                                     "loaded; needs data.format: tokens with the harvested rows file "
                                                     "as the source (a list: one cache per rows file of data.sources, "
                                                     "in order, from one target and harvest settings)")
    embeddings_from_target: bool = doc(False, "start the student's input embeddings (and a tied head) from the "
                                              "target's; needs the same hidden size")
    trainable: list[str] = doc([], "train only parameters whose name contains one of these strings (e.g. [mamba] "
                                   "for a converted hybrid's new mixers); []: all")
    draft_cost: float = doc(0.0, "one drafter step's time over one target token's, t_draft / t(1) (the cost model "
                                 "of a `draftforge eval` report gives both); with verify_cost it turns the eval's "
                                 "chain τ (γ = 5) into the logged predicted_speedup that train.keep_best can select by")
    verify_cost: float = doc(1.0, "one verification of γ + 1 = 6 rows over one target token, t(6)/t(1) (the eval "
                                  "report's t(N)/t(1) curve; SmolLM2 in bf16 on a Zen 5 core: 1.11)")

    def cache_dirs(self) -> list[str]:
        """The logits cache directories, one per rows file ([] without a cache)."""
        if not self.logits_cache:
            return []
        return [self.logits_cache] if isinstance(self.logits_cache, str) else list(self.logits_cache)

    def weights(self) -> dict[str, float]:
        """The loss's terms and their weights (names as the metrics: kl, tvd, ce_target, ce)."""
        terms = {"kl": {"kl": self.kl_weight}, "tvd": {"tvd": self.tvd_weight},
                 "mix": {"kl": self.kl_weight, "tvd": self.tvd_weight}, "ce": {"ce_target": 1.0}}[self.loss]
        return {**terms, "ce": self.ce_weight} if self.ce_weight else terms

    def check(self, at: str) -> None:
        require(self.loss in LOSSES, f"{at}.loss", f"must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        require(self.temperature > 0, f"{at}.temperature", "must be > 0")
        require(self.kl_weight >= 0 and self.ce_weight >= 0, f"{at}.kl_weight", "weights must be >= 0")
        require(self.tvd_weight >= 0, f"{at}.tvd_weight", "must be >= 0")
        require(self.draft_cost >= 0, f"{at}.draft_cost", "must be >= 0")
        require(self.verify_cost > 0, f"{at}.verify_cost", "must be > 0 (1.0: verifying costs one token)")
        names = {"kl": "kl_weight + ce_weight", "tvd": "tvd_weight + ce_weight",
                 "mix": "kl_weight + tvd_weight + ce_weight"}
        require(sum(self.weights().values()) > 0, f"{at}.{'tvd' if self.loss == 'tvd' else 'kl'}_weight",
                f"{names.get(self.loss, 'the weights')} must be > 0")
        require(not self.logits_cache or self.temperature == 1.0 or "kl" not in self.weights(), f"{at}.temperature",
                "a logits cache holds the target's distribution at T=1 and its tail mass cannot be re-tempered: set "
                "temperature: 1 (or loss: tvd / ce)")
        require(not (self.logits_cache and self.embeddings_from_target), f"{at}.embeddings_from_target",
                "copies the teacher's embeddings, but a run on a logits cache never loads the teacher: use "
                "model.embed_from_target instead")


def check_distill(recipe: Recipe) -> None:
    require(bool(recipe.model.target), "model.target",
            "distill needs the teacher: point model.target at the target model (a local directory)")
    options = recipe.task_options
    if options is None or not options.logits_cache:
        return
    check_cache_sources(recipe.data, options.cache_dirs(), "distill.logits_cache", "a target's distributions")


def check_cache_sources(data, caches: list[str], key: str, what: str) -> None:
    """The data rules of a run on harvested caches (`key`: the recipe key naming them, `what` they hold)."""
    require(data.format == "tokens", "data.format", f"{key} holds {what} over token rows: set data.format: tokens")
    # files, not folders, one per cache (a missing file is the data loader's error, named there)
    require(len(data.sources) == len(caches) and not any(Path(s).expanduser().is_dir() for s in data.sources),
            "data.sources", f"with {key}, give exactly the rows file each cache was harvested from "
            f"(one per cache, in order; {len(caches)} cache{'s' if len(caches) > 1 else ''}, "
            f"{len(data.sources)} source{'s' if len(data.sources) != 1 else ''})")
    require(not data.streaming, "data.streaming", "a harvested cache is read row by row: set data.streaming: false")


def next_tokens(batch) -> torch.Tensor:
    """next_BT: the label of the token after each position (-100: none). The labels are shifted, not the logits:
    slicing logits would copy the B x T x V tensor forward and backward."""
    return F.pad(batch["labels"][:, 1:], (0, 1), value=-100)


def measured_positions(batch, keep_BT, have_BT=None) -> torch.Tensor:
    """measure_BT: the positions α and top-1 are taken over. For a reduced head (its collate keeps the target ids
    as `target_labels`), every position whose next token exists (and, on a cache, has an entry: have_BT), in the
    draft vocabulary or not: one outside it carries no loss but is a position the head cannot get right.
    Otherwise keep_BT itself."""
    if "target_labels" not in batch:
        return keep_BT
    measure_BT = F.pad(batch["target_labels"][:, 1:], (0, 1), value=-100) != -100
    return measure_BT if have_BT is None else measure_BT & have_BT


def _result(model, weights: dict, terms_M: dict, agree_M, ce_sum, keep_BT, measure_BT, link_BT):
    """(weighted total, counted positions, metric sums); eval batches add the chain sums (divergences.chain_sums).

    terms_M, agree_M: per measured position (measure_BT, a superset of keep_BT). The loss and its own terms (kl,
    tvd, ce_target) sum the kept ones; alpha, top1_agree and the chain sums every measured one. When the two
    differ, `measured` sums the measured positions: the loop divides every sum by the kept count, and
    derive_metrics divides alpha and top1_agree by measured's mean to make them per measured position."""
    terms_P = terms_M if measure_BT is keep_BT else {k: v[keep_BT[measure_BT]] for k, v in terms_M.items()}
    total = sum(w * (ce_sum if name == "ce" else terms_P[name].sum()) for name, w in weights.items())
    metrics = {name: v.detach().sum() for name, v in terms_P.items()}
    metrics.update(alpha=terms_M["alpha"].sum(), ce=ce_sum.detach(), top1_agree=agree_M.sum())
    if measure_BT is not keep_BT:
        metrics["measured"] = measure_BT.sum()
    if not model.training:
        alpha_BT = torch.zeros(measure_BT.shape, device=measure_BT.device)
        agree_BT = torch.zeros(measure_BT.shape, device=measure_BT.device)
        alpha_BT[measure_BT], agree_BT[measure_BT] = terms_M["alpha"].detach(), agree_M.float()
        metrics.update(chain_sums(alpha_BT, agree_BT, measure_BT, link_BT))
    return total, keep_BT.sum(), metrics


def derive_metrics(means: dict, cost: tuple[float, float] | None = None) -> dict[str, float]:
    """derive_acceptance on α and top-1 per measured position (see _result): for a reduced head the loop's means
    of alpha and top1_agree are per kept position, and `measured` is measured positions per kept position."""
    measured = means.get("measured")
    if measured:
        means = {**means, "alpha": means["alpha"] / measured, "top1_agree": means["top1_agree"] / measured}
    out = derive_acceptance(means, cost=cost)
    return {"alpha": means["alpha"], "top1_agree": means["top1_agree"], **out} if measured else out


def _link(keep_BT, entry_BT=None):
    """link_BT[t]: positions t and t+1 are both kept and consecutive in one row (cache entries follow on)."""
    link_BT = keep_BT[:, :-1] & keep_BT[:, 1:]
    if entry_BT is not None:
        link_BT = link_BT & (entry_BT[:, 1:] == entry_BT[:, :-1] + 1)
    return F.pad(link_BT, (0, 1), value=False)


def make_loss(teacher, options: DistillConfig, d2t_N: torch.Tensor | None = None):
    """loss(model, batch) -> (summed loss, counted positions, metrics): the loss on the teacher's fresh logits.

    d2t_N: the target ids of a reduced draft head's rows (None: the student predicts the whole vocabulary).
    """
    weights = options.weights()

    def loss(model, batch):
        ids_BT, next_BT = batch["input_ids"], next_tokens(batch)
        keep_BT = next_BT != -100
        measure_BT = measured_positions(batch, keep_BT)
        with torch.no_grad():
            teacher_BTV = teacher(input_ids=ids_BT).logits
        student_BTS = model(input_ids=ids_BT).logits
        want = teacher_BTV.shape[-1] if d2t_N is None else len(d2t_N)
        if student_BTS.shape[-1] != want:
            raise CompatibilityError(f"the student predicts {student_BTS.shape[-1]} tokens, the teacher's vocabulary"
                                     f"{' restricted to its draft vocabulary' if d2t_N is not None else ''} has {want}: "
                                     "build the student with the target's vocabulary (model.target)")
        s_MS, t_MV = student_BTS[measure_BT].float(), teacher_BTV[measure_BT].float()
        d2t = None if d2t_N is None else d2t_N.to(t_MV.device)
        if d2t is None:
            terms = full_terms(s_MS, t_MV, options.temperature)
            top_M = s_MS.argmax(-1)
        else:
            terms = full_terms(s_MS, t_MV[:, d2t], options.temperature, t_MV.logsumexp(-1))
            top_M = d2t[s_MS.argmax(-1)]
        s_PS = s_MS if measure_BT is keep_BT else s_MS[keep_BT[measure_BT]]
        ce_sum = F.cross_entropy(s_PS, next_BT[keep_BT], reduction="sum")
        agree_M = top_M == t_MV.argmax(-1)
        return _result(model, weights, terms, agree_M, ce_sum, keep_BT, measure_BT, _link(measure_BT))

    return loss


# ---------------------------------------------------------------- a logits cache instead of a teacher

def cached_keep(batch) -> torch.Tensor:
    """keep_BT: positions with a cache entry whose next token carries a label (for a reduced head: a draft id)."""
    return (batch["cache"] >= 0) & (next_tokens(batch) != -100)


def cached_count(batch) -> torch.Tensor:
    return cached_keep(batch).sum()


def cached_collate(base_collate, cache, t2d_V: torch.Tensor | None = None):
    """base_collate, then the cache entries of every position: t_ids (student columns), t_logp, t_rest, t_top1."""

    def collate(columns, device):
        batch = base_collate(columns, device)
        entry_BT = batch["cache"].cpu()
        have_BT = entry_BT >= 0
        got = cache.gather(entry_BT[have_BT].numpy())
        ids_BTK = torch.zeros((*entry_BT.shape, cache.k), dtype=torch.long)
        logp_BTK = torch.full((*entry_BT.shape, cache.k), float("-inf"))
        rest_BT, top1_BT = torch.full(entry_BT.shape, float("-inf")), torch.full(entry_BT.shape, -1)
        ids_BTK[have_BT] = torch.from_numpy(got["ids"]).long()
        if t2d_V is not None:  # target ids -> the reduced head's columns (the harvest kept only draft ids)
            ids_BTK = t2d_V[ids_BTK].clamp_min(0)
        logp_BTK[have_BT] = torch.from_numpy(got["logp"])
        rest_BT[have_BT], top1_BT[have_BT] = torch.from_numpy(got["rest_logp"]), torch.from_numpy(got["top1"]).long()
        batch.update(t_ids=ids_BTK.to(device), t_logp=logp_BTK.to(device), t_rest=rest_BT.to(device),
                     t_top1=top1_BT.to(device))
        return batch

    return collate


def make_cached_loss(options: DistillConfig, d2t_N: torch.Tensor | None = None):
    """loss(model, batch) -> (summed loss, counted positions, metrics) on the cached top-K teacher (no forward)."""
    weights = options.weights()

    def loss(model, batch):
        keep_BT = cached_keep(batch)
        measure_BT = measured_positions(batch, keep_BT, batch["cache"] >= 0)
        student_BTS = model(input_ids=batch["input_ids"]).logits
        s_MS = student_BTS[measure_BT].float()
        top = TopK(batch["t_ids"][measure_BT], batch["t_logp"][measure_BT], batch["t_rest"][measure_BT])
        terms = topk_terms(s_MS, top)
        top_M = s_MS.argmax(-1) if d2t_N is None else d2t_N.to(s_MS.device)[s_MS.argmax(-1)]
        agree_M = top_M == batch["t_top1"][measure_BT]
        s_PS = s_MS if measure_BT is keep_BT else s_MS[keep_BT[measure_BT]]
        ce_sum = F.cross_entropy(s_PS, next_tokens(batch)[keep_BT], reduction="sum")
        return _result(model, weights, terms, agree_M, ce_sum, keep_BT, measure_BT, _link(measure_BT, batch["cache"]))

    return loss


def check_cache_vocab(cache, model, d2t_N: torch.Tensor | None):
    """The cache must be over the student's vocabulary: t2d_V for a reduced head, None for a full one."""
    from draftforge.models.draft_vocab import target_to_draft

    width, cached = model.get_output_embeddings().weight.shape[0], cache.draft_vocab
    where = f"{cache.WHAT} {cache.name}"
    if d2t_N is not None and cache.k > len(d2t_N):
        raise CompatibilityError(f"{where} keeps the target's top-{cache.k} per position, more ids than the student's "
                                 f"draft vocabulary of {len(d2t_N)}: a reduced head learns the teacher restricted to "
                                 "its ids, so harvest with --draft-vocab (this run's N or dir) and --top-k <= "
                                 f"{len(d2t_N)}")
    if d2t_N is None and cached is not None:
        raise CompatibilityError(f"{where} holds the target's top-{cache.k} over a draft vocabulary of {len(cached)} "
                                 "ids, but the student predicts the whole vocabulary; harvest without --draft-vocab, "
                                 f"or give the student that vocabulary (model.draft_vocab: {len(cached)})")
    if d2t_N is None:
        if width != cache.vocab_size:
            raise CompatibilityError(f"the student predicts {width} tokens, {where} the target's {cache.vocab_size}: "
                                     "build the student with the target's vocabulary (model.target)")
        return None
    if cached is None:
        raise CompatibilityError(f"the student has a reduced head of {len(d2t_N)} ids, but {where} holds the target's "
                                 f"top-{cache.k} over its whole vocabulary, which does not tell how much of the rest "
                                 "lies inside the draft ids; harvest with --draft-vocab (this run's N or dir)")
    if cached != d2t_N.tolist():
        raise CompatibilityError(f"{where} was harvested for another draft vocabulary ({len(cached)} ids) than the "
                                 f"student's ({len(d2t_N)}); set model.draft_vocab: {len(cached)} and "
                                 "model.draft_vocab_from: the rows file (as --draft-vocab N counts them), or harvest "
                                 "with --draft-vocab pointing at this run")
    return target_to_draft(cache.vocab_size, cached)


def build_cached_task(recipe: Recipe, accelerator, options: DistillConfig):
    """The student on cached blocks: the cache is checked (target, tokenizer, rows, vocabulary) before training."""
    from draftforge.data.logits_cache import cached_block_data, open_cache
    from draftforge.train.lm import build_lm_task
    from draftforge.train.parts import load_tokenizer

    cache = open_cache(options.cache_dirs())
    cache.check_tokenizer(load_tokenizer(recipe))
    how = cache.check_target(recipe.model.target)

    def build_data(cfg, tokenizer, block_size, seed, vocab_size=None):
        return cached_block_data(cfg, tokenizer, block_size, seed, vocab_size or len(tokenizer), cache)

    spec = build_lm_task(recipe, accelerator, build_data=build_data)
    d2t_N = d2t_of(spec.model)
    t2d_V = check_cache_vocab(cache, spec.model, d2t_N)
    _freeze(spec, options, accelerator)
    accelerator.print(f"[draftforge] distill: teacher = logits cache {cache.name} (top-{cache.k}, "
                      f"{cache.positions:,} positions; target {recipe.model.target}: {how}; "
                      f"never loaded), loss {options.loss}: {_weights_text(options)}")
    caches = [str(d) for d in cache.dirs]
    return _as_distill(spec, recipe, options, loss=make_cached_loss(options, d2t_N), count=cached_count,
                       collate=cached_collate(spec.collate, cache, t2d_V),
                       logits_cache=caches[0] if len(caches) == 1 else caches)


# ---------------------------------------------------------------- the teacher on the fly

def load_teacher(recipe: Recipe):
    from draftforge.loading import load_causal_lm

    teacher = load_causal_lm(recipe.model.target, what="target (teacher)")
    return teacher.eval().requires_grad_(False)


def copy_target_embeddings(student, teacher) -> None:
    """Initialise the student's input embeddings from the teacher's (same vocabulary and hidden size)."""
    src, dst = teacher.get_input_embeddings().weight, student.get_input_embeddings().weight
    if src.shape != dst.shape:
        raise CompatibilityError(f"distill.embeddings_from_target: the target's embeddings are {tuple(src.shape)} but "
                                 f"the student's are {tuple(dst.shape)}; give the student the target's hidden size")
    with torch.no_grad():
        dst.copy_(src.to(dst.dtype))


def freeze_except(model, patterns: list[str]) -> None:
    """requires_grad only for parameters whose name contains one of `patterns` (the rest stays as loaded)."""
    names = [n for n, _ in model.named_parameters()]
    if not any(pat in n for n in names for pat in patterns):
        raise RecipeError(f"recipe key 'distill.trainable': no parameter name contains any of {patterns} "
                          f"(names look like {names[:3]})")
    for name, param in model.named_parameters():
        param.requires_grad_(any(pat in name for pat in patterns))


def _freeze(spec, options: DistillConfig, accelerator) -> None:
    if options.trainable:
        freeze_except(spec.model, options.trainable)
        n_train = sum(p.numel() for p in spec.model.parameters() if p.requires_grad)
        accelerator.print(f"[draftforge] distill: training {n_train:,} parameters matching {options.trainable}")


def _weights_text(options: DistillConfig) -> str:
    names = {"kl": f"KL(τ={options.temperature})", "tvd": "TVD", "ce_target": "CE(target top-1)", "ce": "CE(data)"}
    return " + ".join(f"{names[k]}×{w}" for k, w in options.weights().items())


def build_distill_task(recipe: Recipe, accelerator, with_data: bool = True):
    """The student (a pretrain-style drafter), packed text blocks, and the frozen teacher (or its logits cache)."""
    from draftforge.train.lm import build_lm_task

    options = recipe.task_options or DistillConfig()
    if options.logits_cache and with_data:
        return build_cached_task(recipe, accelerator, options)
    spec = build_lm_task(recipe, accelerator, with_data=with_data)
    if not with_data:  # `draftforge export`: only the student and its export hook are used
        return spec
    teacher = load_teacher(recipe)
    if options.embeddings_from_target and not recipe.model.init_from:
        copy_target_embeddings(spec.model, teacher)
    accelerator.print(f"[draftforge] distill: teacher {type(teacher).__name__} "
                      f"({sum(p.numel() for p in teacher.parameters()):,} params, frozen), loss {options.loss}: "
                      f"{_weights_text(options)}")
    _freeze(spec, options, accelerator)
    d2t_N = d2t_of(spec.model)
    if d2t_N is not None and int(d2t_N.max()) >= teacher.get_output_embeddings().weight.shape[0]:
        raise CompatibilityError(f"the student's draft vocabulary names target id {int(d2t_N.max())}, beyond the "
                                 f"teacher's {teacher.get_output_embeddings().weight.shape[0]} tokens: "
                                 "it was built for another target")
    return _as_distill(spec, recipe, options, loss=make_loss(teacher, options, d2t_N),
                       frozen={**spec.frozen, "teacher": teacher})


def _as_distill(spec, recipe: Recipe, options: DistillConfig, logits_cache=None, **fields):
    """The LM spec made a distill spec (a new value): its loss and what goes with it (`fields`), the acceptance
    numbers derived from the metric means, the held-out acceptance report at export, and the export's keys."""
    meta = {**spec.export_metadata, "distilled_from": recipe.model.target}
    if logits_cache is not None:
        meta["logits_cache"] = logits_cache
    return dataclasses.replace(spec, **fields, export_metadata=meta, export_report=acceptance_report,
                               derive_metrics=partial(derive_metrics, cost=(options.draft_cost, options.verify_cost)))


# ---------------------------------------------------------------- held-out acceptance, once, at export

def acceptance_report(means: dict, positions: int) -> dict:
    """The export's metrics.acceptance: the eval means of the exported weights (the chain sums left out: what they
    give is derived) and the positions counted; {} when a mean is not finite. Prints a summary line."""
    report = {k: v for k, v in means.items() if not k.startswith("chain_") and k != "measured"}
    if not all(map(math.isfinite, report.values())):  # (what is derived is finite when the means are)
        return {}
    report["positions"] = round(positions * means.get("measured", 1.0))  # a reduced head's: every position
    depth = "/".join(f"{report.get(f'alpha_depth{d}', float('nan')):.2f}" for d in range(1, 6))
    print(f"[draftforge] distill: held-out acceptance α {report['alpha']:.3f} (τ at γ=5: "
          f"{report['tau_g5']:.2f}), top-1 {report['top1_agree']:.3f} (τ {report['tau_g5_greedy']:.2f}), "
          f"α by depth {depth}, over {report['positions']:,} positions", flush=True)
    return {"acceptance": report}
