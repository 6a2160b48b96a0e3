"""Task `eagle3`: an EAGLE-3 head (models/eagle3.py) trained with training-time test on a frozen target's states;
with `eagle3.body: mamba2`, the feature-conditioned Mamba2 drafter (models/feature_mamba.py), trained the same way.

Each step the frozen target (TaskSpec.frozen, in bf16 where training runs bf16) reads the batch once and hands
over the states entering `aux_layers` and its logits. The head then unrolls `steps` drafting steps over every
anchor (Eagle3Head.ttt_forward): step k at anchor t is scored against the target's distribution at position
t + 1 + k, the token the chain from t drafts at depth k + 1. The loss at step k is weighted decay^k and is forward
KL, TVD = 1 − α or their mix (as `distill`), over the draft vocabulary for a reduced head (α takes the target's
unrestricted p, so it is the acceptance a reduced head really gets).

Metrics at each eval: α and top-1 per step (`alpha_step{k}`, `top1_step{k}`: each over the anchors that reach
step k), and the chain's simulated acceptance: anchors whose every step is scored sum Π_{j<=k} top-1_j (greedy)
and Π_{j<=k} α_j (T=1, an estimate: the chain is fed the data's tokens, not its own samples), giving `tau_ttt` and
`tau_ttt_greedy` = 1 + Σ_k of those means; with eagle3.draft_cost / verify_cost, `predicted_speedup` for
train.keep_best. The derivation and the mask: docs/methods/eagle3.md. With eagle3.hidden_cache the states and the
teacher's top-k come from a `draftforge harvest hidden` cache instead and the target never runs: the task's
registered builder and check (train/eagle3_cache.py) send such a recipe there and any other here.

Legend: B batch, T block, V target vocabulary, N draft vocabulary (S = what the head predicts: V or N),
A aux width, P kept positions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftforge.recipe import Recipe, doc, require
from draftforge.train import divergences
from draftforge.train.divergences import full_terms

LOSSES = ("kl", "tvd", "mix")
INITS = ("target", "random")
BODIES = ("attention", "mamba2")


@dataclass
class Eagle3TaskConfig:
    aux_layers: list[int] | None = doc(None, "the target layers whose input states the head fuses (id i = the state "
                                             "entering layer i); None = EAGLE-3's low / middle / high choice as "
                                             "vLLM makes it, [2, L // 2, L - 3] ([2, 15, 27] for SmolLM2)")
    body: str = doc("attention", "'attention': EAGLE-3's one decoder layer (exports for vLLM); 'mamba2': the "
                                 "feature-conditioned Mamba2 drafter, a constant-cost step and state at any context")
    mamba_layers: int = doc(2, "body mamba2: Mamba2 blocks (width: the target's hidden size)")
    state_size: int = doc(16, "body mamba2: SSM state size N per head")
    mamba_head_dim: int = doc(64, "body mamba2: head dim P (heads = 2·hidden / P)")
    steps: int = doc(5, "training-time test: drafting steps unrolled per anchor (each feeds the head its own "
                        "previous output state); SpecForge's default is 7, each costs one head forward")
    step_decay: float = doc(0.8, "step k's loss weighs step_decay^k (SpecForge's 0.8)")
    loss: str = doc("kl", "'kl' (forward KL to the target at `temperature`), 'tvd' (1 − α at T=1; for a reduced head, "
                                "against the target renormalised to its draft ids) or 'mix'")
    temperature: float = doc(1.0, "softmax temperature of target and head in the KL (scaled by τ²)")
    kl_weight: float = doc(1.0, "weight of the KL with loss kl or mix")
    tvd_weight: float = doc(1.0, "weight of the TVD with loss tvd or mix")
    init: str = doc("target", "'target': norm and head rows from the target, the layer a copy of the target's last "
                              "layer on the feature half, fc passing the highest aux state; 'random': as EAGLE-3")
    draft_cost: float = doc(0.0, "one head step's time over one target token's (a `draftforge eval` report gives "
                                 "both); with verify_cost, turns tau_ttt_greedy into the logged predicted_speedup")
    verify_cost: float = doc(1.0, "one verification of steps + 1 rows over one target token, t(N)/t(1)")
    hidden_cache: str | list[str] | None = doc(None, "a `draftforge harvest hidden` directory: the head trains on its "
                                                     "stored states and top-k teacher, and the target is never loaded "
                                                     "(only its config and embedding are read); needs data.format: "
                                                     "tokens with the harvested rows file as the source (a list: one "
                                                     "cache per rows file, in order): train/eagle3_cache.py")

    def weights(self) -> dict[str, float]:
        return {"kl": {"kl": self.kl_weight}, "tvd": {"tvd": self.tvd_weight},
                "mix": {"kl": self.kl_weight, "tvd": self.tvd_weight}}[self.loss]

    def check(self, at: str) -> None:
        require(self.loss in LOSSES, f"{at}.loss", f"must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        require(self.init in INITS, f"{at}.init", f"must be one of {', '.join(INITS)}, got {self.init!r}")
        require(self.body in BODIES, f"{at}.body", f"must be one of {', '.join(BODIES)}, got {self.body!r}")
        require(self.mamba_layers >= 1 and self.state_size >= 1 and self.mamba_head_dim >= 1, f"{at}.mamba_layers",
                "mamba_layers, state_size and mamba_head_dim must be >= 1")
        require(isinstance(self.steps, int) and 1 <= self.steps <= 16, f"{at}.steps", "must be an integer in 1..16")
        require(0 < self.step_decay <= 1, f"{at}.step_decay", "must be in (0, 1]")
        require(self.temperature > 0, f"{at}.temperature", "must be > 0")
        require(self.kl_weight >= 0 and self.tvd_weight >= 0, f"{at}.kl_weight", "weights must be >= 0")
        require(self.draft_cost >= 0, f"{at}.draft_cost", "must be >= 0")
        require(self.verify_cost > 0, f"{at}.verify_cost", "must be > 0")


def check_eagle3(recipe: Recipe) -> None:
    """eagle3's recipe rules, before anything is built: a target, and aux layers inside it."""
    from pathlib import Path

    from draftforge.loading import load_config
    from draftforge.models.eagle3 import check_aux_layers

    require(bool(recipe.model.target), "model.target", "eagle3 trains a head on a frozen target: set model.target")
    cfg = recipe.task_options or Eagle3TaskConfig()
    require(cfg.steps < recipe.train.block_size, "eagle3.steps",
            f"{cfg.steps} unrolled steps need blocks of more tokens (step k is scored k + 1 tokens past its anchor): "
            f"train.block_size is {recipe.train.block_size}; lower eagle3.steps or raise train.block_size")
    if Path(recipe.model.target).expanduser().is_dir() and cfg.aux_layers is not None:
        config = load_config(recipe.model.target, "model.target")
        check_aux_layers(cfg.aux_layers, config.num_hidden_layers)


