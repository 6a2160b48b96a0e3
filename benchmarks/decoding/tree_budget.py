"""τ–γ sweep of tree budgets in one run: EAGLE-2's N and C2T's β (C2T §5, Fig. 4; docs/methods/c2t.md §1).

Every point is one decoder (eagle2 at N = --total-tokens, c2t at β, per classifier head) run over the
same prompts, greedy, next to plain decoding (AR) in the same process; methods run in a rotating
order per repeat and tok/s is the median over repeats. τ: accepted drafts per verification
(bonus excluded); γ: tokens sent to the target over the whole benchmark, the root of every round
included (draft-only counts are in the JSON too). Every output is checked token for token against AR.

  python -m benchmarks.decoding.tree_budget --target T --drafter D --bench B --c2t HEAD \
      [--c2t-head name=PATH ...] --ns 10,20,40,60 --betas 0.3,0.5,0.7 --out DIR

Writes DIR/tree_budget.json and DIR/tree_budget.png (left: τ vs γ; right: speedup vs τ).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import (add_dtype_flag, add_flags, load_models, number_list, parse_timed, print_table,
                               versus_ar, versus_ar_cell, write_json)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--bench", required=True, help="held-out prompts (file or testbed/humaneval/instructions)")
    p.add_argument("--c2t", help="the main C2T head (swept over --betas)")
    p.add_argument("--c2t-head", action="append", default=[], metavar="NAME=PATH", type=named_path,
                   help="more heads (e.g. the feature ablation), swept over --ablation-betas")
    p.add_argument("--ns", type=number_list(int, 1), default="10,20,40,60,100", help="EAGLE-2 total_tokens values")
    p.add_argument("--chains", type=number_list(int, 1, empty_ok=True), default="",
                   help="fixed chain lengths to compare with C2T's chain mode (Table 3)")
    p.add_argument("--chain-betas", type=number_list(float, 0, empty_ok=True), default="",
                   help="β values of C2T's chain mode (K = 1) with the --c2t head")
    p.add_argument("--betas", type=number_list(float, 0), default="0.3,0.4,0.5,0.6,0.7,0.8",
                   help="β values swept with the --c2t head")
    p.add_argument("--ablation-betas", type=number_list(float, 0), default="0.5",
                   help="β values swept with each --c2t-head")
    add_flags(p, eagle_top_k=10, eagle_depth=5,
              c2t_top_k=15, c2t_depth=10, num_prompts=10, max_new_tokens=64, repeats=3, chat_template="auto",
              out="tree_budget_out")
    add_dtype_flag(p)
    args = parse_timed(p, argv)
    if args.chain_betas and not args.c2t:
        p.error("--chain-betas runs C2T's chain mode with the --c2t head; give --c2t")
    names = ["c2t"] * bool(args.c2t) + [name for name, _ in args.c2t_head]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # their points would share names and one head's would replace the other's
        p.error(f"head name {twice[0]!r} is used twice (the --c2t head is named 'c2t'); give each --c2t-head its own")
    return args


def named_path(text: str) -> tuple[str, str]:
    """--c2t-head NAME=PATH -> (NAME, PATH)."""
    name, eq, path = text.partition("=")
    if not (name and eq and path):
        raise argparse.ArgumentTypeError(f"expects NAME=PATH, got {text!r}")
    return name, path


def build_points(args, target, drafter) -> dict:
    """name -> (decoder, description) for AR, every EAGLE-2 N and every C2T (head, β)."""
    from draftforge.decode import build_decoder

    points = {"ar": (build_decoder("ar", target), {"method": "ar"})}
    for n in args.ns:
        points[f"eagle2 N={n}"] = (build_decoder("eagle2", target, drafter, eagle_top_k=args.eagle_top_k,
                                                 eagle_depth=args.eagle_depth, total_tokens=n),
                                   {"method": "eagle2", "N": n})
    heads = ([("c2t", args.c2t, args.betas)] if args.c2t else []) + [
        (name, path, args.ablation_betas) for name, path in args.c2t_head]
    for name, path, betas in heads:
        for beta in betas:
            points[f"{name} β={beta:g}"] = (build_decoder("c2t", target, drafter, c2t=path, beta=beta,
                                                          c2t_top_k=args.c2t_top_k, c2t_depth=args.c2t_depth),
                                            {"method": "c2t", "head": name, "path": path, "beta": beta})
    for n in args.chains:
        points[f"chain K={n}"] = (build_decoder("chain", target, drafter, chain_length=n), {"method": "chain", "K": n})
    for beta in args.chain_betas:
        points[f"c2t-chain β={beta:g}"] = (build_decoder("c2t", target, drafter, c2t=args.c2t, beta=beta, c2t_top_k=1,
                                                         c2t_depth=args.c2t_depth),
                                           {"method": "c2t_chain", "head": "c2t", "beta": beta})
    return points


def run_points(points: dict, prompts, args) -> dict:
    """Per point: outputs and stats of the last repeat, and the seconds and new tokens of every repeat."""
    names, runs = list(points), {name: {"secs": [], "tokens": []} for name in points}
    for p in prompts[:1]:  # warm-up, untimed
        for name in names:
            points[name][0].generate(list(p.input_ids), max_new_tokens=args.max_new_tokens)
    for rep in range(args.repeats):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for name in order:
            dec, outs, stats = points[name][0], [], []
            t0 = time.perf_counter()
            for p in prompts:
                res = dec.generate(list(p.input_ids), max_new_tokens=args.max_new_tokens)
                outs.append(res.tokens)
                stats.append(res.stats)
            runs[name]["secs"].append(time.perf_counter() - t0)
            runs[name]["tokens"].append(sum(st.new_tokens for st in stats))
            runs[name]["outs"], runs[name]["stats"] = outs, stats
        print(f"[tree_budget] repeat {rep + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    return runs


def summarize(points, runs, check=None) -> list[dict]:
    """check(outputs, stats) -> the self-check against AR (benchmarks.common.versus_ar), for outputs that differ.
    tokens_per_s: the median over repeats of new tokens / seconds; speedup: that over AR's (the eval's ratio of
    medians). In tokens, not seconds: where bf16 moves an EOS, a method's answers differ in length from AR's."""

    def tok_s(name):
        return statistics.median(n / secs for n, secs in zip(runs[name]["tokens"], runs[name]["secs"]))

    ar_tok_s = tok_s("ar")
    rows = []
    for name, (_, desc) in points.items():
        stats = runs[name]["stats"]
        rounds = [r for s in stats for r in zip(s.accepted_per_round, s.drafted_per_round)]
        draft_rounds = [(a, d) for a, d in rounds if d > 0] or [(0, 0)]
        tokens = sum(s.new_tokens for s in stats)
        rows.append({**desc, "name": name, "tau": sum(a for a, _ in rounds) / max(len(rounds), 1),
                     "tau_drafting_rounds": sum(a for a, _ in draft_rounds) / len(draft_rounds),
                     "gamma": sum(d + 1 for _, d in rounds), "gamma_draft_only": sum(d for _, d in rounds),
                     "rounds": len(rounds), "new_tokens": tokens, "tokens_per_s": tok_s(name),
                     "speedup": tok_s(name) / ar_tok_s, "secs_per_repeat": runs[name]["secs"],
                     "tokens_per_repeat": runs[name]["tokens"],
                     "draft_s": sum(s.draft_time_s for s in stats), "verify_s": sum(s.verify_time_s for s in stats),
                     "lossless": runs[name]["outs"] == runs["ar"]["outs"]})
        rows[-1]["versus_ar"] = (check(runs[name]["outs"], stats) if check and not rows[-1]["lossless"] else None)
    return rows


def interpolate(points: list[tuple[float, float]], x: float) -> float | None:
    """y at x on the piecewise-linear curve through (x, y) points sorted by x; None outside their range."""
    points = sorted(points)
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def compare_at_equal_tau(rows: list[dict]) -> None:
    """For each C2T point: EAGLE-2's γ and speedup at the same τ (interpolated over the N sweep), and the ratios."""
    eagle = [r for r in rows if r["method"] == "eagle2"]
    for r in rows:
        if r["method"] != "c2t":
            continue
        gamma = interpolate([(e["tau"], e["gamma"]) for e in eagle], r["tau"])
        speed = interpolate([(e["tau"], e["speedup"]) for e in eagle], r["tau"])
        r["eagle2_gamma_at_tau"], r["eagle2_speedup_at_tau"] = gamma, speed
        r["gamma_ratio_vs_eagle2"] = r["gamma"] / gamma if gamma else None


