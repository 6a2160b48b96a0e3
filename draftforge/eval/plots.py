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


def plot_speedup(results: list[dict], path: Path) -> None:
    plt = _pyplot()
    rows = [r for r in results if r["speedup"] is not None]
    fig, ax = plt.subplots(figsize=(max(4, 1.1 * len(rows)), 3.5))
    ax.bar([_label(r) for r in rows], [r["speedup"] for r in rows], color="tab:blue")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_ylabel("speedup over AR (ratio of median tok/s)")
    ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_tau_histogram(results: list[dict], path: Path) -> None:
    plt = _pyplot()
    rows = [r for r in results if r["method"] != "ar" and r["tau_histogram"]]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    width = 0.8 / max(len(rows), 1)
    for i, r in enumerate(rows):
        hist = {int(k): v for k, v in r["tau_histogram"].items()}
        total = sum(hist.values())
        xs = sorted(hist)
        ax.bar([x + i * width for x in xs], [hist[x] / total for x in xs], width=width, label=_label(r))
    ax.set_xlabel("tokens emitted per round (bonus counted)")
    ax.set_ylabel("fraction of rounds")
    if rows:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_acceptance(results: list[dict], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for r in results:
        rates = r["acceptance_by_position"]
        if rates:
            xs = [d + 1 for d, x in enumerate(rates) if x is not None]
            ax.plot(xs, [x for x in rates if x is not None], marker="o", label=_label(r))
    ax.set_xlabel("draft position (depth)")
    ax.set_ylabel("rounds reaching depth d")
    ax.set_ylim(0, 1.05)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(report: dict, out_dir: str | Path) -> dict[str, str]:
    out = Path(out_dir)
    paths = {
        "plot_speedup": out / "speedup.png",
        "plot_tau_histogram": out / "tau_histogram.png",
        "plot_acceptance": out / "acceptance_by_position.png",
    }
    plot_speedup(report["results"], paths["plot_speedup"])
    plot_tau_histogram(report["results"], paths["plot_tau_histogram"])
    plot_acceptance(report["results"], paths["plot_acceptance"])
    return {k: str(v) for k, v in paths.items()}