def next_labels(batch) -> torch.Tensor:
    """next_BT[p]: the label of the token after position p (-100: none)."""
    return F.pad(batch["labels"][:, 1:], (0, 1), value=-100)


def loss_positions(batch) -> torch.Tensor:
    """Step-0 positions that carry a loss: anchor t is scored at t + 1, whose next token must be labelled."""
    return (next_labels(batch)[:, 1:] != -100).sum()


def unrolled_anchors(next_BT: torch.Tensor, steps: int) -> torch.Tensor | None:
    """Anchors t that some step k >= 1 scores (scored_steps: the token after t + 1 + k is labelled): the chains a
    head need unroll past step 0 (None for steps = 1)."""
    if steps < 2:
        return None
    labelled_BT = next_BT != -100
    out_BT = torch.zeros_like(labelled_BT)
    t_len = next_BT.shape[1]
    for k in range(1, steps):
        if t_len - 1 - k > 0:
            out_BT[:, : t_len - 1 - k] |= labelled_BT[:, 1 + k :][:, : t_len - 1 - k]
    return out_BT


def kept_by_step(next_BT: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Step k's scored anchors: [B, T - 1 - k] bool, True where the token after t + 1 + k is labelled (the rows
    scored_steps reads; steps with no anchor inside the block are left out)."""
    t_len = next_BT.shape[1]
    return [next_BT[:, 1 + k :] != -100 for k in range(steps) if t_len - 1 - k > 0]


def ttt_loss(target, layers: list[int], cfg: Eagle3TaskConfig, d2t_N: torch.Tensor | None):
    """loss(model, batch) -> (summed weighted loss, step-0 positions, metric sums)."""
    weights = cfg.weights()

    def loss(model, batch):
        ids_BT = batch["input_ids"]
        with torch.no_grad():
            out = target(input_ids=ids_BT, output_hidden_states=True)
            aux_BTA = torch.cat([out.hidden_states[i] for i in layers], -1)
            teacher_BTV = out.logits
        tokens_BT = F.pad(ids_BT[:, 1:], (0, 1), value=0)  # anchor t consumes x_{t+1}
        next_BT = next_labels(batch)
        logits_by_step = model(tokens_BT, aux_BTA, cfg.steps, unrolled_anchors(next_BT, cfg.steps),
                               kept_by_step(next_BT, cfg.steps))
        return step_losses(logits_by_step, teacher_BTV, next_BT, cfg, weights, d2t_N,
                           evaluating=not model.training)

    return loss


def step_losses(logits_by_step, teacher_BTV, next_BT, cfg: Eagle3TaskConfig, weights: dict, d2t_N, evaluating: bool):
    """The weighted sum over steps, the step-0 count and the metrics (module docstring), against the teacher's
    logits teacher_BTV."""
    return scored_steps(logits_by_step, full_teacher(teacher_BTV, cfg.temperature, d2t_N), next_BT, cfg, weights,
                        evaluating)


def full_teacher(teacher_BTV, temperature: float, d2t_N):
    """terms_at(k, keep_BT, s_PS) -> (per-position terms, top-1 agreement) of the head's step-k logits s_PS at the
    kept anchors, against the teacher's whole distribution at t + 1 + k (a reduced head: restricted to its ids).

    A reduced head reads, per position, only the teacher's logits at the draft ids, the log-normaliser over the
    whole vocabulary and the top-1 id; they are taken once per batch (divergences.CHUNK_BYTES of fp32 rows at a
    time, divergences.in_chunks, in fp32 like the per-step form) rather than once per unrolled step over
    [positions, V] copies: steps x less memory traffic, the same values bitwise (a row's logsumexp and argmax do
    not depend on which rows are taken with it)."""
    if d2t_N is None:
        def terms_at(k, keep_BT, s_PS):
            t_PV = teacher_BTV[:, 1 + k :][keep_BT].float()
            return full_terms(s_PS, t_PV, temperature), s_PS.argmax(-1) == t_PV.argmax(-1)

        return terms_at
    d2t = d2t_N.to(teacher_BTV.device)
    per_row = divergences.in_chunks(_normaliser_and_top, teacher_BTV.flatten(0, 1))
    lz_BT, top_BT = per_row["lz"].view(teacher_BTV.shape[:2]), per_row["top"].view(teacher_BTV.shape[:2])
    at_ids_BTN = teacher_BTV[..., d2t]

    def terms_at(k, keep_BT, s_PS):
        t_PN = at_ids_BTN[:, 1 + k :][keep_BT]
        terms = full_terms(s_PS, t_PN, temperature, lz_BT[:, 1 + k :][keep_BT])
        return terms, d2t[s_PS.argmax(-1)] == top_BT[:, 1 + k :][keep_BT]

    return terms_at


def _normaliser_and_top(logits_XV) -> dict[str, torch.Tensor]:
    x_XV = logits_XV.float()
    return {"lz": x_XV.logsumexp(-1), "top": x_XV.argmax(-1)}


def scored_steps(logits_by_step, terms_at, next_BT, cfg: Eagle3TaskConfig, weights: dict, evaluating: bool):
    """step_losses with the teacher's terms from `terms_at` (full_teacher's form; a cache: train/eagle3_cache.py).
    Step k at anchor t is scored against the teacher at position t + 1 + k where the token after it has a label.
    logits_by_step: per step the head's logits [B, T, S], or [P_k, S] at kept_by_step's rows only."""
    t_len = next_BT.shape[1]
    total, metrics, count = 0.0, {}, None
    chain_greedy = chain_alpha = None  # running Π over steps, per anchor that reaches every step
    reach_BT = torch.zeros(next_BT.shape, dtype=torch.bool, device=next_BT.device)
    last = cfg.steps - 1
    if t_len - 1 - last > 0:  # anchors whose every step is inside the block and labelled
        reach_BT[:, : t_len - 1 - last] = torch.stack(
            [next_BT[:, 1 + k : t_len - last + k] != -100 for k in range(cfg.steps)]).all(0)
    for k, s_BTS in enumerate(logits_by_step):
        span = t_len - 1 - k  # anchors 0..span-1 have a teacher position t + 1 + k inside the block
        if span <= 0:
            break
        keep_BT = next_BT[:, 1 + k :] != -100  # [B, span]
        # the head's rows at the kept anchors (already so when the head was given kept_by_step), in its dtype:
        # the terms take them to fp32 chunk by chunk
        s_PS = s_BTS if s_BTS.dim() == 2 else s_BTS[:, :span][keep_BT]
        terms, agree_P = terms_at(k, keep_BT, s_PS)
        step_loss = sum(w * terms[name].sum() for name, w in weights.items())
        total = total + cfg.step_decay**k * step_loss
        if k == 0:
            count = keep_BT.sum()
        metrics[f"n_step{k}"] = keep_BT.sum().float()
        metrics[f"alpha_step{k}"] = terms["alpha"].sum()
        metrics[f"top1_step{k}"] = agree_P.sum().float()
        for name in weights:
            metrics[f"{name}_step{k}"] = terms[name].detach().sum()
        if evaluating:
            alpha_BT = torch.zeros(keep_BT.shape, device=s_PS.device)
            agree_BT = torch.zeros(keep_BT.shape, device=s_PS.device)
            alpha_BT[keep_BT], agree_BT[keep_BT] = terms["alpha"], agree_P.float()
            reach = reach_BT[:, : t_len - 1 - last]
            a, g = alpha_BT[:, : reach.shape[1]], agree_BT[:, : reach.shape[1]]
            chain_alpha = a if chain_alpha is None else chain_alpha * a
            chain_greedy = g if chain_greedy is None else chain_greedy * g
            metrics[f"chain_alpha_step{k}"] = (chain_alpha * reach).sum()
            metrics[f"chain_greedy_step{k}"] = (chain_greedy * reach).sum()
    if evaluating:
        metrics["chain_anchors"] = reach_BT.sum().float()
    if count is None:
        count = torch.zeros((), dtype=torch.long, device=next_BT.device)
    return total, count, metrics


def derive(means: dict, steps: int, cost: tuple[float, float]) -> dict[str, float]:
    """Per-step α and top-1 (exact ratios: every metric is divided by the same count), the chain's simulated τ
    and, with a draft cost, the speedup it predicts for a chain of `steps`."""
    out = {}
    for k in range(steps):
        n = float(means.get(f"n_step{k}", 0.0))
        if n > 0:
            out[f"alpha_at_step{k}"] = float(means[f"alpha_step{k}"]) / n
            out[f"top1_at_step{k}"] = float(means[f"top1_step{k}"]) / n
    anchors = float(means.get("chain_anchors", 0.0))
    if anchors > 0:
        for kind, suffix in (("alpha", ""), ("greedy", "_greedy")):
            tau = 1.0 + sum(float(means.get(f"chain_{kind}_step{k}", 0.0)) for k in range(steps)) / anchors
            out[f"tau_ttt{suffix}"] = tau
            draft_cost, verify_cost = cost
            if draft_cost > 0:
                out[f"predicted_speedup{suffix}"] = tau / (steps * draft_cost + verify_cost)
    return out


def acceptance_report(means: dict, positions: int) -> dict:
    """The export's metrics.acceptance: α / top-1 per step and the simulated τ of the exported weights."""
    report = {k: v for k, v in means.items() if k.startswith(("alpha_at", "top1_at", "tau_ttt", "predicted"))}
    report["positions"] = positions
    steps = "/".join(f"{report[f'top1_at_step{k}']:.2f}" for k in range(16) if f"top1_at_step{k}" in report)
    print(f"[draftforge] eagle3: held-out α {report.get('alpha_at_step0', float('nan')):.3f}, top-1 by step "
          f"{steps}, simulated τ (greedy) {report.get('tau_ttt_greedy', float('nan')):.2f}, over {positions:,} "
          "positions", flush=True)
    return {"acceptance": report}


