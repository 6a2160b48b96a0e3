"""EESD vs plain decoding on a real target, side by side in one process (EESD Table 4-style ablation).

Every decoder (AR; each EESD export at each fixed K) runs over the same held-out prompts, greedy, in a
rotating order per repeat; tokens/s is the median over repeats of all new tokens / all generate() time.
Also τ (tokens per target forward), v_d, r_d and HM (EESD App. D), and the eval's T=0 self-check against AR
(identical, near-tie in bf16, or defect: benchmarks.common.versus_ar; exit 1 on a defect).

    python -m benchmarks.decoding.eesd_bench --target DIR --export layer=runs/n2/export --export head=runs/head/export \
        --k 3 --k 5 --bench instructions --num-prompts 6 --max-new-tokens 96 --repeats 3 --out r.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from benchmarks.common import add_dtype_flag, add_flags, chosen_dtype, parse_timed, versus_ar, versus_ar_cell


def run_all(decoders: dict, prompts, max_new: int, repeats: int) -> dict:
    """{name: {"times": [...], "tokens": [...], "stats": [...] (last repeat), "outputs": [...]}}."""
    names = list(decoders)
    out = {n: {"times": [], "tokens": [], "stats": [], "outputs": []} for n in names}
    for name in names:  # warm-up, untimed
        decoders[name].generate(prompts[0], max_new_tokens=8)
    for rep in range(repeats):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for name in order:
            t0, n_tok, stats, outputs = time.perf_counter(), 0, [], []
            for ids in prompts:
                res = decoders[name].generate(ids, max_new_tokens=max_new)
                n_tok += len(res.tokens)
                stats.append(res.stats)
                outputs.append(res.tokens)
            out[name]["times"].append(time.perf_counter() - t0)
            out[name]["tokens"].append(n_tok)
            out[name]["stats"], out[name]["outputs"] = stats, outputs
    return out


def summarize(raw: dict) -> dict:
    """Per decoder: tokens/s (median over repeats), speedup = the ratio of that median to AR's, and its spread:
    [min, max] of the per-repeat ratios (each repeat's rate over AR's in the same repeat), as `draftforge eval`."""
    ar_reps = [t / s for t, s in zip(raw["ar"]["tokens"], raw["ar"]["times"])]
    ar_rate = statistics.median(ar_reps)
    rows = {}
    for name, r in raw.items():
        reps = [t / s if s else 0.0 for t, s in zip(r["tokens"], r["times"])]
        rate = statistics.median(reps)
        ratios = [a / b for a, b in zip(reps, ar_reps) if b]
        st = r["stats"]
        new = sum(s.new_tokens for s in st)
        forwards = sum(s.target_forwards for s in st)
        accepted = sum(sum(s.accepted_per_round) for s in st)
        drafted = sum(sum(s.drafted_per_round) for s in st)
        v_d = accepted / drafted if drafted else 0.0
        r_d = accepted / new if new else 0.0
        hm = 2 * v_d * r_d / (v_d + r_d) * 100 if v_d + r_d else 0.0
        draft_s = sum(s.draft_time_s for s in st)
        verify_s = sum(s.verify_time_s for s in st)
        rows[name] = {"tokens_per_s": rate, "speedup": rate / ar_rate if ar_rate else 0.0,
                      "speedup_spread": [min(ratios), max(ratios)] if ratios else None,
                      "tau": new / forwards if forwards else 0.0, "v_d": v_d,
                      "r_d": r_d, "hm": hm, "draft_share": draft_s / (draft_s + verify_s) if draft_s else 0.0,
                      "lossless": r["outputs"] == raw["ar"]["outputs"],
                      "tokens_per_s_repeats": reps}
    return rows


def main(argv=None) -> int:
    from draftforge.decode import build_decoder, load_drafter, load_target
    from draftforge.data.prompts import load_prompts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--export", action="append", default=[], help="NAME=DIR of an EESD export (repeat)")
    p.add_argument("--k", type=int, action="append", default=[], help="fixed chain length K (repeat)")
    add_flags(p, bench="instructions", num_prompts=6, max_new_tokens=96, repeats=3)
    p.add_argument("--out", default=None)
    add_dtype_flag(p)
    args = parse_timed(p, argv)

    target = load_target(args.target, dtype=chosen_dtype(args))
    prompts = [pr.input_ids for pr in load_prompts(args.bench, target.tokenizer, num_prompts=args.num_prompts,
                                                    chat="auto", context_length=target.max_context,
                                                    max_new_tokens=args.max_new_tokens)]
    decoders = {"ar": build_decoder("ar", target)}
    for spec in args.export:
        name, _, path = spec.partition("=")
        drafter = load_drafter(path, target)
        for k in args.k or [5]:
            decoders[f"{name} K={k}"] = build_decoder("eesd", target, drafter, chain_length=k)
    print(f"[eesd-bench] {len(prompts)} prompts x {args.max_new_tokens} tokens x {args.repeats} repeats, "
          f"{torch.get_num_threads()} thread(s), decoders: {', '.join(decoders)}", flush=True)
    raw = run_all(decoders, prompts, args.max_new_tokens, args.repeats)
    rows = summarize(raw)
    for name, r in raw.items():
        rows[name]["versus_ar"] = (None if name == "ar" else
                                   versus_ar(target, prompts, raw["ar"]["outputs"], r["outputs"], r["stats"]))
    print("| decoder | τ | v_d | r_d | HM % | tok/s | speedup [min–max] | draft share | = AR |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        same = versus_ar_cell(r["versus_ar"]) if r["versus_ar"] else "–"
        spread = " [{:.2f}–{:.2f}]".format(*r["speedup_spread"]) if r["speedup_spread"] else ""
        print(f"| {name} | {r['tau']:.2f} | {r['v_d']:.2f} | {r['r_d']:.2f} | {r['hm']:.1f} | "
              f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f}x{spread} | {r['draft_share']:.2f} | {same} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)
    return 0 if all(r["versus_ar"] is None or r["versus_ar"]["ok"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
