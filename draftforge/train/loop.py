"""The one training loop (docs/design.md §2, §6 principle 1). Tasks plug in through a `TaskSpec` (spec.py).

Length (~420 lines): the loop, its eval pass and its export are one lifecycle that shares the Trainer's state;
split, each part would take that state as arguments.

Legend: B = micro-batch, T = block size, V = vocab, G = global batch (rows per step),
W = processes, A = gradient-accumulation micro-steps (G = B * A * W).

The loss of a step is the sum of the task's losses over the whole global batch divided by the
number of counted units in it (loss tokens, rows, ...), so 1 process and W processes compute the
same gradient (DDP averages gradients, hence the factor W; Accelerate/DeepSpeed divide by A, hence
the factor A).

Held-out numbers come from one eval pass (`evaluate_pass`): the loop's evals (eval_loss and the task's eval_*
metrics, reduced over processes) and, at export, the task's report on the weights it writes
(`TaskSpec.export_report`, e.g. distill's acceptance), which the export's metadata carries.
"""

from __future__ import annotations

import itertools
import math
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from draftforge.errors import DataError, DraftforgeError, RecipeError
from draftforge.recipe import Recipe
from draftforge.runtime import resolve_precision
from draftforge.train import checkpoint as ckpt
from draftforge.train import distributed as dist
from draftforge.train.batches import BatchPlan, DataExhausted
from draftforge.train.best import BestKeeper
from draftforge.train.metrics_log import MetricsLog, read_metrics  # noqa: F401  (read_metrics: public API)
from draftforge.train.optim import build_optimizer, lr_lambda
from draftforge.train.rundir import RESUME, RESTART, RunDir, run_lock
from draftforge.train.spec import TaskSpec


class TrainingDiverged(DraftforgeError):
    """The loss became NaN/inf."""


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    final_loss: float
    eval_loss: float | None
    tokens_per_s: float  # units per second in the task's unit (tokens for LM tasks)
    export_dir: Path | None
    losses: list[float]


def check_trackers_installed(trackers: list[str]) -> None:
    """A tracker the recipe names must be installed where the run starts: Accelerate drops one that is not, with a
    log line, and the run logs nothing to it (a recipe naming wandb trained with no wandb run at all). Checked at
    the start of training, not when a recipe is read (an export on another machine reads the run's recipe too)."""
    from accelerate.tracking import get_available_trackers

    here = {str(getattr(x, "value", x)) for x in get_available_trackers()}
    missing = [x for x in trackers if x != "all" and x not in here]
    if missing:
        them = "it" if len(missing) == 1 else "them"
        raise RecipeError(f"recipe key 'train.trackers': {', '.join(missing)} not installed here (the run would log "
                          f"nothing to {them}): pip install {' '.join(missing)}, or drop {them}")


def holds_run(output_dir, acc) -> bool:
    """--auto-resume's choice, made by the main process and shared, so that no process decides after another has
    written the run's first files: whether output_dir holds a run's recipe.yaml (a folder holding one that
    draftforge did not write is then refused by --resume's own check, never taken over)."""
    found = (Path(output_dir) / "recipe.yaml").is_file() if acc.is_main_process else None
    if acc.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        found = broadcast_object_list([found])[0]
    acc.print(f"[draftforge] --auto-resume: {'continuing the run in' if found else 'no run yet in'} {output_dir}"
              + ("" if found else "; starting one"), flush=True)
    return bool(found)


