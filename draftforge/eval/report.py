"""Report writers: JSON (everything, raw per-prompt records included), Markdown table, PNG plots."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from draftforge.eval.metrics import fmt_num

CONVENTIONS = {
    "tau": "tokens emitted per target forward, bonus/correction token counted",
    "tau_no_bonus": "draft tokens accepted per verification round, bonus token not counted",
    "tokens_per_s": "per repeat: new tokens of all prompts / wall time of all generate() calls; median of repeats",
    "speedup": "ratio of medians: median tokens/s of the method / median tokens/s of AR, same run and prompts",
    "gamma_total": "verified candidate (draft) tokens summed over rounds and prompts",
    "acceptance_rate": "accepted draft tokens / verified candidate tokens (r_d)",
    "acceptance_by_position": "accepted at draft depth d / rounds that proposed depth d (0-based)",
    "hm": "EESD harmonic mean 2*v_d*r_d/(v_d+r_d); v_d = t_AR/(t_AR + t_draft per drafted token)",
    "memory": "CUDA max_memory_allocated per method on GPU; process peak RSS on CPU (monotone over the run)",
    "self_check": "temperature 0: prompts whose output equals the AR baseline of the same run (all repeats)",
}


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file + rename so a killed run never leaves a half-written report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _self_check_cell(sc: dict | None) -> str:
    if sc is None:
        return "–"
    cell = f"{sc['identical']}/{sc['total']}"
    if sc["identical"] < sc["total"]:
        cell += f" ({sc['near_ties']} near-tie)" if sc.get("near_tie_checked") else " (!)"
    return cell


def _time_cell(time: dict) -> str:
    fr = time["fractions"]
    parts = [fr.get(k) for k in ("draft", "verify", "other")]
    if any(p is None for p in parts):
        return "–"
    return "/".join(f"{100 * p:.0f}" for p in parts)


def _row(r: dict) -> str:
    tps = r["tokens_per_s_spread"]
    tps_cell = f"{fmt_num(tps['median'], 1)} [{fmt_num(tps['min'], 1)}–{fmt_num(tps['max'], 1)}]"
    mem = r.get("memory")
    mem_cell = fmt_num(mem["bytes"] / 2**20, 0) if mem else "–"
    speedup = f"{fmt_num(r['speedup'])}×" if r["speedup"] is not None else "–"
    is_ar = r["method"] == "ar"
    cells = [
        r["method"], f"{r['temperature']:g}", fmt_num(r["tau"]), "–" if is_ar else fmt_num(r["tau_no_bonus"]),
        tps_cell, speedup, "–" if is_ar else fmt_num(r["acceptance_rate"]), str(r["gamma_total"]),
        _time_cell(r["time"]), mem_cell, "–" if is_ar else fmt_num(r["hm"]), _self_check_cell(r["self_check"]),
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = ("| method | T | τ (+bonus) | τ (no bonus) | tok/s median [min–max] | speedup vs AR | accept rate "
          "| γ total | draft/verify/other % | peak mem MiB | HM | = AR (T=0) |")


def markdown_table(report: dict) -> str:
    """The speedup table plus the notes a reader needs to trust it."""
    m = report["manifest"]
    hw = m["hardware"]
    device = ", ".join(hw["gpu"]) if hw["gpu"] else hw["cpu"]
    lines = [
        HEADER,
        "|" + "---|" * HEADER.count(" | ") + "---|",
        *(_row(r) for r in report["results"]),
        "",
        f"{len(report['prompts'])} prompts · max_new_tokens {report['config']['max_new_tokens']} · "
        f"{m['repeats']} repeat(s) after warm-up · dtype {m['dtype']} · seed {m['seed']} · {device}",
        "speedup = ratio of medians (tokens/s over repeats) against AR measured in the same run on the same prompts.",
        "τ (+bonus) counts the bonus/correction token; τ (no bonus) counts accepted draft tokens only.",
    ]
    checks = [f"{r['method']} {_self_check_cell(r['self_check'])}" for r in report["results"] if r["self_check"]]
    if checks:
        lines.append(f"self-check (T=0, prompts identical to AR in this run, every repeat): {', '.join(checks)}.")
    for s in report.get("skipped", []):
        lines.append(f"skipped {s['method']}: {s['reason']}")
    return "\n".join(lines)


def acceptance_markdown(report: dict) -> str:
    rows = [r for r in report["results"] if r["acceptance_by_position"]]
    if not rows:
        return ""
    depth = max(len(r["acceptance_by_position"]) for r in rows)
    head = "| method | T | " + " | ".join(f"d{d + 1}" for d in range(depth)) + " |"
    lines = ["Acceptance by draft position: share of the rounds that drafted depth d whose accepted path "
             "reached depth d (unconditional: for one configuration it can only fall with d)", "", head,
             "|" + "---|" * (depth + 2)]
    for r in rows:
        rates = r["acceptance_by_position"] + [None] * (depth - len(r["acceptance_by_position"]))
        lines.append(f"| {r['method']} | {r['temperature']:g} | " + " | ".join(fmt_num(x) for x in rates) + " |")
    return "\n".join(lines)


def write_reports(report: dict, out_dir: str | Path, *, plots: bool = True) -> dict[str, str]:
    """Write report.json, report.md and the PNG plots into out_dir; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": str(out / "report.json"), "markdown": str(out / "report.md")}
    atomic_write_text(out / "report.json", json.dumps(report, indent=1, default=str) + "\n")
    md = ["# draftforge eval", "", markdown_table(report), "", acceptance_markdown(report), "",
          "Command: `" + report["manifest"]["command"] + "`", ""]
    atomic_write_text(out / "report.md", "\n".join(md))
    if plots:
        from draftforge.eval.plots import write_plots

        paths.update(write_plots(report, out))
    return paths
