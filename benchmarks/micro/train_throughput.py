"""Tokens/s of draftforge's training loop vs a plain `transformers.Trainer`, or bf16 vs fp32, side by side.

Same model config and init, same packed blocks, same micro-batch / accumulation / steps, same
optimizer and schedule. Each run is its own subprocess (so peak RSS is per run); the two are
interleaved within every repeat, and tokens/s counts optimizer steps after the first (warm-up).

    python -m benchmarks.micro.train_throughput --steps 20 --repeats 3 --arch mamba2
    python -m benchmarks.micro.train_throughput --compare precision --steps 200 --repeats 1 --arch llama

`--compare precision` runs draftforge's loop with train.precision fp32 and bf16 (autocast; on a CPU with
AVX512-BF16 or AMX the matrix products run in hardware) and reports the tokens/s ratio and how far the bf16
loss curve is from the fp32 one (final loss, and the largest gap of a 10-step moving average).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, add_flags, checked_args, print_table, write_json


def make_inputs(work: Path, files: int) -> tuple[Path, Path]:
    """A tokenizer and a corpus JSONL from the stdlib (the testbed's own helpers)."""
    from draftforge.testbed import train_tokenizer, write_corpus_jsonl

    tok_dir = work / "tokenizer"
    train_tokenizer(tok_dir, vocab_size=2048, max_files=files)
    corpus = write_corpus_jsonl(work / "corpus.jsonl", "train", max_files=files)
    return tok_dir, corpus


def recipe_values(args, tok_dir: Path, corpus: Path, out: Path) -> dict:
    size = {"mamba2": "tiny", "llama": "tiny-drafter"}[args.arch]
    return {"task": "pretrain", "output_dir": str(out),
            "model": {"arch": args.arch, "size": size, "tokenizer": str(tok_dir)},
            "data": {"sources": [str(corpus)], "eval_fraction": 0.0},
            "optim": {"lr": 1e-3, "warmup_steps": 2, "weight_decay": 0.1, "grad_clip": 1.0},
            "train": {"max_steps": args.steps, "global_batch_size": args.batch * args.accum,
                      "micro_batch_size": args.batch, "block_size": args.block, "eval_every": 0, "save_every": 0,
                      "log_every": 1000, "trackers": [], "export": False}}


def run_draftforge(values: dict) -> dict:
    from draftforge.recipe import recipe_from_dict
    from draftforge.train import run

    result = run(recipe_from_dict(values), overwrite=True)
    return {"tokens_per_s": result.tokens_per_s, "final_loss": result.final_loss, "losses": result.losses}


def run_trainer(values: dict) -> dict:
    import torch
    from transformers import AutoTokenizer, Trainer, TrainerCallback, TrainingArguments, default_data_collator

    from draftforge.data import build_block_data
    from draftforge.recipe import recipe_from_dict
    from draftforge.train.lm import build_model

    recipe = recipe_from_dict(values)
    t = recipe.train
    tok = AutoTokenizer.from_pretrained(recipe.model.tokenizer)
    data = build_block_data(recipe.data, tok, t.block_size, t.seed).train.with_format("torch")
    torch.manual_seed(t.seed)
    model = build_model(recipe, tok)

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], 0.0

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.t0)

    timer = Timer()
    targs = TrainingArguments(
        output_dir=recipe.output_dir, max_steps=t.max_steps, per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.global_batch_size // t.micro_batch_size, learning_rate=recipe.optim.lr,
        weight_decay=recipe.optim.weight_decay, adam_beta1=recipe.optim.betas[0], adam_beta2=recipe.optim.betas[1],
        warmup_steps=recipe.optim.warmup_steps, lr_scheduler_type="cosine", max_grad_norm=recipe.optim.grad_clip,
        save_strategy="no", eval_strategy="no", report_to=[], logging_steps=10_000, dataloader_num_workers=0,
        seed=t.seed, disable_tqdm=True, use_cpu=True)
    trainer = Trainer(model=model, args=targs, train_dataset=data, data_collator=default_data_collator,
                      callbacks=[timer])
    out = trainer.train()
    timed = timer.times[1:] or timer.times
    return {"tokens_per_s": len(timed) * t.global_batch_size * t.block_size / sum(timed),
            "final_loss": out.training_loss}


def worker(kind: str, values_path: str) -> None:
    values = json.loads(Path(values_path).read_text())
    result = (run_trainer if kind == "trainer" else run_draftforge)(values)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result), flush=True)


PRECISION_KINDS = {"fp32": "fp32", "bf16": "bf16"}  # --compare precision: run name -> train.precision


