"""What one sampled token costs the decoder at T > 0: `torch.multinomial` (one sample) against draftforge's
inverse-CDF draw (`decode/sampling.py: draw_one`, a float64 CDF and one uniform), per vocabulary size.

The decoder draws once per drafted token of a chain at T > 0, and once per correction, bonus token and AR token
(`decode/verify.py: _draw`); both ways draw from the same distribution. Probabilities are a softmax of random
logits (the cost does not depend on them). Each repeat times both ways, in alternating order, `--calls` draws each;
medians over repeats after one warm-up repeat.

    python -m benchmarks.micro.draw --vocab 8192 49152 --threads 1 --repeats 7 --out runs/bench/draw.json
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.common import add_flags, checked_args, print_table, time_ms, write_json


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(parser, vocab=[8192, 49152], threads=1, repeats=7, calls=200, seed=0)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = checked_args(parser, argv)
    from draftforge.decode.sampling import draw_one

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    ways = {"torch.multinomial": lambda p: torch.multinomial(p, 1, generator=gen),
            "draw_one (inverse CDF)": lambda p: draw_one(p, gen)}
    rows, result = [], {"threads": args.threads, "repeats": args.repeats, "calls": args.calls, "vocab": {}}
    for vocab in args.vocab:
        probs_1V = (torch.randn(1, vocab, generator=torch.Generator().manual_seed(args.seed)) * 3).softmax(-1)
        times = {name: [] for name in ways}
        for rep in range(args.repeats + 1):  # repeat 0 is the warm-up
            order = list(ways) if rep % 2 == 0 else list(reversed(ways))
            for name in order:
                ms = time_ms(lambda: ways[name](probs_1V), "cpu", 1, calls=args.calls)[0]
                if rep:
                    times[name].append(ms)
        med = {name: statistics.median(v) for name, v in times.items()}
        result["vocab"][vocab] = {"median_ms": med, "ms_by_repeat": times}
        first, second = med.values()
        rows.append([f"{vocab:,}", f"{first:.3f}", f"{second:.3f}", f"{first / second:.1f}×"])
    print(f"one draw from a [1, V] distribution, ms, median of {args.repeats} repeats of {args.calls} calls, "
          f"{args.threads} thread(s)")
    print_table(["V", *ways, "ratio"], rows, right={1, 2, 3})
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
