"""Draft-length control (EESD Table 4's question): fixed K vs Beta-TS vs Cali-TS vs SpecDec++, greedy.

    OMP_NUM_THREADS=1 python -m benchmarks.decoding.length_control --target T --drafter D \
        --prompts heldout.jsonl --theta-predictor THETA_EXPORT --num-prompts 10 --max-new-tokens 128

Every method runs in one process on the same prompts; per repeat the method order rotates, each method is
reset and warmed up (one untimed prompt) before its timed pass; tables give medians over repeats. Every
output is checked token for token against AR's (lossless greedy). Columns: τ (tokens per target forward),
v_d, r_d, HM (EESD App. D), mean draft length per round, tok/s, speedup vs AR (median of per-repeat ratios).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import add_dtype_flag, add_flags, load_models, parse_timed, versus_ar, versus_ar_cell

def load_prompts(bench: str, target, n: int, max_prompt_tokens: int, max_new_tokens: int) -> list[list[int]]:
    """The harness's own prompt reader (named benches, chat templates, token rows), each cut to its last
    max_prompt_tokens tokens (0 = whole)."""
    from draftforge.data.prompts import load_prompts as read

    prompts = read(bench, target.tokenizer, num_prompts=n, chat="auto", context_length=target.max_context,
                   max_new_tokens=max_new_tokens)
    return [p.input_ids[-max_prompt_tokens:] if max_prompt_tokens else p.input_ids for p in prompts]


def methods(args) -> dict[str, tuple[str, dict]]:
    table = {"ar": ("ar", {})}
    for k in args.fixed_k:
        table[f"K={k}"] = ("chain", {"chain_length": k})
    table["beta_ts"] = ("beta_ts", {"max_draft": args.max_draft})
    if args.theta_predictor:
        table["cali_ts"] = ("cali_ts", {"max_draft": args.max_draft, "theta_predictor": args.theta_predictor,
                                        "sigma_m": args.sigma_m, "sigma_s": args.sigma_s})
    table["cali_ts w/o model"] = ("cali_ts", {"max_draft": args.max_draft, "sigma_m": args.sigma_m,
                                              "sigma_s": args.sigma_s, "theta0": args.theta0})
    table["specdec_pp"] = ("specdec_pp", {"max_draft": args.max_draft, "specpp_threshold": args.specpp_threshold})
    return table


def one_pass(dec, prompts, max_new: int, eos) -> dict:
    dec.reset()
    dec.generate(prompts[0], max_new_tokens=min(max_new, 16), eos_token_id=eos)  # untimed warm-up
    totals = {"tokens": 0, "forwards": 0, "drafted": 0, "accepted": 0, "drafting_rounds": 0, "time_s": 0.0,
              "outputs": [], "stats": []}
    for prompt in prompts:
        t0 = time.perf_counter()
        res = dec.generate(prompt, max_new_tokens=max_new, eos_token_id=eos)
        totals["time_s"] += time.perf_counter() - t0
        s = res.stats
        totals["tokens"] += s.new_tokens
        totals["forwards"] += s.target_forwards
        totals["drafted"] += sum(s.drafted_per_round)
        totals["accepted"] += sum(s.accepted_per_round)
        totals["drafting_rounds"] += sum(1 for d in s.drafted_per_round if d)
        totals["outputs"].append(res.tokens)
        totals["stats"].append(s)
    return totals


def summarize(passes: list[dict], ar_passes: list[dict]) -> dict:
    def med(f):
        return statistics.median(f(p) for p in passes)

    p0 = passes[0]  # greedy: counts are identical across repeats
    v_d = p0["accepted"] / p0["drafted"] if p0["drafted"] else None
    r_d = p0["accepted"] / p0["tokens"] if p0["drafted"] else None
    hm = None if v_d is None else 2 * v_d * r_d / (v_d + r_d) if v_d + r_d else 0.0
    speedups = [(p["tokens"] / p["time_s"]) / (a["tokens"] / a["time_s"]) for p, a in zip(passes, ar_passes)]
    return {"tau": p0["tokens"] / p0["forwards"], "v_d": v_d, "r_d": r_d, "hm": hm,
            "draft_len": p0["drafted"] / p0["drafting_rounds"] if p0["drafting_rounds"] else None,
            "tok_s": med(lambda p: p["tokens"] / p["time_s"]), "speedup": statistics.median(speedups),
            "speedup_min": min(speedups), "speedup_max": max(speedups)}


def fmt(x, digits=2):
    return "–" if x is None else f"{x:.{digits}f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--prompts", required=True, help="a named bench (instructions, humaneval, testbed) or a JSONL "
                   "prompt file (messages, prompt, text, turns or input_ids), read as draftforge eval reads it")
    p.add_argument("--theta-predictor", help="θ predictor export for cali_ts (else only the w/o-model variant)")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-prompt-tokens", type=int, default=0, help="keep only the last N prompt tokens (0 = all)")
    add_flags(p, max_new_tokens=128, repeats=3, fixed_k=[3, 5, 10], max_draft=16, sigma_m=0.2, sigma_s=0.3,
              theta0=0.5, specpp_threshold=0.3)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
    p.add_argument("--out", help="write the results as JSON here")
    add_dtype_flag(p)
    args = parse_timed(p, argv)

    import torch

    from draftforge.decode import build_decoder

    target, drafter = load_models(args)
    prompts = load_prompts(args.prompts, target, args.num_prompts, args.max_prompt_tokens, args.max_new_tokens)
    eos = [] if args.ignore_eos else None
    table = methods(args)
    decoders = {name: build_decoder(m, target, drafter, **o) for name, (m, o) in table.items()}
    names, passes = list(decoders), {name: [] for name in decoders}
    for r in range(args.repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            passes[name].append(one_pass(decoders[name], prompts, args.max_new_tokens, eos))
            print(f"repeat {r + 1}/{args.repeats} {name}: {passes[name][-1]['time_s']:.1f} s", file=sys.stderr)
    ar_out = passes["ar"][0]["outputs"]
    rows, result = [], {"threads": torch.get_num_threads(), "args": vars(args), "methods": {}}
    for name in names:
        lossless = all(p["outputs"] == ar_out for p in passes[name])  # bitwise, every repeat
        check = None if name == "ar" or lossless else versus_ar(target, prompts, ar_out, passes[name][-1]["outputs"],
                                                                           passes[name][-1]["stats"])
        s = {**summarize(passes[name], passes["ar"]), "lossless": lossless, "versus_ar": check}
        result["methods"][name] = s
        rows.append(f"| {name} | {fmt(s['tau'])} | {fmt(s['v_d'])} | {fmt(s['r_d'])} | "
                    f"{fmt(100 * s['hm'] if s['hm'] is not None else None, 1)} | {fmt(s['draft_len'])} | "
                    f"{fmt(s['tok_s'], 1)} | "
                    f"{fmt(s['speedup'])}× [{fmt(s['speedup_min'])}–{fmt(s['speedup_max'])}] | "
                    f"{'yes' if lossless else versus_ar_cell(check)} |")
    print("| method | τ | v_d | r_d | HM % | draft len | tok/s | speedup vs AR [min–max] | = AR |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\n{len(prompts)} prompts · max_new_tokens {args.max_new_tokens} · {args.repeats} repeats, rotated order, "
          f"medians · torch threads {torch.get_num_threads()} · greedy")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0 if all(m["lossless"] or m["versus_ar"]["ok"] for m in result["methods"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
