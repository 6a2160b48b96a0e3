"""Mamba2 drafter single-token step on CPU: transformers' forward vs the lean Mamba2Step, ms per step.

Both paths run through the drafter's own StaticStep (lean=None forces transformers' forward) on states
prefilled from a real prompt. Per (size, batch): warm-up, then `--repeats` repeats of `--steps` calls
per path, the paths in rotating order, median of the per-call means. The lm_head alone (one matmul
over the vocabulary) is timed too: it is the floor that no step below the head can remove. Prints a
Markdown table, writes JSON.

    python -m benchmarks.micro.mamba2_step --threads 1 --json runs/bench/mamba2_step.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from benchmarks.common import add_flags, checked_args
from draftforge.decode.drafters.cuda_graphs import StaticStep
from draftforge.decode.drafters.ssm_state import layer_states
from draftforge.eval.report import atomic_write_text
from draftforge.models.mamba import build_mamba
from draftforge.hfcompat import cache_kwargs

SIZES = {  # name: (preset, overrides, vocab)
    "tiny": ("tiny", {}, 8192),  # the demo's drafter: width 128, 2 layers, state 32, head_dim 32
    "w256": ("small", {"hidden_size": 256, "num_hidden_layers": 4}, 49152),  # state 64, head_dim 64
}


def build(size: str, dtype) -> torch.nn.Module:
    preset, overrides, vocab = SIZES[size]
    torch.manual_seed(0)
    return build_mamba("mamba2", vocab, size=preset, overrides=overrides).to(dtype).eval()


@torch.inference_mode()
def prefilled_states(model, batch: int, prompt_len: int):
    ids_BT = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    model(input_ids=ids_BT, use_cache=True, **cache_kwargs(model, cache))
    return layer_states(cache)


def rotating_medians(fns: dict, calls: int, repeats: int, warmup: int) -> dict[str, float]:
    """Median over repeats of the mean ms per call; repeat r starts with path r mod len(fns)."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    times = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            for _ in range(calls):
                fns[name]()
            times[name].append((time.perf_counter() - t0) / calls * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


@torch.inference_mode()
def time_size(size: str, args, dtype) -> list[dict]:
    model, rows = build(size, dtype), []
    head_VD = model.lm_head.weight.detach()
    for batch in args.batches:
        states = prefilled_states(model, batch, args.prompt_len)
        steps = {name: StaticStep(model, [(c.clone(), s.clone()) for c, s in states], lean="auto" if lean else None)
                 for name, lean in (("transformers", False), ("lean", True))}
        ids_B1 = torch.randint(0, model.config.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(1))
        # same states, same token: the two paths must agree before they are timed
        torch.testing.assert_close(steps["lean"](ids_B1), steps["transformers"](ids_B1), rtol=1e-4, atol=1e-4)
        h_BD = torch.randn(batch, head_VD.shape[1], dtype=dtype)
        fns = {name: (lambda step=step: step(ids_B1)) for name, step in steps.items()}
        fns["head"] = lambda: F.linear(h_BD, head_VD)
        ms = rotating_medians(fns, args.steps, args.repeats, args.warmup)
        rows.append({"size": size, "batch": batch, "transformers_ms": ms["transformers"], "lean_ms": ms["lean"],
                     "head_ms": ms["head"], "speedup": ms["transformers"] / ms["lean"]})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 3, 6, 12])
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--prompt-len", type=int, default=16, help="prefilled tokens before the timed steps")
    p.add_argument("--steps", type=int, default=20, help="calls per timed repeat")
    add_flags(p, repeats=7, warmup=5)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--json", default="runs/bench/mamba2_step.json", help="where to write the results")
    args = checked_args(p)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows = [row for size in args.sizes for row in time_size(size, args, dtype)]
    print(f"\nMamba2 single-token step, CPU, {args.dtype}, {torch.get_num_threads()} thread(s), "
          f"median of {args.repeats} x {args.steps} calls, paths in rotating order\n")
    print("| size | batch | transformers ms | lean ms | speedup | lm_head alone ms |\n|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['size']} | {r['batch']} | {r['transformers_ms']:.3f} | {r['lean_ms']:.3f} | "
              f"{r['speedup']:.2f}x | {r['head_ms']:.3f} |")
    sizes = {name: dict(zip(("preset", "overrides", "vocab"), SIZES[name])) for name in args.sizes}
    result = {"args": vars(args), "threads": torch.get_num_threads(), "torch": torch.__version__, "sizes": sizes,
              "rows": rows}
    atomic_write_text(Path(args.json), json.dumps(result, indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