def resummarize_file(src: str, dst: str) -> dict:
    """A tree_budget.json written before 2026-11-28, whose speedup was AR's median seconds / the point's (wrong
    where a point's answers hold another number of tokens than AR's: bf16 moves EOS at near-ties), summarized
    again from its own raw fields as `summarize` does now and written to `dst` (a new file). Such a file kept
    only the last repeat's tokens: greedy decoding repeats its tokens, so every repeat is taken to hold as many."""
    import json

    doc = json.loads(Path(src).read_text())
    points = doc["points"]
    for p in points:
        tokens = p.get("tokens_per_repeat") or [p["new_tokens"]] * len(p["secs_per_repeat"])
        p["tokens_per_repeat"] = tokens
        p["tokens_per_s"] = statistics.median(n / secs for n, secs in zip(tokens, p["secs_per_repeat"]))
    ar = next(p for p in points if p["name"] == "ar")
    for p in points:
        p["speedup"] = p["tokens_per_s"] / ar["tokens_per_s"]
    compare_at_equal_tau(points)
    doc["setup"]["resummarized"] = ("speedup and tokens_per_s recomputed from secs_per_repeat and new_tokens by "
                                    "benchmarks.decoding.tree_budget.resummarize_file (tokens/s, not seconds)")
    if Path(dst).exists():
        raise FileExistsError(f"{dst} exists; give a new path")
    write_json(Path(dst), doc)
    return doc


