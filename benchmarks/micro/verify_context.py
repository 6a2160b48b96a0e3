"""One target forward of N rows (an AR step, a verified chain or tree) against context length, per attention
kernel: where the decode attention's two kernels (draftforge/decode/attention.py) and transformers' own sdpa
stand on this machine.

Variants: "sdpa" (transformers' attention: keys and values repeated per query head where a mask is given),
"matmul" (the decode attention with DRAFTFORGE_FLASH_ROWS=0: every row count on the float32 matmul path, as
before the probe existed), "probed" (the decode attention as `load_target` sets it up now: the packed flash kernel
up to the probe's row count, the matmul path above). All with packed weights, the growing cache and the lean
forward where they apply. Each variant prefills a random prompt of each context length once (not timed); then
one verification of N rows (a chain of N - 1 drafts, the root kept, so the context grows by one token per call)
is timed `--calls` times per sample, variants and row counts rotated, medians over `--repeats` samples after one
warm-up pass; one torch thread unless --threads. The table gives ms per forward and t(N) / t(1) per variant.
The eval's cost model (`draftforge.eval.cost.verify_curve`) times the same forward, but for one target and
prefilling again as the context grows; here the variants share each prefill's length and alternate, so an 8k
prompt is encoded once per variant rather than once per sample.

    python -m benchmarks.micro.verify_context --target ~/.cache/draftforge/smollm2 --contexts 1024 7600 \
        --rows 1 2 6 34 --repeats 3 --out runs/bench/verify_context.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks.common import checked_args, positive_int, print_table, write_json

VARIANTS = {"sdpa": ("off", None), "matmul": ("on", "0"), "probed": ("on", None)}  # decode_attention, FLASH_ROWS


def load(target: str, dtype, variant: str):
    from draftforge.decode import load_target
    from draftforge.decode.attention import FLASH_ROWS_ENV

    attention, flash_rows = VARIANTS[variant]
    before = os.environ.pop(FLASH_ROWS_ENV, None)
    try:
        if flash_rows is not None:
            os.environ[FLASH_ROWS_ENV] = flash_rows
        return load_target(target, dtype=dtype, decode_attention=attention)
    finally:
        os.environ.pop(FLASH_ROWS_ENV, None)
        if before is not None:
            os.environ[FLASH_ROWS_ENV] = before


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 7600])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 6, 34], help="query rows per forward (N)")
    p.add_argument("--calls", type=int, default=5, help="forwards averaged per sample")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench/verify_context.json")
    args = checked_args(p, argv)
    if min(args.contexts + args.rows) < 1 or min(args.calls, args.repeats, args.threads) < 1:
        p.error("--contexts, --rows, --calls, --repeats and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    from draftforge.eval.selfcheck import chain_tree

    dtype = getattr(torch, args.dtype)
    targets = {}
    for name in args.variants:
        targets[name] = load(args.target, dtype, name)
        print(f"{name}: {targets[name].model.draftforge_attention}", flush=True)
    limit = targets[args.variants[0]].max_context
    grows = (args.repeats + 1) * len(args.rows) * args.calls
    if limit is not None and max(args.contexts) + grows + max(args.rows) > limit:
        p.error(f"context {max(args.contexts)} + {grows} kept roots + {max(args.rows)} rows exceeds the target's "
                f"{limit}")
    vocab = targets[args.variants[0]].vocab_size
    result = {"target": args.target, "dtype": args.dtype, "threads": args.threads, "calls": args.calls,
              "repeats": args.repeats, "attention": {n: t.model.draftforge_attention for n, t in targets.items()},
              "contexts": {}}
    table = []
    for ctx in args.contexts:
        print(f"context {ctx}: prefilling {len(targets)} target(s) ...", flush=True)
        prompt = torch.randint(0, vocab, (ctx,), generator=torch.Generator().manual_seed(args.seed + ctx)).tolist()
        for t in targets.values():
            t.prefill(prompt)
        times = {name: {n: [] for n in args.rows} for name in targets}
        names = list(targets)
        for rep in range(args.repeats + 1):
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                t = targets[name]
                for n in args.rows[rep % len(args.rows):] + args.rows[: rep % len(args.rows)]:
                    draft = chain_tree([prompt[-1]] * (n - 1))
                    took = []
                    for _ in range(args.calls):
                        start = time.perf_counter()
                        t.verify(prompt[-1], draft)
                        took.append(time.perf_counter() - start)
                        t.commit([])
                    if rep:
                        times[name][n].append(statistics.mean(took) * 1e3)
        medians = {name: {n: statistics.median(v) for n, v in per.items()} for name, per in times.items()}
        result["contexts"][str(ctx)] = {"ms": medians, "samples": times}
        for name, per in medians.items():
            table.append([ctx, name] + [f"{per[n]:.2f} ({per[n] / per[args.rows[0]]:.2f})" for n in args.rows])
    print_table(["context", "variant"] + [f"N = {n}: ms (÷ t({args.rows[0]}))" for n in args.rows], table,
                set(range(2, 2 + len(args.rows))))
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
