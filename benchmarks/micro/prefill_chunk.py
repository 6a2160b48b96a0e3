"""Chunked prefill against one forward (#34 item 4): the prefill's time and peak memory per context length, and
whether the decode that follows is the same.

For each context length a random prompt of that many tokens is encoded by the KV-cache target in one forward and
in forwards of each `--chunks` size (`load_target(prefill_chunk=...)`); variants rotated within each repeat after
one untimed prefill each, medians over repeats, one torch thread unless --threads. Peak memory is the process's
resident high-water mark above the prefill's start (reset before each prefill, Linux, with the variant's cache from
the last repeat already freed), so neither the target's weights nor an old cache are in it. After each
prefill `--steps` tokens are decoded greedily (AR through the harness, not timed); the table says whether they
equal the one-forward prefill's tokens and how far the first verification's logits are from its logits.

    python -m benchmarks.micro.prefill_chunk --target ~/.cache/draftforge/smollm2 --contexts 2048 8150 \
        --chunks 512 2048 --repeats 2 --out runs/bench/prefill_chunk.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import checked_args, positive_int, print_table, write_json


def run(args) -> dict:
    from draftforge.decode import build_decoder, load_target
    from draftforge.eval.metrics import _read_status_kib, reset_rss_high_water_mark, trim_heap
    from draftforge.eval.selfcheck import chain_tree

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    variants = [None, *args.chunks]
    targets = {c: load_target(args.target, dtype=dtype, prefill_chunk=c) for c in variants[:1]}
    base = targets[None]
    for c in variants[1:]:  # the same model object: only the prefill differs
        targets[c] = type(base)(base.model, base.tokenizer, prefill_chunk=c)
    rows, out = [], {"target": args.target, "dtype": args.dtype, "threads": args.threads, "runs": {}}
    warm = torch.randint(100, base.vocab_size - 100, (min(args.contexts),), generator=torch.Generator()).tolist()
    for c in variants:  # untimed: the first forwards of a process pay one-off set-up (kernels, allocator)
        targets[c].prefill(warm)
    for length in args.contexts:
        g = torch.Generator().manual_seed(length)
        prompt = torch.randint(100, base.vocab_size - 100, (length,), generator=g).tolist()
        times = {c: [] for c in variants}
        peaks = {c: [] for c in variants}
        first_logits, tokens = {}, {}
        for rep in range(args.repeats):
            order = variants[rep % len(variants):] + variants[: rep % len(variants)]
            for c in order:
                target = targets[c]
                target.lm.reset()  # its cache from the last repeat freed before the start is read, not inside
                trim_heap()
                reset_rss_high_water_mark()
                start = _read_status_kib("VmRSS")
                t0 = time.perf_counter()
                target.prefill(prompt)
                times[c].append(time.perf_counter() - t0)
                high = _read_status_kib("VmHWM")
                peaks[c].append(None if start is None or high is None else high - start)
                if rep == 0:
                    first_logits[c] = target.verify(prompt[-1], chain_tree([])).clone()
                    target.commit([])
                    dec = build_decoder("ar", target)
                    tokens[c] = dec.generate(prompt, max_new_tokens=args.steps).tokens
        ref = first_logits[None]
        for c in variants:
            same = sum(a == b for a, b in zip(tokens[c], tokens[None]))
            row = {"context": length, "chunk": c or "one forward", "prefill_s": statistics.median(times[c]),
                   "tokens_per_s": length / statistics.median(times[c]),
                   "peak_mib": (statistics.median(p for p in peaks[c] if p is not None) / 2**20
                                if any(p is not None for p in peaks[c]) else None),
                   "max_logit_diff": float((first_logits[c] - ref).abs().max()),
                   "argmax_same": bool(first_logits[c].argmax() == ref.argmax()),
                   "tokens_equal": f"{same}/{len(tokens[None])}"}
            rows.append(row)
        out["runs"][str(length)] = [r for r in rows if r["context"] == length]
    print_table(["context", "chunk", "prefill s", "tokens/s", "peak MiB above start", "max |logit diff|",
                 "same argmax", "greedy tokens = one forward's"],
                [[r["context"], r["chunk"], f"{r['prefill_s']:.2f}", f"{r['tokens_per_s']:.0f}",
                  "–" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}", f"{r['max_logit_diff']:.3g}",
                  r["argmax_same"], r["tokens_equal"]] for r in rows], right={2, 3, 4, 5})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--target", required=True, help="a KV-cache Transformer target (HF directory)")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8150],
                   help="prompt lengths in tokens (each plus --steps must fit the target's context)")
    p.add_argument("--chunks", type=int, nargs="+", default=[512, 2048], help="prefill chunk sizes to compare")
    p.add_argument("--steps", type=int, default=16, help="greedy tokens decoded after each prefill (compared)")
    p.add_argument("--repeats", type=positive_int, default=2, help="timed prefills per variant (median)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--out", help="JSON file to write")
    args = checked_args(p, argv)
    out = run(args)
    if args.out:
        write_json(args.out, out)


if __name__ == "__main__":
    main()
