"""`draftforge generate` in bf16 vs fp32: tokens/s side by side, and how often the greedy answers agree.

    python -m benchmarks.decoding.generate_precision --target ~/.cache/draftforge/smollm2 --num-prompts 32 \
        --batch-size 16 --max-new-tokens 96 --repeats 2

Both dtypes answer the same training-split instruction prompts greedily with the same batches (the code
`draftforge generate` runs: data.generate.generate_rows), 1 torch thread unless --threads; the dtypes
alternate, first one first in odd repeats, after one untimed batch each; tokens/s = new tokens / seconds, median
over repeats. Agreement:
the share of answers identical to fp32's and the mean length of the common prefix as a share of fp32's
answer (a bf16 answer parts from fp32's at its first near-tie and then is a different, equally valid answer).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import add_flags, parse_timed, print_table, write_json


def answers(path: Path) -> dict[str, list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["prompt_id"]: r["input_ids"][r["prompt_len"]:] for r in rows}


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv=None) -> dict:
    from transformers import AutoTokenizer

    from draftforge.data.generate import chat_jobs, generate_rows
    from draftforge.data.instructions import write_instruction_prompts
    from draftforge.loading import load_causal_lm

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    add_flags(p, num_prompts=32, batch_size=16, max_new_tokens=96, repeats=2)
    p.add_argument("--out", default="runs/bench/generate_precision.json")
    args = parse_timed(p, argv)
    tok = AutoTokenizer.from_pretrained(args.target)
    models = {d: load_causal_lm(args.target, what="target", dtype=getattr(torch, d)).eval()
              for d in ("float32", "bfloat16")}
    secs, toks, outs = {d: [] for d in models}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        prompts = write_instruction_prompts(Path(tmp) / "prompts.jsonl", split="train", n=args.num_prompts)
        jobs = chat_jobs(str(prompts), tok, 8192, args.max_new_tokens, args.num_prompts)
        for d in models:  # untimed: each dtype's first batch pays its one-off kernel set-up here, not in repeat 1
            generate_rows(models[d], tok, jobs[: args.batch_size], Path(tmp) / f"warm-up-{d}.jsonl",
                          temperatures=(0.0,), max_new_tokens=8, batch_size=args.batch_size, target=args.target)
        for rep in range(args.repeats):
            for d in (list(models) if rep % 2 == 0 else list(models)[::-1]):
                out = Path(tmp) / f"{d}-{rep}.jsonl"
                t0 = time.perf_counter()
                stats = generate_rows(models[d], tok, jobs, out, temperatures=(0.0,), max_new_tokens=args.max_new_tokens,
                                      batch_size=args.batch_size, target=args.target)
                secs[d].append(time.perf_counter() - t0)
                toks[d], outs[d] = stats.new_tokens, answers(out)
                print(f"repeat {rep + 1}/{args.repeats} {d}: {stats.new_tokens / secs[d][-1]:.1f} tok/s", flush=True)
    tps = {d: toks[d] / statistics.median(secs[d]) for d in models}
    ref, low = outs["float32"], outs["bfloat16"]
    same = sum(ref[k] == low.get(k) for k in ref) / len(ref)
    prefix = statistics.fmean(common_prefix(ref[k], low.get(k, [])) / max(len(ref[k]), 1) for k in ref)
    result = {"config": vars(args), "threads": torch.get_num_threads(), "tokens_per_s": tps,
              "bf16_over_fp32": tps["bfloat16"] / tps["float32"], "identical_answers": same,
              "mean_common_prefix_share": prefix}
    print_table(["dtype", "tokens/s", "vs fp32", "answers identical to fp32", "common prefix (share)"],
                [[d, f"{tps[d]:.1f}", f"{tps[d] / tps['float32']:.2f}×", "–" if d == "float32" else f"{same:.0%}",
                  "–" if d == "float32" else f"{prefix:.0%}"] for d in models])
    return write_json(args.out, result)


if __name__ == "__main__":
    main()
