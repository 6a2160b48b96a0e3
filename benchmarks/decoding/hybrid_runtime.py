"""STree's runtime model on a measured target: t(N) per verification, fitted, and the speedup it predicts.

    python -m benchmarks.decoding.hybrid_runtime --target DIR [--report eval/report.json] [--max-n 16]

Times one verification (tree scan + tree-masked attention, HybridTarget or KV-cache target) for chains of
N = 1..max-n rows and for the trees given with --tree, fits t(N) = aN² + bN + c (STree §4; a ≈ 0 for a
pure SSM) by least squares over N >= 2, and, given eval reports, puts the speedup the model predicts for
each method (τ·t(1)/t(N̄), N̄ = mean rows per verification; and with the measured draft time per round
added) next to the measured one. t(1), the cost of a plain decoding step, is the measured one-row time,
not the fit's: on a CPU one row is a matrix-vector product and two rows a matrix-matrix one, a step
(SmolLM2 hybrid, 1 thread: 71 ms -> 111 ms) that a quadratic through N = 1..16 smooths into a wrong t(1). Progress on stderr, JSON on stdout. Timings: median of --repeats,
methods interleaved; the machine may be shared, so read ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import add_dtype_flag, add_flags, chosen_dtype

def chain(n_nodes: int):
    from draftforge.decode.tree import DraftTree

    return DraftTree([1] * n_nodes, list(range(-1, n_nodes - 1)), list(range(1, n_nodes + 1)), is_chain=True)


def tree_of(tree):
    """A DraftTree of `tree`'s shape (widths tuple or TreeShape, e.g. stree13), every token 1."""
    from draftforge.decode.tree import DraftTree
    from draftforge.decode.tree_shape import as_shape

    shape = as_shape(tree)
    tokens, parents, depths = shape.flatten([[1] * len(layer) for layer in shape.layers])
    return DraftTree(tokens, parents, depths)


def time_verifications(target, trees: dict, repeats: int, prompt_len: int) -> dict[str, float]:
    """Median seconds of one verify per named tree; trees interleaved in each repeat, their order rotated from repeat
    to repeat (the first verify after a prefill is no tree's alone), context reset each repeat."""
    times = {name: [] for name in trees}
    names = list(trees)
    for rep in range(repeats + 1):  # the first pass warms up
        target.prefill([3 + i % (target.vocab_size - 3) for i in range(prompt_len)])
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            tree = trees[name]
            t0 = time.perf_counter()
            target.verify(5, tree)
            dt = time.perf_counter() - t0
            target.commit([])
            if rep:
                times[name].append(dt)
    return {name: statistics.median(v) for name, v in times.items()}


def fit(ns: list[int], ts: list[float]) -> dict:
    x = torch.tensor(ns, dtype=torch.float64)
    design = torch.stack([x * x, x, torch.ones_like(x)], 1)
    coef = torch.linalg.lstsq(design, torch.tensor(ts, dtype=torch.float64)[:, None]).solution[:, 0].tolist()
    lin = torch.linalg.lstsq(design[:, 1:], torch.tensor(ts, dtype=torch.float64)[:, None]).solution[:, 0].tolist()
    return {"a": coef[0], "b": coef[1], "c": coef[2], "linear_k": lin[0], "linear_C": lin[1]}


def t_of(model: dict, n: float) -> float:
    return model["a"] * n * n + model["b"] * n + model["c"]


def predict(report: dict, model: dict, t1: float | None = None) -> list[dict]:
    """Predicted vs measured speedup per method@T from an eval report (τ and rows per verification); t1: the
    measured one-row verification (default: the fit's t(1)). The prediction leaves the prefill out, so it is
    compared with the report's decoding-only speedup (`measured_decode_speedup`; end to end is given too)."""
    t1 = t_of(model, 1) if t1 is None else t1
    out = []
    for r in report["results"]:
        n_rows = (r.get("verify_cost") or {}).get("tokens_per_verify") or 1.0
        rounds = max(r["target_forwards"], 1)
        draft_per_round = r["time"]["draft_s"] / rounds
        tau = r["tau"] or 0.0
        t_n = t1 if n_rows <= 1 else t_of(model, n_rows)  # one row (AR) is the measured step, not the fit
        out.append({
            "method": r["method"], "temperature": r["temperature"], "tau": tau, "rows_per_verify": n_rows,
            "predicted_speedup_verify_only": tau * t1 / t_n,
            "predicted_speedup_with_draft": tau * t1 / (t_n + draft_per_round),
            # the prediction prices decoding steps only: the like-for-like measure leaves the prefill out
            "measured_decode_speedup": r.get("decode_speedup"),
            "measured_speedup": r.get("speedup"),
        })
    return out