def load_frozen_target(recipe: Recipe):
    """The target, frozen, in bf16 when training runs bf16 (its states and logits then cost a bf16 forward)."""
    from draftforge.loading import load_causal_lm
    from draftforge.runtime import resolve_precision

    dtype = torch.bfloat16 if resolve_precision(recipe.train.precision) == "bf16" else torch.float32
    target = load_causal_lm(recipe.model.target, what="target", dtype=dtype)
    return target.eval().requires_grad_(False)


def make_head(cfg: Eagle3TaskConfig, target, d2t, seed: int):
    """(the head cfg.body names, its config), started as cfg.init says and reading the target's embedding."""
    from draftforge.models import eagle3, feature_mamba

    torch.manual_seed(seed)
    if cfg.body == "mamba2":
        config = feature_mamba.FeatureMambaConfig.from_target(
            target.config, cfg.aux_layers, d2t, layers=cfg.mamba_layers, state_size=cfg.state_size,
            head_dim=cfg.mamba_head_dim)
        head = feature_mamba.FeatureMamba2Head(config)
        if cfg.init == "target":
            feature_mamba.init_from_target(head, target)
    else:
        config = eagle3.Eagle3Config.from_target(target.config, cfg.aux_layers, d2t)
        head = eagle3.Eagle3Head(config)
        if cfg.init == "target":
            eagle3.init_from_target(head, target, seed)
    head.use_embedding(target.get_input_embeddings())
    return head, config


