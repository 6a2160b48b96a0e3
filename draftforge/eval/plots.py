"""PNG plots of an eval report: speedup by method, τ histogram, acceptance rate by draft position."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)  # headless: eval runs on servers without a display
    import matplotlib.pyplot as plt

    return plt


def _label(r: dict) -> str:
    return f"{r['method']} T={r['temperature']:g}"


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:  # outside the axes: it never hides a bar or a point
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def _figure(plt, width: float, title: str, subtitle: str):
    # constrained layout keeps axis labels, rotated ticks and the title inside the canvas
    import textwrap

    fig, ax = plt.subplots(figsize=(width, 4.0), layout="constrained")
    chars = int(width * 11)  # about what one line of 10 pt text holds across the figure
    ax.set_title("\n".join(textwrap.fill(t, chars) for t in (title, subtitle)), fontsize=10)
    return fig, ax


def _save(plt, fig, path: Path) -> None:
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_speedup(results: list[dict], path: Path, where: str = "") -> None:
    """Bars: ratio of median tokens/s against AR; whiskers: min–max of the per-repeat speedups."""
    plt = _pyplot()
    rows = [r for r in results if r["speedup"] is not None]
    fig, ax = _figure(plt, max(5.0, 1.1 * len(rows) + 1.5), f"Speedup over AR (same run, same prompts){where}",
                      "bar: ratio of median tok/s · whisker: min–max over repeats")
    xs = list(range(len(rows)))
    heights = [r["speedup"] for r in rows]
    lo, hi = [], []
    for r, h in zip(rows, heights):
        sp = r.get("speedup_spread") or {}
        lo.append(max(h - sp["min"], 0.0) if sp.get("min") is not None else 0.0)
        hi.append(max(sp["max"] - h, 0.0) if sp.get("max") is not None else 0.0)
    ax.bar(xs, heights, color="tab:blue", yerr=[lo, hi], capsize=4, ecolor="black")
    for x, h, e in zip(xs, heights, hi):  # above the whisker, so the two never overlap
        ax.annotate(f"{h:.2f}×", (x, h + e), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(xs, [_label(r) for r in rows], rotation=30, ha="right")
    ax.set_ylabel("speedup over AR (×)")
    ax.set_ylim(0, max([h + e for h, e in zip(heights, hi)] + [1.0]) * 1.18)
    _save(plt, fig, path)


def plot_tau_histogram(results: list[dict], path: Path, where: str = "") -> None:
    """Share of rounds that emitted k tokens, one bar per method centred on each integer k."""
    plt = _pyplot()
    rows = [r for r in results if r["method"] != "ar" and r["tau_histogram"]]
    fig, ax = _figure(plt, 7.5, f"Tokens emitted per round (τ histogram){where}",
                      "accepted drafts + the bonus/correction token")
    width = 0.8 / max(len(rows), 1)
    ks = set()
    for i, r in enumerate(rows):
        hist = {int(k): v for k, v in r["tau_histogram"].items()}
        total = sum(hist.values())
        xs = sorted(hist)
        ks.update(xs)
        offset = (i - (len(rows) - 1) / 2) * width  # the group of bars is centred on the integer tick
        ax.bar([x + offset for x in xs], [hist[x] / total for x in xs], width=width, label=_label(r))
    if ks:
        ax.set_xticks(range(min(ks), max(ks) + 1))
    ax.set_xlabel("tokens emitted per round (bonus counted)")
    ax.set_ylabel("fraction of rounds")
    _legend(ax)
    _save(plt, fig, path)


def plot_acceptance(results: list[dict], path: Path, where: str = "") -> None:
    """Per method: the share of rounds that drafted depth d whose accepted path reached d."""
    plt = _pyplot()
    fig, ax = _figure(plt, 7.5, f"Acceptance by draft position{where}",
                      "rounds whose accepted path reached depth d / rounds that drafted depth d")
    depth = 0
    for r in results:
        rates = r["acceptance_by_position"]
        if rates:
            pts = [(d + 1, x) for d, x in enumerate(rates) if x is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=_label(r))
            depth = max(depth, len(rates))
    if depth:
        ax.set_xticks(range(1, depth + 1))  # depths are whole numbers: no half-integer ticks
    ax.set_xlabel("draft position (depth d)")
    ax.set_ylabel("acceptance rate at depth d")
    ax.set_ylim(0, 1.05)
    _legend(ax)
    _save(plt, fig, path)


def bench_name(bench) -> str:
    """A prompt set's short name for a title: a named bench as it is, a file by its stem (an absolute path made
    the titles wider than the figure), at most 40 characters."""
    text = str(bench)
    name = Path(text).stem if ("/" in text or text.endswith((".jsonl", ".json"))) else text
    return name if len(name) <= 40 else name[:39] + "…"


PLOT_FILES = ("speedup.png", "tau_histogram.png", "acceptance_by_position.png")


def write_plots(report: dict, out_dir: str | Path) -> dict[str, str]:
    """The plots that have data (an AR-only run drafts nothing: no τ histogram, no acceptance), titled with
    the prompt set. A plot an earlier report in --out drew and this one has no data for is removed, so that no
    plot of another run stands beside this report (eval.output.check_out made sure such files are eval's)."""
    out, results = Path(out_dir), report["results"]
    where = f" · {bench_name(report['config']['bench'])} ({len(report.get('prompts', []))} prompts)"
    drafted = any(r["method"] != "ar" and r.get("tau_histogram") for r in results)
    plots = {"plot_speedup": ("speedup.png", plot_speedup, any(r["speedup"] is not None for r in results)),
             "plot_tau_histogram": ("tau_histogram.png", plot_tau_histogram, drafted),
             "plot_acceptance": ("acceptance_by_position.png", plot_acceptance,
                                 any(r.get("acceptance_by_position") for r in results))}
    assert {name for name, _, _ in plots.values()} == set(PLOT_FILES)
    paths = {}
    for key, (name, plot, has_data) in plots.items():
        if has_data:
            plot(results, out / name, where)
            paths[key] = str(out / name)
        else:
            (out / name).unlink(missing_ok=True)
    return paths