def plot(rows, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    groups = {}
    for r in rows:
        if r["method"] != "ar":
            label = {"eagle2": "eagle2", "chain": "fixed chain", "c2t_chain": "C2T chain (K=1)"}.get(r["method"])
            groups.setdefault(label or f"C2T ({r['head']})", []).append(r)
    for label, pts in groups.items():
        pts = sorted(pts, key=lambda r: r["gamma"])
        marker = {"eagle2": "o-", "fixed chain": "^:", "C2T chain (K=1)": "v:"}.get(label, "s--")
        left.plot([r["gamma"] for r in pts], [r["tau"] for r in pts], marker, label=label)
        right.plot([r["tau"] for r in pts], [r["speedup"] for r in pts], marker, label=label)
        for r in pts:
            tag = f"N={r['N']}" if r["method"] == "eagle2" else f"K={r['K']}" if r["method"] == "chain" else \
                f"β={r['beta']:g}"
            left.annotate(tag, (r["gamma"], r["tau"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    left.set_xlabel("γ: tokens sent to the target (root included)")
    left.set_ylabel("τ: accepted drafts per verification")
    right.set_xlabel("τ")
    right.set_ylabel("wall-clock speedup over AR")
    right.axhline(1.0, color="grey", lw=0.8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def model_name(path: str) -> str:
    p = Path(path)
    return p.parent.name if p.name == "export" else p.name


def main(argv=None) -> int:
    with torch.no_grad():  # scoped: tests call main() in-process, and a global switch would leak into them
        return _main(argv)


def _main(argv=None) -> int:
    from draftforge.data.prompts import load_prompts

    args = parse_args(argv)
    target, drafter = load_models(args)
    prompts = load_prompts(args.bench, target.tokenizer, num_prompts=args.num_prompts, chat=args.chat_template,
                           context_length=target.max_context, max_new_tokens=args.max_new_tokens)
    points = build_points(args, target, drafter)
    runs = run_points(points, prompts, args)
    ids = [list(p.input_ids) for p in prompts]
    rows = summarize(points, runs, lambda outs, stats: versus_ar(target, ids, runs["ar"]["outs"], outs, stats))
    compare_at_equal_tau(rows)
    out = Path(args.out)
    setup = {k: v for k, v in vars(args).items()}
    setup["threads"] = torch.get_num_threads()
    write_json(out / "tree_budget.json", {"setup": setup, "points": rows})
    plot(rows, out / "tree_budget.png", f"{model_name(args.target)} + {model_name(args.drafter)}: "
                                        f"{len(prompts)} prompts x {args.max_new_tokens} tokens, greedy, "
                                        f"{torch.get_num_threads()} thread(s)")
    def ratio(r, key, fmt):
        return fmt.format(r[key]) if r.get(key) is not None else "–"

    print_table(["point", "τ", "γ", "γ drafts", "tok/s", "speedup", "γ / EAGLE-2 γ at τ", "EAGLE-2 speedup at τ",
                 "= AR"],
                [[r["name"], f"{r['tau']:.2f}", r["gamma"], r["gamma_draft_only"], f"{r['tokens_per_s']:.1f}",
                  f"{r['speedup']:.2f}", ratio(r, "gamma_ratio_vs_eagle2", "{:.2f}"),
                  ratio(r, "eagle2_speedup_at_tau", "{:.2f}"),
                  "yes" if r["lossless"] else versus_ar_cell(r["versus_ar"])] for r in rows],
                right={1, 2, 3, 4, 5, 6, 7})
    return 0 if all(r["lossless"] or r["versus_ar"]["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