def head_from_export(recipe: Recipe, cfg: Eagle3TaskConfig, target):
    """(head, draft vocabulary, config) of the eagle3 export model.init_from names (an export or a finished run):
    fine-tuning, e.g. at a longer context than the head first trained at. Its body, aux layers and draft
    vocabulary are the export's; a recipe that asks for others is refused rather than silently overridden."""
    from pathlib import Path

    from draftforge.models.eagle3_export import is_eagle3_export, load_head

    path = Path(recipe.model.init_from)
    if not is_eagle3_export(path) and is_eagle3_export(path / "export"):  # a finished run: its export
        path = path / "export"
    require(is_eagle3_export(path), "model.init_from", f"{path} is not an eagle3 export (draftforge.json with task "
            "eagle3); an eagle3 run starts from the target (eagle3.init) or from an exported head")
    head, _ = load_head(path, target.config)
    config = head.config
    body = getattr(config, "body", "attention")
    require(body == cfg.body, "eagle3.body", f"model.init_from {path} holds a {body} head; set eagle3.body: {body}")
    require(cfg.aux_layers is None or list(cfg.aux_layers) == list(config.aux_layers), "eagle3.aux_layers",
            f"model.init_from {path} reads target layers {list(config.aux_layers)}; drop the key or use those")
    d2t = config.draft_vocab
    want = recipe.model.draft_vocab
    require(want is None or (d2t is not None and want == len(d2t)), "model.draft_vocab",
            f"model.init_from {path} has {'no' if d2t is None else len(d2t)} draft vocabulary; drop the key")
    head = head.float()
    head.use_embedding(target.get_input_embeddings())
    return head, (None if d2t is None else list(d2t)), config