def batch_problem(global_batch: int, micro: int, processes: int) -> str:
    """Why global_batch cannot be micro x accumulation x processes, and the two ways out: a micro-batch that keeps
    the global batch (the same training: only how many sequences one forward holds changes), or another global
    batch (which changes the optimisation)."""
    per_step = micro * processes
    lo = max(per_step, global_batch // per_step * per_step)
    text = (f"train.global_batch_size={global_batch} is not divisible by micro_batch_size x processes = {micro} x "
            f"{processes}")
    if global_batch % processes == 0:  # the same global batch with a smaller micro-batch (more accumulation)
        each = global_batch // processes
        keep = max(m for m in range(1, min(micro, each) + 1) if each % m == 0)
        text += (f"; to keep the global batch (the same training), set train.micro_batch_size={keep} (it must divide "
                 f"{each} sequences per process), or give another global batch: {lo} or "
                 f"{lo + per_step}")
    else:
        text += f"; nearest valid global batch: {lo} or {lo + per_step}"
    return text


def make_accelerator(recipe: Recipe) -> Accelerator:
    t = recipe.train
    precision = resolve_precision(t.precision)
    trackers = [x for x in t.trackers if x != "auto"]
    check_trackers_installed(trackers)
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
    dist.adopt_cpu_fsdp(acc)  # an FSDP launch on CPU processes: Accelerate drops the FSDP plugin there
    per_step = t.micro_batch_size * acc.num_processes
    if t.global_batch_size % per_step:
        raise DraftforgeError(batch_problem(t.global_batch_size, t.micro_batch_size, acc.num_processes))
    acc.gradient_accumulation_steps = t.global_batch_size // per_step
    dist.configure_deepspeed(acc, recipe)  # DeepSpeed's batch fields come from the recipe, never "auto"
    return acc


def train(recipe: Recipe, build_task, *, resume: bool = False, overwrite: bool = False, auto_resume: bool = False,
          stop_after: int | None = None) -> TrainResult:
    """Run (or resume) a training run. `stop_after=k` stops after step k, as a kill would (tests). `auto_resume`:
    resume where output_dir holds a run, else start one (a scheduler that reruns one command line)."""
    acc = make_accelerator(recipe)
    with run_lock(recipe.output_dir, acc):  # one run per output_dir at a time
        if auto_resume:
            resume = holds_run(recipe.output_dir, acc)
        run_dir = RunDir(recipe, acc, resume=resume, overwrite=overwrite)  # checks only: nothing written yet
        set_seed(recipe.train.seed)
        try:
            trainer = Trainer(recipe, acc, build_task(recipe, acc), run_dir, build_task)
            return trainer.fit(stop_after)
        except BaseException:
            if not run_dir.checkpointed:
                run_dir.abandon()  # a run that never checkpointed leaves output_dir as it found it
            raise


class Trainer:
    """Owns the accelerator, the prepared model and optimizer, the schedule, the data plan and the counters."""

    def __init__(self, recipe: Recipe, acc: Accelerator, spec: TaskSpec, run_dir: RunDir, build_task=None):
        self.recipe, self.acc, self.spec, self.run_dir, self.t = recipe, acc, spec, run_dir, recipe.train
        self.build_task = build_task
        self.say = acc.print
        self._announce()
        dist.check_frozen_placement(acc, spec.frozen)
        for module in spec.frozen.values():  # never prepared: no optimizer state, no grad sync, no sharding
            module.to(acc.device).eval().requires_grad_(False)
        dist.share_frozen(acc, spec.frozen)  # under FSDP, transformers may load them whole on rank 0 only
        opt, self.sched = build_optimizer(spec.model, recipe)
        dist.fit_fsdp_wrap_policy(acc, spec.model)
        filled = dist.fill_deepspeed_buckets(acc, spec.model)
        if filled:
            self.say(f"[draftforge] DeepSpeed: {', '.join(filled)} set to DeepSpeed's defaults (the model has no "
                     "config.hidden_size for \"auto\" to size them from)")
        if dist.batch_note(acc):
            self.say(f"[draftforge] {dist.batch_note(acc)}")
        self.model, self.opt = acc.prepare(spec.model, opt)
        acc.register_for_checkpointing(self.sched)
        self.plan = BatchPlan(spec.train_data, self.t.global_batch_size, self.t.micro_batch_size,
                              acc.process_index, acc.num_processes, self.t.seed, collate=spec.collate)
        run_dir.claim(spec.run_files)  # the first write to output_dir: recipe, data and model are known to work
        self.losses, self.eval_loss, self.last_loss = [], None, float("nan")
        self.start, self.units_seen = self._resume_point()  # a resumed run's last loss and eval loss too
        self.best = BestKeeper(self.t.keep_best, run_dir.path, self.start, main=self.acc.is_main_process)
        # a restart (killed before its first checkpoint) starts the log again: its step-0 eval is logged anew
        self.metrics_log = MetricsLog(run_dir.path / "metrics.jsonl", acc.is_main_process,
                                      self.start if run_dir.mode == RESUME else -1)
        if acc.is_main_process and acc.log_with:
            acc.init_trackers("draftforge", config=_tracker_config(recipe), init_kwargs=self._tracker_kwargs(run_dir))
        self.train_time, self.timed_units = 0.0, 0
        self.first_step = (0.0, 0)  # the run's first step, untimed (warm-up costs): the pace of a one-step run

    def _tracker_kwargs(self, run_dir) -> dict:
        """TensorBoard drops the events a killed run logged after the step it continues from, as metrics.jsonl
        does (else a resumed run's steps show twice); every event on a restart from step 0."""
        if run_dir.mode not in (RESUME, RESTART) or not any(str(t) == "tensorboard" for t in self.acc.log_with):
            return {}
        return {"tensorboard": {"purge_step": self.start + 1 if run_dir.mode == RESUME else 0}}

    def _announce(self) -> None:
        t, acc = self.t, self.acc
        rows = f"sequences of {t.block_size} tokens" if self.spec.unit == "tokens" else "rows"
        precision = "fp32" if acc.mixed_precision == "no" else acc.mixed_precision
        self.say(f"[draftforge] {self.recipe.task}: {acc.num_processes} process(es) x micro-batch "
                 f"{t.micro_batch_size} x {acc.gradient_accumulation_steps} accumulation = global batch "
                 f"{t.global_batch_size} {rows}; precision {precision}, device {acc.device}, "
                 f"backend {dist.backend(acc)}")
        o = self.recipe.optim
        if o.warmup_steps >= t.max_steps:  # legal (a short smoke run), but the LR never reaches optim.lr
            self.say(f"[draftforge] warning: optim.warmup_steps ({o.warmup_steps}) >= train.max_steps ({t.max_steps}): "
                     f"the learning rate rises to {t.max_steps / (o.warmup_steps + 1):.2g} x optim.lr at the last "
                     f"step and never decays")

    def _resume_point(self) -> tuple[int, int]:
        if self.run_dir.mode == RESTART:
            self.say(f"[draftforge] --resume: {self.run_dir.path} has no checkpoint yet (the run stopped before "
                     "its first one); starting from step 0 of the same recipe")
        if self.run_dir.mode != RESUME:
            return 0, 0
        last = self.run_dir.resume_from  # the newest intact checkpoint (RunDir checked, and said why not a newer)
        state = ckpt.read_loop_state(last)
        dist.check_resume(state, self.acc, last)  # which world-size changes the backend can reshard
        self.acc.load_state(str(last))
        # Accelerate restores its micro-step counter, which decides the step that syncs (counter % accumulation ==
        # 0): from a launch with other accumulation (another process count) it can fall on the first micro-batch of
        # every step, and then no optimizer step ever runs. Steps here start at 0, as every step of this loop does.
        self.acc.step = 0
        if "train.max_steps" in self.run_dir.changes:  # an extension: the optimizer came back at the old curve's rate
            self._rate_from_schedule()
        self.run_dir.checkpointed = True
        # checkpoints from before these keys resume without them (the summary then has no loss to give)
        self.last_loss = state.get("last_loss") if state.get("last_loss") is not None else float("nan")
        self.eval_loss = state.get("eval_loss")
        self.say(f"[draftforge] resumed from {last} (step {state['step']})")
        return state["step"], state["tokens_seen"]

    def _rate_from_schedule(self) -> None:
        """Set the learning rate the rebuilt schedule gives at the resumed step. load_state restores the optimizer's
        own rate, the old max_steps' curve's, and LambdaLR takes over only from its next step, so the first step of
        an extended cosine run used the old rate while the resume line announced the new one."""
        factor = lr_lambda(self.recipe)(self.sched.last_epoch)
        for group, base in zip(self.opt.param_groups, self.sched.base_lrs):
            group["lr"] = base * factor  # what LambdaLR computes: the same float
        self.sched._last_lr = [group["lr"] for group in self.opt.param_groups]

    def fit(self, stop_after: int | None = None) -> TrainResult:
        t = self.t
        bar = tqdm(total=t.max_steps, initial=self.start, disable=not self.acc.is_main_process,
                   desc=self.recipe.task, dynamic_ncols=True, mininterval=1.0)
        step, ended = self.start, None
        if t.eval_at_start and self.start == 0:
            self._eval_at_start()
        else:
            self._check_best_metric()
        for step in range(self.start + 1, t.max_steps + 1):
            micro, ended = _next_batches(self.plan, step, self.acc)
            if ended is not None:
                step -= 1
                break
            self._step(step, micro, bar)
            if t.save_every and step % t.save_every == 0 or step == t.max_steps or step == stop_after:
                self.save(step)
            if step == stop_after:
                break
        bar.close()
        if ended is not None:
            self._finish_early(step, ended)
        export_dir = None
        if (step == t.max_steps or ended is not None) and t.export:
            export_dir = self.export({"final_loss": self.last_loss, "eval_loss": self.eval_loss, "steps": step})
        self.acc.end_training()  # after the export: it tears down the process group the gather needs
        return self._summary(step, export_dir)

    def _step(self, step: int, micro: list[dict], bar) -> None:
        lr = self.opt.param_groups[0]["lr"]  # the rate this step uses (the scheduler moves on inside train_step)
        t0 = time.perf_counter()
        self.last_loss, metrics = self.train_step(micro, step)
        dt = time.perf_counter() - t0
        units = sum(self.spec.units(mb) for mb in micro) * self.acc.num_processes
        self.units_seen += units
        if step > self.start + 1 or step == self.t.max_steps:  # the first step pays warm-up costs
            self.train_time, self.timed_units = self.train_time + dt, self.timed_units + units
        else:
            self.first_step = (dt, units)
        self.losses.append(self.last_loss)
        rate = self.timed_units / self.train_time if self.train_time else units / dt
        bar.set_postfix({"loss": f"{self.last_loss:.4f}", "lr": f"{lr:.2e}", f"{self.spec.unit[:3]}/s": f"{rate:,.0f}"})
        bar.update(1)
        record = {"step": step, "loss": self.last_loss, "lr": lr, self.spec.unit: self.units_seen, **metrics}
        if self.t.eval_every and step % self.t.eval_every == 0 or step == self.t.max_steps:
            self._eval(step, record)
        if step % self.t.log_every == 0 or "eval_loss" in record or step == self.t.max_steps:
            self._log(record)

    def _eval(self, step: int, record: dict) -> None:
        """Held-out loss and metrics into `record`; keep the weights when train.keep_best's metric improves."""
        eval_metrics = {}
        self.eval_loss = evaluate(self.model, self.spec, self.acc, self.t, eval_metrics)
        if self.eval_loss is not None:
            record.update(eval_loss=self.eval_loss, **{f"eval_{k}": v for k, v in eval_metrics.items()})
        value = self.best.value(self.eval_loss, eval_metrics)
        if self.best.improves(value):  # the same verdict on every process: eval metrics are reduced
            self._keep_best(step, value)

    def _log(self, record: dict) -> None:
        """One record into metrics.jsonl and the trackers (at its step)."""
        self.metrics_log.write(record)
        self.acc.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def _check_best_metric(self) -> None:
        """A train.keep_best metric the eval does not log was refused only at the first eval, eval_every steps (minutes
        or hours) in: one held-out micro-batch names the eval's metrics before the first step. Every process runs it
        (the eval reduces across them) with the RNG forked, so the run's steps are what they would have been."""
        if self.best.metric is not None and self.spec.eval_data is None:  # the recipe asked for held-out data
            # (recipe.py checks that), and none came out of it: the last step's weights would be exported silently
            raise DraftforgeError(f"train.keep_best: {self.best.metric} needs held-out data, and the held-out set "
                                  "came out empty (a source of one document holds nothing out; held-out rows longer "
                                  "than train.block_size lose their loss tokens); add documents or data.eval_sources")
        if self.best.metric in (None, "loss") or self.spec.eval_data is None:
            return
        devices = [self.acc.device] if torch.device(self.acc.device).type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            probe = evaluate_pass(self.model, self.spec, self.acc, replace(self.t, eval_batches=1))
        if probe is not None and probe.loss is not None:
            self.best.value(probe.loss, probe.metrics)  # DraftforgeError naming the metrics it does log

    def _eval_at_start(self) -> None:
        """train.eval_at_start: the starting weights' held-out metrics, logged as step 0 (not on a resume)."""
        record = {"step": 0}
        self._eval(0, record)
        if "eval_loss" not in record:
            self.say("[draftforge] train.eval_at_start: there is no held-out data to evaluate on")
            return
        self.say(f"[draftforge] step 0 (the starting weights): eval loss {record['eval_loss']:.4f}")
        self._log(record)

    def train_step(self, micro: list[dict], step: int) -> tuple[float, dict]:
        """One optimizer step over this process's micro-batches: (global mean loss, mean metrics)."""
        acc, model, spec = self.acc, self.model, self.spec
        model.train()
        count = torch.stack([spec.count(mb) for mb in micro]).sum().float()
        global_count = acc.reduce(count, "sum").item()  # one host sync per step, not one per micro-batch
        if global_count == 0:
            raise DraftforgeError(f"step {step}: the global batch has nothing to count a loss on (e.g. every "
                                  "label is -100); check the data's loss mask")
        scale = acc.num_processes * acc.gradient_accumulation_steps / global_count
        loss_sum, metric_sums = torch.zeros((), device=acc.device), {}
        for mb in micro:
            with acc.accumulate(model):
                s, _, metrics = spec.loss(model, mb)
                acc.backward(s * scale)
                loss_sum += s.detach().float()
                for k, v in metrics.items():
                    metric_sums[k] = metric_sums.get(k, 0) + torch.as_tensor(v, device=acc.device).detach().float()
        loss, metrics = self._reduce(loss_sum, metric_sums, global_count)
        if not math.isfinite(loss):
            raise TrainingDiverged(f"loss became {loss} at step {step}; the last good checkpoint is kept in "
                                   f"{self.run_dir.path / 'checkpoints'}: lower optim.lr, keep optim.grad_clip "
                                   "on, or check the data, then resume")
        if not acc.sync_gradients:  # the accumulation and this loop's step disagree: an optimizer step would be lost
            raise DraftforgeError(f"step {step}: the accelerator did not sync gradients at the step's last "
                                  "micro-batch (its micro-step counter is off); please report this")
        if self.recipe.optim.grad_clip > 0:
            acc.clip_grad_norm_(model.parameters(), self.recipe.optim.grad_clip)
        self.opt.step()
        if not acc.optimizer_step_was_skipped:  # fp16's loss scaler skips a step with inf gradients: so does the rate
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return loss, metrics

    def _reduce(self, loss_sum: torch.Tensor, metric_sums: dict, global_count: float) -> tuple[float, dict]:
        """Sum over processes (one collective, one host sync) and divide by the global count."""
        if not metric_sums:
            return self.acc.reduce(loss_sum, "sum").item() / global_count, {}
        values = self.acc.reduce(torch.stack([loss_sum, *metric_sums.values()]), "sum").tolist()
        return values[0] / global_count, with_derived(self.spec, {k: v / global_count for k, v in
                                                                   zip(metric_sums, values[1:])})

    def _finish_early(self, step: int, why: str) -> None:
        """A streaming source ran out before max_steps: final eval + checkpoint, then the normal export."""
        t = self.t
        if step == 0:
            raise DataError(f"the streaming training data holds fewer than one global batch "
                            f"({t.global_batch_size} blocks of {t.block_size} tokens): {why}; add data or lower "
                            "train.global_batch_size")
        self.say(f"[draftforge] {why}: the streaming data is exhausted, so training finishes at step {step} of "
                 f"{t.max_steps} ({self.units_seen:,} {self.spec.unit}); writing the final checkpoint and export")
        if step > self.start:
            if not (t.eval_every and step % t.eval_every == 0):  # the last step's eval, logged and kept as any
                record = {"step": step}
                self._eval(step, record)
                if "eval_loss" in record:
                    self._log(record)
            if not (t.save_every and step % t.save_every == 0):
                self.save(step)

    def save(self, step: int) -> None:
        acc = self.acc
        tmp = ckpt.begin(self.run_dir.path, step)
        if acc.is_main_process and tmp.exists():  # a stale temp dir a killed save left
            shutil.rmtree(tmp)
        acc.wait_for_everyone()
        acc.save_state(str(tmp))
        acc.wait_for_everyone()
        if acc.is_main_process:
            state = {"step": step, "tokens_seen": self.units_seen, "task": self.recipe.task,
                     "world_size": acc.num_processes, "backend": dist.backend(acc), "recipe": self.recipe.to_dict(),
                     # so a run resumed at its last step exports and reports them (JSON has no NaN)
                     "last_loss": self.last_loss if math.isfinite(self.last_loss) else None,
                     "eval_loss": self.eval_loss}
            ckpt.commit(tmp, state, self.t.keep_checkpoints)
        self.best.checkpointed(acc.is_main_process)
        acc.wait_for_everyone()
        self.run_dir.settle()

    def _full_model(self) -> torch.nn.Module:
        """The whole model: FSDP / ZeRO-3 hold no full copy anywhere, so gather one (collective) onto the CPU."""
        acc = self.acc
        acc.wait_for_everyone()
        if dist.shards_weights(acc):
            return dist.gathered_model(acc, self.model, self._empty_model if self.build_task else None)
        return acc.unwrap_model(self.model)

    def _keep_best(self, step: int, value: float) -> None:
        model = self._full_model()
        if self.acc.is_main_process:
            self.best.save(step, value, model)
            self.say(f"[draftforge] step {step}: best {self.t.keep_best} so far ({value:.4g}); weights kept in "
                     f"{self.best.dir}")
        else:  # every process holds the record, so every process decides the next eval the same way
            self.best.note(step, value)
        self.acc.wait_for_everyone()

    def export(self, metrics: dict) -> Path | None:
        acc = self.acc
        unwrapped = self._full_model()
        # train.keep_best: the best eval's weights, not the last step's (only the main process exports)
        kept = self.best.load_into(unwrapped) if acc.is_main_process else None
        if kept is not None:
            from draftforge.train.export_run import kept_metrics

            self.say(f"[draftforge] exporting the weights of step {kept['step']}, the best {kept['metric']} "
                     f"({kept['value']:.4g})" + ("" if kept["step"] == metrics.get("steps") else
                                                 f", not the last step's ({metrics.get('steps')})"))
            metrics = kept_metrics(self.run_dir.path, metrics, kept)
        out = None
        if acc.is_main_process:
            metrics = {**metrics, **self._export_report(unwrapped)}
            meta = {"task": self.recipe.task, "target": self.recipe.model.target, "recipe": self.recipe.to_dict(),
                    "metrics": metrics}
            out = self.spec.write_export(unwrapped, self.run_dir.path / "export", meta, overwrite=True)
        acc.wait_for_everyone()
        return out

    def _export_report(self, model: torch.nn.Module) -> dict:
        """The task's report on the weights being exported (spec.export_report), from one more eval pass on the
        main process alone; {} without one, or where the gathered model and a frozen module sit on different
        devices (FSDP / ZeRO-3 gather onto the CPU)."""
        spec = self.spec
        if spec.export_report is None:
            return {}
        device = next(model.parameters()).device
        if any(next(m.parameters(), torch.empty((), device=device)).device != device for m in spec.frozen.values()):
            return {}
        result = evaluate_pass(model, spec, self.acc, self.t, alone=True)
        return spec.export_report(result.metrics, int(result.count)) if result and result.count else {}

    def _empty_model(self) -> torch.nn.Module:
        """The task's model built again without data, as `draftforge export` builds it (its weights are then
        replaced by the gathered ones): for a model that cannot be rebuilt from its config alone."""
        from draftforge.train.export_run import _NoAccelerator

        class Quiet(_NoAccelerator):  # the builder's banner was printed when the run started
            def print(self, *args, **kwargs):
                pass

        return self.build_task(self.recipe, Quiet(), with_data=False).model

    def _summary(self, step: int, export_dir: Path | None) -> TrainResult:
        # a run that stopped after its first step (a stream holding one global batch, a stop) has only that one
        first_s, first_units = self.first_step
        rate = (self.timed_units / self.train_time if self.train_time else
                first_units / first_s if first_s else 0.0)
        ev = f", eval loss {self.eval_loss:.4f}" if self.eval_loss is not None else ""
        pace = f"{rate:,.0f} {self.spec.unit}/s" if self.losses else "no step left to run"
        self.say(f"[draftforge] done: step {step}/{self.t.max_steps}, loss {self.last_loss:.4f}{ev}, {pace}; "
                 f"run in {self.run_dir.path}" + (f"; export in {export_dir}" if export_dir else ""))
        return TrainResult(self.run_dir.path, step, self.last_loss, self.eval_loss, rate, export_dir, self.losses)


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


def with_derived(spec: TaskSpec, means: dict) -> dict:
    """The task's per-unit means plus what it derives from them (e.g. the chain τ an acceptance α implies)."""
    return {**means, **spec.derive_metrics(means)} if spec.derive_metrics is not None else means


@dataclass(frozen=True)
class EvalResult:
    loss: float | None  # held-out loss per counted unit (None: nothing counted)
    count: float  # units counted
    metrics: dict  # the task's metrics per unit, with what derive_metrics makes of them ({} when nothing counted)


def evaluate(model, spec: TaskSpec, acc: Accelerator, t, metrics_out: dict | None = None) -> float | None:
    """Held-out loss per counted unit (and, into `metrics_out`, the task's metrics per unit); every process runs
    the same number of forwards."""
    result = evaluate_pass(model, spec, acc, t)
    if result is None:
        return None
    if metrics_out is not None:
        metrics_out.update(result.metrics)
    return result.loss


@torch.no_grad()
def evaluate_pass(model, spec: TaskSpec, acc: Accelerator, t, *, alone: bool = False) -> EvalResult | None:
    """One pass over the held-out rows: the first eval_batches x micro_batch_size of them, however many processes
    share them (None without eval data), spec.loss on each micro-batch, its loss, count and metrics summed and
    divided by the count.
    No autograd graph is built: the sums would otherwise hold every micro-batch's graph until the pass ends (an
    EAGLE-3 eval of 16 micro-batches of 8 x 256 tokens in fp32 grew past 24 GiB and was killed).

    Together (the loop's evals) every process takes its strided share of the rows, sums in fp32 on its device and
    the sums are reduced across processes (one collective). `alone` (the export's report, main process only): this
    process takes every row itself, on the model's own device, sums on the host in fp64 and reduces nothing.
    """
    data = spec.eval_data
    if data is None:
        return None
    model.eval()
    rank, world = (0, 1) if alone else (acc.process_index, acc.num_processes)
    device = next(model.parameters()).device if alone else acc.device
    at = {"device": "cpu", "dtype": torch.float64} if alone else {"device": acc.device, "dtype": torch.float32}
    n = t.eval_batches * t.micro_batch_size  # the same held-out rows however many processes share them
    if hasattr(data, "__len__"):
        n_rows = min(len(data), n)
        take = lambda idx: data[idx]  # noqa: E731
    else:  # streaming eval: the first n rows, strided over processes like the training rows
        head = list(itertools.islice(iter(data), n))
        n_rows = len(head)
        take = lambda idx: {k: [head[i][k] for i in idx] for k in head[0]}  # noqa: E731
    mine = list(range(rank, n_rows, world))
    # Under FSDP / ZeRO-3 each forward gathers parameters from all ranks, so a rank with one row
    # fewer would leave the others waiting.
    n_forwards = math.ceil(math.ceil(n_rows / world) / t.micro_batch_size)
    total, count, sums = torch.zeros((), **at), torch.zeros((), **at), {}
    for i in range(n_forwards):
        idx = mine[i * t.micro_batch_size:(i + 1) * t.micro_batch_size]
        batch = spec.collate(take(idx or [0]), device)
        s, c, metrics = spec.loss(model, batch)
        if idx:  # a rank whose rows ran out still runs the forward, but counts nothing
            total += s.to(**at)
            count += torch.as_tensor(c, device=at["device"]).to(at["dtype"])
        for k, v in metrics.items():  # every rank has the same keys, so the stacked reduce lines up
            sums[k] = sums.get(k, 0) + torch.as_tensor(v, device=at["device"]).to(at["dtype"]) * bool(idx)
    names = list(sums)
    stacked = torch.stack([total, count, *[sums[k] for k in names]])
    reduced = stacked if alone else acc.reduce(stacked, "sum")
    total, count = reduced[0], reduced[1]
    if not count > 0:
        return EvalResult(None, 0.0, {})
    means = with_derived(spec, {k: (v / count).item() for k, v in zip(names, reduced[2:])})
    return EvalResult((total / count).item(), count.item(), means)


def _tracker_config(recipe: Recipe) -> dict:
    return {k: (v if isinstance(v, (int, float, str, bool)) else str(v))
            for k, v in ckpt.flatten(recipe.to_dict()).items()}