def spawn(kind: str, values: dict, work: Path) -> dict:
    if kind in PRECISION_KINDS:
        values = {**values, "train": {**values["train"], "precision": PRECISION_KINDS[kind]}}
    vpath = work / f"{kind}.json"
    vpath.write_text(json.dumps(values))
    worker = [sys.executable, "-m", "benchmarks.micro.train_throughput", "--worker", kind, str(vpath)]
    proc = subprocess.run(worker, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{kind} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][7:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=["mamba2", "llama"], default="mamba2")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="micro-batch")
    add_flags(p, accum=2, block=256, repeats=3)
    p.add_argument("--files", type=int, default=60, help="stdlib files in the corpus")
    p.add_argument("--compare", choices=["trainer", "precision"], default="trainer",
                   help="trainer: draftforge vs transformers.Trainer (fp32); precision: draftforge fp32 vs bf16")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every run (default 1)")
    p.add_argument("--out", default="runs/bench/train_throughput.json")
    p.add_argument("--worker", nargs=2, metavar=("KIND", "VALUES"), help=argparse.SUPPRESS)
    args = checked_args(p)
    if args.worker:
        return worker(*args.worker)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok_dir, corpus = make_inputs(work, args.files)
        from transformers import AutoTokenizer

        from draftforge.data import build_block_data
        from draftforge.recipe import recipe_from_dict

        values = recipe_values(args, tok_dir, corpus, work / "run")
        stats = build_block_data(recipe_from_dict(values).data, AutoTokenizer.from_pretrained(tok_dir),
                                 args.block, 0).stats
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the workers' torch thread count
        runs = {"draftforge": [], "trainer": []} if args.compare == "trainer" else {k: [] for k in PRECISION_KINDS}
        kinds = list(runs)
        for r in range(args.repeats):
            # interleaved so drift on a shared machine hits both alike, and rotated so neither always runs first
            for kind in kinds[r % len(kinds):] + kinds[: r % len(kinds)]:
                runs[kind].append(spawn(kind, values, work))
                print(f"repeat {r + 1}/{args.repeats} {kind}: {runs[kind][-1]['tokens_per_s']:,.0f} tokens/s",
                      flush=True)
    med = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in runs.items()}
    first, second = list(runs)
    table = {"config": vars(args) | {"worker": None}, "padding_fraction": stats.get("padding_fraction"),
             "runs": runs, "median_tokens_per_s": med, f"ratio_{first}_over_{second}": med[first] / med[second]}
    if args.compare == "precision":
        table.update(curve_gap(runs["fp32"][-1]["losses"], runs["bf16"][-1]["losses"]))
    print(f"\n{args.arch}, {args.steps} steps x {args.batch}x{args.accum} x {args.block} tokens, "
          f"padding {stats.get('padding_fraction', 0):.2%}, median of {args.repeats}")
    cells = []
    for k, v in runs.items():
        tps = [x["tokens_per_s"] for x in v]
        cells.append([k, f"{med[k]:,.0f}", f"{min(tps):,.0f}-{max(tps):,.0f}",
                      f"{statistics.median(x['peak_rss_mib'] for x in v):,.0f}", f"{v[-1]['final_loss']:.4f}"])
    print_table(["loop", "tokens/s (median)", "min-max", "peak RSS MiB", "final loss"], cells)
    if args.compare == "trainer":
        print(f"\ndraftforge / Trainer = {table['ratio_draftforge_over_trainer']:.3f}x")
    else:
        print(f"\nbf16 / fp32 tokens/s = {med['bf16'] / med['fp32']:.3f}x; final loss bf16 vs fp32 "
              f"{table['final_loss_rel_diff']:+.2%}; largest gap of the 10-step moving averages "
              f"{table['max_smoothed_rel_gap']:.2%}")
    write_json(args.out, table)


def curve_gap(fp32: list[float], bf16: list[float], window: int = 10) -> dict:
    """How far the bf16 loss curve runs from the fp32 one: final loss and 10-step moving averages, relative."""
    def smooth(xs):
        return [statistics.fmean(xs[max(0, i - window + 1): i + 1]) for i in range(len(xs))]

    a, b = smooth(fp32), smooth(bf16)
    return {"final_loss_rel_diff": (bf16[-1] - fp32[-1]) / fp32[-1],
            "final_smoothed_rel_diff": (b[-1] - a[-1]) / a[-1],
            "max_smoothed_rel_gap": max(abs(y - x) / x for x, y in zip(a, b))}


if __name__ == "__main__":
    main()
