"""The one training loop (DESIGN.md principle 1). Tasks plug in through `TaskParts`.

Legend: B = micro-batch, T = block size, V = vocab, G = global batch (sequences per step),
W = processes, A = gradient-accumulation micro-steps (G = B * A * W).

The loss of a step is the sum of token losses over the whole global batch divided by the number
of loss tokens in it, so 1 process and W processes compute the same gradient (DDP averages
gradients, hence the factor W; Accelerate/DeepSpeed divide by A, hence the factor A).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from draftforge.errors import CheckpointError, DataError, DraftforgeError
from draftforge.recipe import Recipe, dump_recipe
from draftforge.train import checkpoint as ckpt
from draftforge.train import distributed as dist
from draftforge.train.batches import BatchPlan, DataExhausted


class TrainingDiverged(DraftforgeError):
    """The loss became NaN/inf."""


@dataclass
class TaskParts:
    model: torch.nn.Module  # frozen parts already have requires_grad=False
    tokenizer: Any
    train_data: Any  # datasets.Dataset / IterableDataset of fixed-length blocks
    eval_data: Any  # datasets.Dataset or None
    loss_fn: Callable  # (model, batch) -> (loss_sum, n_tokens, metrics dict)
    export_metadata: dict = field(default_factory=dict)
    data_stats: dict = field(default_factory=dict)


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    final_loss: float
    eval_loss: float | None
    tokens_per_s: float
    export_dir: Path | None
    losses: list[float]


def make_accelerator(recipe: Recipe) -> Accelerator:
    t = recipe.train
    precision = t.precision
    if precision == "auto":
        precision = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
    trackers = [x for x in t.trackers if x != "auto"]
    if "auto" in t.trackers:
        try:
            import tensorboard  # noqa: F401
            trackers.append("tensorboard")
        except ImportError:
            pass
    dist.require_backend_installed()
    acc = Accelerator(mixed_precision="no" if precision == "fp32" else precision,
                      log_with=trackers or None, project_dir=str(Path(recipe.output_dir) / "logs"),
                      **dist.accelerator_kwargs())
    per_step = t.micro_batch_size * acc.num_processes
    if t.global_batch_size % per_step:
        lo = max(per_step, t.global_batch_size // per_step * per_step)
        raise DraftforgeError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by micro_batch_size x processes "
            f"= {t.micro_batch_size} x {acc.num_processes}; nearest valid: {lo} or {lo + per_step}")
    acc.gradient_accumulation_steps = t.global_batch_size // per_step
    dist.configure_deepspeed(acc, recipe)  # DeepSpeed's batch fields come from the recipe, never "auto"
    return acc


def prepare_run_dir(recipe: Recipe, acc: Accelerator, *, resume: bool, overwrite: bool) -> Path:
    """Check the output dir on every process (read-only), then let the main process write it.

    The barrier between the two keeps a fast main process from creating the run before a slower
    process has looked, which would make that process refuse an "existing" run.
    """
    run_dir = Path(recipe.output_dir)
    saved = run_dir / "recipe.yaml"
    replace = False
    if resume:
        if not saved.is_file():
            raise CheckpointError(f"--resume: {run_dir} holds no run (no recipe.yaml); start without --resume")
        old = yaml.safe_load(saved.read_text())
        diff = ckpt.recipe_differences(old, recipe.to_dict())
        if diff:
            raise CheckpointError(f"--resume: the recipe differs from the run in {run_dir} in "
                                  f"{', '.join(diff)}; resume with the same recipe or use a new output_dir")
    elif run_dir.exists() and any(run_dir.iterdir()):
        if not overwrite:
            raise DraftforgeError(f"output directory {run_dir} already holds a run; pass --resume to continue "
                                  "it, --overwrite to replace it, or choose another output_dir")
        replace = True
    acc.wait_for_everyone()
    if acc.is_main_process:
        if replace:
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "recipe.yaml").write_text(dump_recipe(recipe))
    acc.wait_for_everyone()
    return run_dir


def build_optimizer(model: torch.nn.Module, recipe: Recipe):
    o = recipe.optim
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(recipe))


def lr_lambda(recipe: Recipe) -> Callable[[int], float]:
    o, total = recipe.optim, recipe.train.max_steps

    def factor(step: int) -> float:
        if step < o.warmup_steps:
            return (step + 1) / (o.warmup_steps + 1)
        if o.schedule == "constant":
            return 1.0
        progress = min((step - o.warmup_steps) / max(total - o.warmup_steps, 1), 1.0)
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if o.schedule == "cosine" else 1 - progress
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * shape

    return factor


def train(recipe: Recipe, build_task: Callable[[Recipe, Accelerator], TaskParts], *, resume: bool = False,
          overwrite: bool = False, stop_after: int | None = None) -> TrainResult:
    """Run (or resume) a training run. `stop_after=k` stops after step k, as a kill would (tests)."""
    acc = make_accelerator(recipe)
    t = recipe.train
    say = acc.print
    run_dir = prepare_run_dir(recipe, acc, resume=resume, overwrite=overwrite)
    set_seed(t.seed)
    parts = build_task(recipe, acc)
    A = acc.gradient_accumulation_steps
    say(f"[draftforge] {recipe.task}: {acc.num_processes} process(es) x micro-batch {t.micro_batch_size} x "
        f"{A} accumulation = global batch {t.global_batch_size} sequences of {t.block_size} tokens; "
        f"precision {acc.mixed_precision}, device {acc.device}, backend {dist.backend(acc)}")
    opt, sched = build_optimizer(parts.model, recipe)
    dist.fit_fsdp_wrap_policy(acc, parts.model)
    if dist.batch_note(acc):
        say(f"[draftforge] {dist.batch_note(acc)}")
    model, opt = acc.prepare(parts.model, opt)
    acc.register_for_checkpointing(sched)
    plan = BatchPlan(parts.train_data, t.global_batch_size, t.micro_batch_size, acc.process_index,
                     acc.num_processes, t.seed)

    start, tokens_seen = 0, 0
    if resume:
        last = ckpt.latest_valid(run_dir, warn=say)
        state = ckpt.read_loop_state(last)
        dist.check_resume(state, acc, last)  # which world-size changes the backend can reshard
        acc.load_state(str(last))
        start, tokens_seen = state["step"], state["tokens_seen"]
        say(f"[draftforge] resumed from {last} (step {start})")
    metrics_log = _MetricsLog(run_dir / "metrics.jsonl", acc.is_main_process, truncate_after=start)
    if acc.is_main_process and acc.log_with:
        acc.init_trackers("draftforge", config=_tracker_config(recipe))

    losses, eval_loss, last_loss = [], None, float("nan")
    bar = tqdm(total=t.max_steps, initial=start, disable=not acc.is_main_process, desc=recipe.task,
               dynamic_ncols=True, mininterval=1.0)
    train_time, timed_tokens = 0.0, 0
    step, ended = start, None
    for step in range(start + 1, t.max_steps + 1):
        t0 = time.perf_counter()
        micro, ended = _next_batches(plan, step, acc)
        if ended is not None:
            step -= 1
            break
        last_loss = _train_step(model, opt, sched, micro, parts.loss_fn, acc, recipe, step)
        dt = time.perf_counter() - t0
        step_tokens = t.global_batch_size * t.block_size
        tokens_seen += step_tokens
        if step > start + 1 or step == t.max_steps:  # the first step pays warm-up costs
            train_time, timed_tokens = train_time + dt, timed_tokens + step_tokens
        losses.append(last_loss)
        tok_s = timed_tokens / train_time if train_time else step_tokens / dt
        bar.set_postfix(loss=f"{last_loss:.4f}", lr=f"{sched.get_last_lr()[0]:.2e}", tok_s=f"{tok_s:,.0f}")
        bar.update(1)
        record = {"step": step, "loss": last_loss, "lr": sched.get_last_lr()[0], "tokens": tokens_seen}
        if t.eval_every and step % t.eval_every == 0 or step == t.max_steps:
            eval_loss = evaluate(model, parts, acc, t)
            if eval_loss is not None:
                record["eval_loss"] = eval_loss
        if step % t.log_every == 0 or "eval_loss" in record or step == t.max_steps:
            metrics_log.write(record)
            acc.log({k: v for k, v in record.items() if k != "step"}, step=step)
        if t.save_every and step % t.save_every == 0 or step == t.max_steps or step == stop_after:
            save(acc, run_dir, recipe, step, tokens_seen)
        if step == stop_after:
            break
    bar.close()
    if ended is not None:
        eval_loss = _finish_early(acc, model, parts, recipe, run_dir, step, start, tokens_seen, ended, eval_loss)

    export_dir = None
    if (step == t.max_steps or ended is not None) and t.export:
        export_dir = export_run(acc, model, parts, recipe, run_dir,
                                {"final_loss": last_loss, "eval_loss": eval_loss, "steps": step})
    acc.end_training()  # after the export: it tears down the process group the gather needs
    tok_s = timed_tokens / train_time if train_time else 0.0
    result = TrainResult(run_dir, step, last_loss, eval_loss, tok_s, export_dir, losses)
    ev = f", eval loss {eval_loss:.4f}" if eval_loss is not None else ""
    say(f"[draftforge] done: step {step}/{t.max_steps}, loss {last_loss:.4f}{ev}, {tok_s:,.0f} tokens/s; "
        f"run in {run_dir}" + (f"; export in {export_dir}" if export_dir else ""))
    return result


def _next_batches(plan: BatchPlan, step: int, acc: Accelerator):
    """(micro-batches, None), or (None, reason) when a streaming source has no full batch for `step`."""
    try:
        micro, ended = plan.micro_batches(step - 1, acc.device), None
    except DataExhausted as e:
        micro, ended = None, str(e)
    if plan.streaming and acc.num_processes > 1:  # all processes must stop at the same step or collectives hang
        short = acc.reduce(torch.tensor(float(micro is None), device=acc.device), "sum").item()
        if short and ended is None:
            ended = f"the stream ended during step {step} on another process"
    return (None, ended) if ended is not None else (micro, None)


def _finish_early(acc, model, parts, recipe, run_dir, step, start, tokens_seen, why, eval_loss):
    """A streaming source ran out before max_steps: final eval + checkpoint, then the normal export."""
    t = recipe.train
    if step == 0:
        raise DataError(f"the streaming training data holds fewer than one global batch "
                        f"({t.global_batch_size} blocks of {t.block_size} tokens): {why}; add data or lower "
                        "train.global_batch_size")
    acc.print(f"[draftforge] {why}: the streaming data is exhausted, so training finishes at step {step} of "
              f"{t.max_steps} ({tokens_seen:,} tokens); writing the final checkpoint and export")
    if step > start:
        eval_loss = evaluate(model, parts, acc, t)
        if not (t.save_every and step % t.save_every == 0):
            save(acc, run_dir, recipe, step, tokens_seen)
    return eval_loss


def _train_step(model, opt, sched, micro, loss_fn, acc: Accelerator, recipe: Recipe, step: int) -> float:
    model.train()
    count = torch.stack([(mb["labels"][:, 1:] != -100).sum() for mb in micro]).sum().float()
    global_count = acc.reduce(count, "sum").item()  # one host sync per step, not one per micro-batch
    if global_count == 0:
        raise DraftforgeError(f"step {step}: the global batch has no loss tokens (all labels are -100); "
                              "check the data's loss mask")
    scale = acc.num_processes * acc.gradient_accumulation_steps / global_count
    loss_sum = torch.zeros((), device=acc.device)
    for mb in micro:
        with acc.accumulate(model):
            s, _, _ = loss_fn(model, mb)
            acc.backward(s * scale)
            loss_sum += s.detach().float()
    loss = acc.reduce(loss_sum, "sum").item() / global_count
    if not math.isfinite(loss):
        raise TrainingDiverged(f"loss became {loss} at step {step}; the last good checkpoint is kept in "
                               f"{Path(recipe.output_dir) / 'checkpoints'}: lower optim.lr, keep optim.grad_clip "
                               "on, or check the data, then resume")
    if recipe.optim.grad_clip > 0:
        acc.clip_grad_norm_(model.parameters(), recipe.optim.grad_clip)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return loss


@torch.no_grad()
def evaluate(model, parts: TaskParts, acc: Accelerator, t) -> float | None:
    data = parts.eval_data
    if data is None:
        return None
    model.eval()
    n = t.eval_batches * t.micro_batch_size * acc.num_processes
    if hasattr(data, "__len__"):
        n_rows = min(len(data), n)
        take = lambda idx: data[idx]  # noqa: E731
    else:  # streaming eval: the first n blocks, strided over processes like the training rows
        head = list(itertools.islice(iter(data), n))
        n_rows = len(head)
        take = lambda idx: {k: [head[i][k] for i in idx] for k in ("input_ids", "labels")}  # noqa: E731
    mine = list(range(acc.process_index, n_rows, acc.num_processes))
    # Every process runs the same number of forwards: under FSDP / ZeRO-3 each forward gathers
    # parameters from all ranks, so a rank with one row fewer would leave the others waiting.
    n_forwards = math.ceil(math.ceil(n_rows / acc.num_processes) / t.micro_batch_size)
    total, count = torch.zeros((), device=acc.device), torch.zeros((), device=acc.device)
    for i in range(n_forwards):
        idx = mine[i * t.micro_batch_size:(i + 1) * t.micro_batch_size]
        rows = take(idx or [0])
        batch = {k: torch.tensor(v, device=acc.device) for k, v in rows.items() if k in ("input_ids", "labels")}
        if not idx:  # this rank's rows ran out: a forward that counts nothing
            batch["labels"] = torch.full_like(batch["labels"], -100)
        s, c, _ = parts.loss_fn(model, batch)
        total += s.float()
        count += c
    total, count = acc.reduce(total, "sum"), acc.reduce(count.float(), "sum")
    return (total / count).item() if count > 0 else None


def save(acc: Accelerator, run_dir: Path, recipe: Recipe, step: int, tokens_seen: int) -> None:
    tmp = ckpt.begin(run_dir, step)  # removes a stale temp dir a killed save left (main process only)
    if acc.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    acc.wait_for_everyone()
    acc.save_state(str(tmp))
    acc.wait_for_everyone()
    if acc.is_main_process:
        state = {"step": step, "tokens_seen": tokens_seen, "task": recipe.task, "world_size": acc.num_processes,
                 "backend": dist.backend(acc), "recipe": recipe.to_dict()}
        ckpt.commit(tmp, state, recipe.train.keep_checkpoints)
    acc.wait_for_everyone()


def export_run(acc, model, parts: TaskParts, recipe: Recipe, run_dir: Path, metrics: dict) -> Path | None:
    from draftforge.export import export_model

    acc.wait_for_everyone()
    # FSDP / ZeRO-3: no process holds the full weights; gather them (collective) into a CPU copy.
    unwrapped = dist.gathered_model(acc, model) if dist.shards_weights(acc) else acc.unwrap_model(model)
    out = None
    if acc.is_main_process:
        meta = {"task": recipe.task, "target": recipe.model.target, "recipe": recipe.to_dict(),
                "metrics": metrics, **parts.export_metadata}
        out = export_model(unwrapped, parts.tokenizer, run_dir / "export", metadata=meta, overwrite=True)
    acc.wait_for_everyone()
    return out


class _MetricsLog:
    """metrics.jsonl; on resume, lines past the resumed step are dropped so the log matches a clean run."""

    def __init__(self, path: Path, active: bool, truncate_after: int):
        self.path, self.active = path, active
        if active and path.exists():
            keep = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= truncate_after]
            path.write_text("".join(ln + "\n" for ln in keep))

    def write(self, record: dict) -> None:
        if self.active:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def _tracker_config(recipe: Recipe) -> dict:
    return {k: (v if isinstance(v, (int, float, str, bool)) else str(v))
            for k, v in ckpt.flatten(recipe.to_dict()).items()}


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln] if path.exists() else []