def main(argv=None) -> dict:
    from draftforge.decode import load_target
    from draftforge.decode import parse_tree

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="target model directory (SSM, hybrid or Transformer)")
    p.add_argument("--report", action="append", default=[],
                   help="an eval report.json to put predicted next to measured speedups (repeatable)")
    p.add_argument("--max-n", type=int, default=16, help="largest chain, in rows (root included)")
    p.add_argument("--tree", action="append", default=[],
                   help="also time this tree: widths like 3,1,1,1, parent lists like parents:0,0,0/0,0,1, or "
                        "stree13 (repeatable)")
    add_flags(p, repeats=5, prompt_len=64)
    add_dtype_flag(p)
    args = p.parse_args(argv)
    if args.max_n < 4:
        p.error("--max-n must be >= 4: the quadratic is fitted over N = 2..max-n")
    target = load_target(args.target, dtype=chosen_dtype(args))
    trees = {f"chain{n}": chain(n - 1) for n in range(1, args.max_n + 1)}
    trees.update({f"tree {w}": tree_of(parse_tree(w)) for w in args.tree})
    print(f"timing {len(trees)} verification shapes x {args.repeats} repeats on {type(target).__name__}, "
          f"torch threads {torch.get_num_threads()}", file=sys.stderr)
    times = time_verifications(target, trees, args.repeats, args.prompt_len)
    ns = list(range(2, args.max_n + 1))
    model = fit(ns, [times[f"chain{n}"] for n in ns])
    result = {"threads": torch.get_num_threads(), "t_seconds": times, "fit": model,
              "trees_vs_model": {name: {"rows": len(trees[name]) + 1, "measured": times[name],
                                        "model": t_of(model, len(trees[name]) + 1)}
                                 for name in trees if name.startswith("tree")}}
    result["prediction"] = []
    for path in args.report:
        with open(path) as f:
            result["prediction"] += [{**row, "report": path} for row in predict(json.load(f), model, times["chain1"])]
    print_summary(result)
    print(json.dumps(result, indent=1))
    return result


def print_summary(result: dict) -> None:
    """The fit, the trees against it and (given a report) predicted vs measured speedups, on stderr."""
    fit_ = result["fit"]
    lines = [f"t(N) = {fit_['a']:.3g}·N² + {fit_['b']:.3g}·N + {fit_['c']:.3g} s "
             f"(linear: {fit_['linear_k']:.3g}·N + {fit_['linear_C']:.3g}) over N >= 2; "
             f"t(1) measured {result['t_seconds']['chain1'] * 1e3:.1f} ms",
             "| shape | rows | measured ms | t(N) ms |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {row['rows']} | {row['measured'] * 1e3:.1f} | {row['model'] * 1e3:.1f} |"
              for name, row in result["trees_vs_model"].items()]
    if result.get("prediction"):
        lines += ["", "| report | method | T | τ | rows / verify | predicted (verify only) | predicted (+ draft) "
                      "| measured, decoding only | measured, end to end |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]

        def cell(x):
            return "–" if x is None else f"{x:.2f}×"

        lines += [f"| {'/'.join(Path(r.get('report', '-')).parts[-3:-1])} | {r['method']} | {r['temperature']:g} "
                  f"| {r['tau']:.2f} | {r['rows_per_verify']:.1f} | {cell(r['predicted_speedup_verify_only'])} "
                  f"| {cell(r['predicted_speedup_with_draft'])} | {cell(r['measured_decode_speedup'])} "
                  f"| {cell(r['measured_speedup'])} |" for r in result["prediction"]]
    print("\n".join(lines), file=sys.stderr)


if __name__ == "__main__":
    main()
