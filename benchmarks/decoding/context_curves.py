"""Speedup, τ and memory against context length, per drafter and method, from long-context eval reports.

Reads one or more `draftforge eval --out DIR` reports on a prompt set whose categories end in `@<n>k` (the
long-context question set, `draftforge target longctx`), regroups each run's records by length (both task groups
of a length together, and each group alone) with the eval's own metrics (`draftforge.eval.metrics.by_category`,
so every figure is computed as the report computes its overall ones, against the same run's AR), and writes:

  OUT/context_curves.json   one row per run × method × temperature × length (× task group)
  OUT/context_curves.png    decoding speedup, τ and context state held, against the context length
  stdout                    the per-length table

    python -m benchmarks.decoding.context_curves runs/longctx/e3-t0 runs/longctx/fm-t0 \\
        --label e3-t0="EAGLE-3 head" --label fm-t0="feature Mamba2" --out runs/longctx/curves

Columns: speedup is end to end (the prefill included, as the eval's tokens/s); decode speedup leaves the prefill
out (what a drafter can change once the prompt is encoded); draft / verify / harness are ms per round / target
forward / target forward; KV and state are MiB held at a decode's end (median over the length's prompts).
Each run's AR is its own, so two runs' AR rows show the noise between passes.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import fields
from pathlib import Path

from benchmarks.common import checked_args, print_table, write_json
from draftforge.decode.base import DecodeStats
from draftforge.eval.metrics import RunRecord, by_category

BUCKET = re.compile(r"^(?P<group>.+)@(?P<length>\d+)k$")
STATS_FIELDS = {f.name for f in fields(DecodeStats)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("reports", nargs="+", help="eval output directories (each holds report.json)")
    p.add_argument("--label", action="append", default=[], metavar="DIRNAME=TEXT",
                   help="a run's name in the table and plot (default: its drafter path)")
    p.add_argument("--out", required=True, help="directory for context_curves.json / .png")
    p.add_argument("--no-plot", action="store_true", help="write the JSON and table only")
    return checked_args(p, argv, files={"out": "context_curves.json"})


def load_records(report: dict) -> list[RunRecord]:
    out = []
    for r in report["records"]:
        stats = DecodeStats(**{k: v for k, v in r["stats"].items() if k in STATS_FIELDS})
        out.append(RunRecord(r["method"], r["temperature"], r["repeat"], r["prompt_id"], r["prompt_len"],
                             r["tokens"], stats, r.get("turn", 0)))
    return out


def buckets(report: dict) -> dict[str, tuple[str, int]]:
    """prompt_id -> (task group, length in k) for prompts whose category is `<group>@<n>k`; others are left out."""
    out = {}
    for p in report["prompts"]:
        m = BUCKET.match(str(p.get("category", "")))
        if m:
            out[p["prompt_id"]] = (m["group"], int(m["length"]))
    return out


def mib(held: dict | None, key: str) -> float | None:
    figure = (held or {}).get(key) or {}
    return None if figure.get("median") is None else figure["median"] / 2**20


def ms(value: float | None) -> float | None:
    return None if value is None else value * 1e3


def rows_of(report: dict, label: str) -> list[dict]:
    """One row per method × temperature × length, for all task groups together ("all") and each alone."""
    where = buckets(report)
    if not where:
        raise SystemExit(f"{label}: no prompt category ends in @<n>k; this is not a long-context question set")
    records = [r for r in load_records(report) if r.prompt_id in where]
    results = {(r["method"], r["temperature"]): r for r in report.get("results", [])}
    rows = []
    for grouping in ("all", "group"):
        category_of = {pid: (f"all@{n}" if grouping == "all" else f"{g}@{n}") for pid, (g, n) in where.items()}
        category_of = dict(sorted(category_of.items(), key=lambda kv: int(kv[1].split("@")[1])))
        for method, temp in dict.fromkeys((r.method, r.temperature) for r in records):
            mine = [r for r in records if (r.method, r.temperature) == (method, temp)]
            ar = [r for r in records if (r.method, r.temperature) == ("ar", temp)]
            for cat, f in by_category(mine, ar, category_of).items():
                group, length = cat.split("@")
                cost = f["per_round"] or {}
                rows.append({
                    "run": label, "method": method, "temperature": temp, "group": group, "length_k": int(length),
                    "prompts": f["num_prompts"], "context_tokens": (f["prompt_tokens"] or {}).get("median"),
                    "tau": f["tau"], "tokens_per_s": f["tokens_per_s"], "speedup": f["speedup"],
                    "decode_tokens_per_s": f["decode_tokens_per_s"], "decode_speedup": f["decode_speedup"],
                    "prefill_s": cost.get("prefill_s_per_prompt"), "draft_ms": ms(cost.get("draft_s_per_round")),
                    "verify_ms": ms(cost.get("verify_s_per_forward")), "harness_ms": ms(cost.get("other_s_per_forward")),
                    "target_kv_mib": mib(f.get("held"), "target_cache_bytes"),
                    "drafter_state_mib": mib(f.get("held"), "drafter_state_bytes"),
                    **best_chain(results.get((method, temp)), int(length)),
                })
    return rows


def best_chain(result: dict | None, length_k: int) -> dict:
    """The eval's cost model at this length (its curve timed at the bucket, eval/cost.py): the chain length γ' it
    predicts fastest for this method's rounds at that length, and that prediction; None where the report has none
    (a tree, AR, a report from before per-length curves)."""
    per_length = ((result or {}).get("cost_model") or {}).get("by_length") or {}
    at = per_length.get(str(1024 * length_k)) or per_length.get(1024 * length_k) or {}
    best = at.get("best_chain_length")
    cut = {int(g): v for g, v in (at.get("shorter_chains") or {}).items()}
    return {"best_chain_length": best, "best_chain_predicted_speedup": cut.get(best) if best else None}


def fmt(v, digits=2):
    return "–" if v is None else f"{v:.{digits}f}"


def print_rows(rows: list[dict]) -> None:
    table = [[r["run"], f"{r['method']} T={r['temperature']:g}", f"{r['length_k']}k", fmt(r["context_tokens"], 0),
              fmt(r["tau"]), fmt(r["decode_tokens_per_s"], 1), fmt(r["decode_speedup"]), fmt(r["speedup"]),
              fmt(r["prefill_s"]), fmt(r["draft_ms"]), fmt(r["verify_ms"]), fmt(r["harness_ms"]),
              fmt(r["target_kv_mib"], 1), fmt(r["drafter_state_mib"], 2),
              "–" if not r["best_chain_length"] else
              f"{r['best_chain_length']} ({fmt(r['best_chain_predicted_speedup'])}×)"]
             for r in rows if r["group"] == "all"]
    print_table(["run", "method", "length", "context", "τ", "decode tok/s", "decode speedup", "speedup",
                 "prefill s", "draft ms", "verify ms", "harness ms", "target KV MiB", "drafter MiB",
                 "best γ' (predicted)"], table, right=set(range(3, 14)))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["group"] == "all"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), layout="constrained")
    series = dict.fromkeys((r["run"], r["method"], r["temperature"]) for r in rows if r["method"] != "ar")
    colour = {key: f"C{i % 10}" for i, key in enumerate(series)}  # one colour per series in every panel
    for run, method, temp in series:
        pts = sorted((r for r in rows if (r["run"], r["method"], r["temperature"]) == (run, method, temp)),
                     key=lambda r: r["length_k"])
        xs = [r["context_tokens"] for r in pts]
        name = f"{run}, {method} T={temp:g}"
        c = colour[(run, method, temp)]
        axes[0].plot(xs, [r["decode_speedup"] for r in pts], marker="o", color=c, label=name)
        axes[1].plot(xs, [r["tau"] for r in pts], marker="o", color=c, label=name)
        if any(r["drafter_state_mib"] for r in pts):
            axes[2].plot(xs, [r["drafter_state_mib"] for r in pts], marker="o", color=c, label=f"{run} (drafter)")
    ar = sorted((r for r in rows if r["method"] == "ar"), key=lambda r: r["length_k"])
    if ar:
        first = ar[0]["run"]
        pts = [r for r in ar if r["run"] == first]
        axes[2].plot([r["context_tokens"] for r in pts], [r["target_kv_mib"] for r in pts], color="black",
                     linestyle="--", marker="s", label="target KV cache")
    axes[0].axhline(1.0, color="gray", linestyle="--", linewidth=1)
    for ax, title, ylabel in ((axes[0], "Decoding speedup over AR (prefill left out)", "× AR"),
                              (axes[1], "τ: tokens per target forward", "τ"),
                              (axes[2], "Context state held at a decode's end", "MiB (log)")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("context (target tokens, median of the length's prompts)")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
    axes[2].set_yscale("log")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    labels = dict(item.split("=", 1) for item in args.label)
    rows = []
    for d in args.reports:
        path = Path(d) / "report.json"
        if not path.is_file():
            raise SystemExit(f"{d}: no report.json (an eval still running, or one that was stopped?)")
        report = json.loads(path.read_text())
        rows += rows_of(report, labels.get(Path(d).name, report["config"].get("drafter") or Path(d).name))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"reports": [str(d) for d in args.reports], "rows": rows}
    write_json(out / "context_curves.json", result)
    print_rows(rows)
    if not args.no_plot:
        plot(rows, out / "context_curves.png")
    print(f"wrote {out / 'context_curves.json'}" + ("" if args.no_plot else f" and {out / 'context_curves.png'}"))
    return result


if __name__ == "__main__":
    main()