def build_eagle3_task(recipe: Recipe, accelerator, with_data: bool = True):
    """The head (trainable), the target (frozen, read once per step), blocks of input_ids + labels."""
    from draftforge.data import build_block_data, describe
    from draftforge.models.eagle3_export import save_head
    from draftforge.train.lm import DRAFT_VOCAB_FILE, choose_draft_vocab
    from draftforge.train.parts import load_tokenizer
    from draftforge.train.spec import TaskSpec

    cfg = recipe.task_options or Eagle3TaskConfig()
    tokenizer = load_tokenizer(recipe)
    target = load_frozen_target(recipe)
    data = None
    if with_data:
        with accelerator.main_process_first():
            data = build_block_data(recipe.data, tokenizer, recipe.train.block_size, recipe.train.seed,
                                    vocab_size=target.config.vocab_size)
        accelerator.print(f"[draftforge] {describe(data)}")
    if recipe.model.init_from:  # fine-tuning an exported head
        head, d2t, config = head_from_export(recipe, cfg, target)
        start = f"from {recipe.model.init_from}"
    else:
        d2t = choose_draft_vocab(recipe, target, data, tokenizer)  # the target stands in: it has no map of its own
        head, config = make_head(cfg, target, d2t, recipe.train.seed)
        start = f"init {cfg.init}"
    trainable = sum(p.numel() for p in head.parameters())
    rows = f"{len(d2t):,}-token draft vocabulary" if d2t is not None else "full vocabulary"
    accelerator.print(f"[draftforge] eagle3: {cfg.body} head on target layers {config.aux_layers} of "
                      f"{config.num_target_layers} ({rows}, {start}), {trainable:,} trainable parameters; training-time test over "
                      f"{cfg.steps} steps (decay {cfg.step_decay}), loss {cfg.loss}; target frozen in {target.dtype}")
    d2t_N = None if d2t is None else torch.tensor(d2t, dtype=torch.long)
    run_files = {DRAFT_VOCAB_FILE: json.dumps(d2t)} if d2t is not None else {}
    target_config = target.config
    steps = cfg.steps

    def export(trained, out_dir, metadata, overwrite=False):  # metadata: the caller's + export_metadata
        return save_head(trained, target_config, tokenizer, out_dir, metadata, steps=steps, overwrite=overwrite)

    return TaskSpec(model=head, loss=ttt_loss(target, config.aux_layers, cfg, d2t_N), count=loss_positions,
                    frozen={"target": target}, train_data=data and data.train, eval_data=data and data.eval,
                    export=export, tokenizer=tokenizer, unit="tokens",
                    export_metadata={"aux_layers": config.aux_layers, "ttt_steps": cfg.steps,
                                     **({"draft_vocab_size": len(d2t)} if d2t is not None else {})},
                    data_stats=data.stats if data else {}, run_files=run_files,
                    derive_metrics=lambda means: derive(means, steps, (cfg.draft_cost, cfg.verify_cost)),
                    export_report=acceptance_report)

