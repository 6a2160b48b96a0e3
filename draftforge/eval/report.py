"""Report writers: JSON (everything, raw per-prompt records included), Markdown table, PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

from draftforge.eval.cost import curve_markdown, prediction_markdown
from draftforge.eval.metrics import fmt_num
from draftforge.fsutil import atomic_write_text  # noqa: F401  (report writers use it)

CONVENTIONS = {
    "tau": "tokens emitted per target forward, bonus/correction token counted",
    "tau_no_bonus": "draft tokens accepted per verification round that drafted anything (rounds that drafted "
                    "nothing, e.g. a prompt's last round, are not counted), bonus token not counted",
    "tokens_per_s": "per repeat: new tokens of all prompts / wall time of all generate() calls; median of repeats",
    "speedup": "ratio of medians: median tokens/s of the method / median tokens/s of AR, same run and prompts; "
               "its spread is min/median/max over repeats of (method tokens/s / AR tokens/s in the same repeat)",
    "gamma_total": "verified candidate (draft) tokens, γ, summed over rounds and prompts",
    "mean_draft_length": "drafted tokens per round that drafted anything (γ total / drafting rounds)",
    "acceptance_rate": "accepted draft tokens / verified candidate tokens (= v_d)",
    "v_d": "EESD App. D Eq. 11: accepted draft tokens / all drafted tokens (every node of a tree counts)",
    "r_d": "EESD App. D Eq. 12: accepted draft tokens / output tokens (share of the output from the draft)",
    "hm": "EESD App. D harmonic mean 2*v_d*r_d/(v_d+r_d); report.json holds the fraction, report.md and the "
          "paper show it x100 (%)",
    "alpha": "EESD Eq. 14 cost ratio T_d/T_t: draft seconds per drafted token / AR seconds per decoded token (AR's "
             "prefill left out; the drafter's own prompt encoding, done inside its first draft, counted), same run",
    "acceptance_by_position": "accepted at draft depth d / rounds that proposed depth d (0-based in report.json, "
                              "d1 = the first draft token in report.md and the plot)",
    "memory": "per method and temperature, the timed pass (of the repeats) whose peak rose most above its "
              "start: +pass = that pass's peak minus what the process held at its start, (start) = what it held "
              "then (weights, persistent drafter buffers, the records so far). CPU: resident set size; the "
              "peak is the kernel's high-water mark (VmHWM, reset through /proc/self/clear_refs at the pass's "
              "start, after gc and a glibc malloc_trim so freed heap does not hide growth): exact, and nothing "
              "runs during the timed pass; where it cannot be reset (not Linux) a thread samples RSS every 5 ms "
              "(it may miss a shorter peak, and costs tok/s: ~5% measured on a tight CPU loop; report.json "
              "memory.how says which). CUDA: torch.cuda memory_allocated at the start and "
              "max_memory_allocated with the peak reset per pass. On CPU +pass is what the pass needed beyond "
              "heap pages already resident, so it is a lower bound of its working memory",
    "self_check": "temperature 0: prompts whose output equals the AR baseline of the same run (all repeats); "
                  "each differing output is a near-tie when, at its first differing position, the two tokens' "
                  "float32 logits (the model's own plain forward, no draftforge code) are within twice the "
                  "difference the plain forward in the run's dtype shows from float32 there (at least one "
                  "rounding step, at most 8 at the logits' scale) and the harness's own logits there are within "
                  "that ceiling, and each of its later tokens is the plain forward's pick over its own context or "
                  "such a near-tie; else a defect (the run fails on a defect, and in float32 on any difference). "
                  "AR's own tokens are checked against the plain forward too. Each turn of a "
                  "multi-turn question counts as a prompt, compared only when its context (the conversation with "
                  "the method's own earlier answers) is AR's; after an earlier turn's near-tie it is not, and the "
                  "turn counts as 'context differs', neither identical nor a defect",
    "by_category": "per category of the prompts (results[].by_category; Spec-Bench's question file as its "
                   "evaluation/speed.py groups it: MT-bench's eight categories are mt_bench): τ, tokens/s and "
                   "speedup computed exactly as the overall figures, on that category's records and AR's records "
                   "of the same prompts",
    "answers": "--answers DIR: one Spec-Bench model_answer JSONL per method and temperature (report.json "
               "answers: path, model_id, the repeat written: the pass with the median tokens/s)",
    "cost_model": "t(N): one verification forward of N rows timed before the runs; predicted speedup = "
                  "τ·t(1) / (t(N) averaged over the method's rounds + its draft seconds per round)",
    "timing": "The method order rotates across repeats (repeat r starts at method r mod M, AR is method 0); "
              "before each timed pass the decoder's adaptive state is reset (its reset(), e.g. the UCB "
              "controller) and the same warm-up prompts run again untimed, so every repeat starts from an "
              "identically warmed controller; the order used is manifest.method_order",
    "hf_assisted_policy": "hf_assisted drafts with transformers' own policy, read from the drafter's "
                          "generation_config at run time (num_assistant_tokens, its schedule, confidence threshold)",
}

# report.md names for the conventions above (table column or line), in the order they are explained
MD_NAMES = {
    "tau": "τ (+bonus)", "tau_no_bonus": "τ (no bonus)", "tokens_per_s": "tok/s", "speedup": "speedup vs AR",
    "acceptance_rate": "accept rate per drafted node", "v_d": "v_d", "r_d": "r_d", "hm": "HM %", "mean_draft_length": "draft len",
    "gamma_total": "γ total", "alpha": "α (report.json)", "memory": "mem MiB +pass (start)",
    "self_check": "= AR (T=0)",
    "acceptance_by_position": "acceptance by position", "timing": "timing", "hf_assisted_policy": "hf_assisted", "cost_model": "cost model",
}


def _self_check_cell(sc: dict | None) -> str:
    if sc is None:
        return "–"
    cell = f"{sc['identical']}/{sc['total']}"
    if sc["identical"] < sc["total"]:
        if not sc.get("near_tie_checked"):
            return cell + " (differences not classified)"
        mine = sc["defects"] - sc.get("ar_defects", 0)
        cell += f" ({sc['near_ties']} near-tie" + (f", {mine} DEFECT" if mine else "") + ")"
    if sc.get("ar_defects"):  # AR itself parted from the model's plain forward: every row shares that verdict
        cell += f", AR: {sc['ar_defects']} DEFECT"
    if sc.get("context_differs"):
        cell += f", {sc['context_differs']} turn(s) with another context"
    return cell


def _time_cell(time: dict) -> str:
    fr = time["fractions"]
    parts = [fr.get(k) for k in ("draft", "verify", "other")]
    if any(p is None for p in parts):
        return "–"
    return "/".join(f"{100 * p:.0f}" for p in parts)


def _spread_cell(median, sp: dict, digits: int, unit: str = "") -> str:
    if median is None:
        return "–"
    return f"{fmt_num(median, digits)}{unit} [{fmt_num(sp['min'], digits)}–{fmt_num(sp['max'], digits)}]"


def _memory_cell(mem: dict | None) -> str:
    """'+extra (start)' in MiB: the pass's peak above its start, and what the process held at the start."""
    if not mem:
        return "–"
    if mem.get("start_bytes") is None:  # a report written before 2026-12: the process peak only
        return f"{fmt_num(mem['bytes'] / 2**20, 0)} peak"
    return f"+{fmt_num(mem['bytes'] / 2**20, 1)} ({fmt_num(mem['start_bytes'] / 2**20, 0)})"


def _row(r: dict) -> str:
    mem_cell = _memory_cell(r.get("memory"))
    speedup = _spread_cell(r["speedup"], r.get("speedup_spread") or {"min": None, "max": None}, 2, "×")
    hm = r.get("hm")
    is_ar = r["method"] == "ar"

    def draft(x, digits=2):
        return "–" if is_ar else fmt_num(x, digits)

    cells = [
        r["method"], f"{r['temperature']:g}", fmt_num(r["tau"]), draft(r["tau_no_bonus"]),
        _spread_cell(r["tokens_per_s"], r["tokens_per_s_spread"], 1), speedup, draft(r["acceptance_rate"]),
        draft(r.get("r_d")), draft(100 * hm if hm is not None else None, 1), draft(r.get("mean_draft_length")),
        str(r["gamma_total"]), _time_cell(r["time"]), mem_cell, _self_check_cell(r["self_check"]),
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = ("| method | T | τ (+bonus) | τ (no bonus) | tok/s median [min–max] | speedup vs AR: ratio of medians "
          "[min–max by repeat] "
          "| accept rate per drafted node (v_d) | r_d | HM % | draft len | γ total | draft/verify/other % | mem MiB +pass (start) "
          "| = AR (T=0) |")


def _turns_note(report: dict) -> str:
    """' (N turns)' when some prompt is a multi-turn question, else ''."""
    turns = sum(p.get("turns", 1) for p in report["prompts"])
    return f" ({turns} turns)" if turns > len(report["prompts"]) else ""


def _verify_cost_lines(report: dict) -> list[str]:
    """For SSM/hybrid targets: tokens computed and states held per verification, and the target's notes."""
    rows = [r for r in report["results"] if (r.get("verify_cost") or {}).get("ssm_layers")]
    lines = []
    if rows:
        per = ", ".join(f"{r['method']}@{r['temperature']:g} {r['verify_cost']['tokens_per_verify']:.1f} tokens / "
                        f"{r['verify_cost']['states_per_verify']} state" for r in rows)
        lines.append(f"per verification ({rows[0]['verify_cost']['ssm_layers']} SSM layers; states per SSM layer, "
                     f"packed tree scan: unrolling a tree would hold one per leaf): {per}.")
    lines += [f"note: {n}" for n in report.get("target_notes", [])]
    return lines


def markdown_table(report: dict) -> str:
    """The speedup table plus the notes a reader needs to trust it."""
    m = report["manifest"]
    hw = m["hardware"]
    device = ", ".join(hw["gpu"]) if hw["gpu"] else hw["cpu"]
    threads = f" · torch threads {hw['torch_threads']}" if hw.get("torch_threads") else ""
    lines = [
        HEADER,
        "|" + "---|" * HEADER.count(" | ") + "---|",
        *(_row(r) for r in report["results"]),
        "",
        f"{len(report['prompts'])} prompts{_turns_note(report)} · max_new_tokens {report['config']['max_new_tokens']} · "
        f"{m['repeats']} repeat(s), method order rotated, each pass after a reset and an untimed warm-up · "
        f"dtype {m['dtype']} · seed {m['seed']} · {device}{threads}",
        "speedup = ratio of medians (tokens/s over repeats) against AR measured in the same run on the same prompts; "
        "[min–max] = spread over repeats, so a reader sees the noise.",
        "τ (+bonus) = new tokens per round, the bonus/correction token counted; τ (no bonus) = accepted drafts per "
        "round that drafted (rounds with no draft, e.g. prompt lookup without a match, are left out, so it is not "
        "τ (+bonus) − 1).",
    ]
    for who, words in (m.get("attention") or {}).items():  # kernels may differ between machines: say which ran
        lines.append(f"{who} {words if words.startswith('attention') else 'attention: ' + words}.")
    checks = [f"{r['method']} {_self_check_cell(r['self_check'])}" for r in report["results"] if r["self_check"]]
    if checks:
        lines.append(f"self-check (T=0, prompts identical to AR in this run, every repeat): {', '.join(checks)}.")
    lines += _verify_cost_lines(report)
    cost = report.get("cost_model") or {}
    if cost.get("curve_s"):
        lines += ["", *curve_markdown(cost), "", *prediction_markdown(report["results"])]
    after = cost.get("after_runs")
    if after:
        t1 = after["t1_before_s"]
        ar = ", ".join(f"T={t}: {v * 1e3:.1f} ms ({v / t1:.2f} t(1))" for t, v in after.get("ar_forward_s", {}).items())
        ar = f"; AR's own forward in its timed passes: {ar}" if ar else ""
        lines.append(f"t(1) re-timed after the runs: {after['t1_s'] * 1e3:.1f} ms ({after['t1_s'] / t1 - 1:+.0%} "
                     f"against before){ar}. When either is far from t(1) the machine's pace moved during the run "
                     "(another process, throttling) and the predictions, priced on the first curve, are off by as "
                     "much.")
    for temp, t in (cost.get("chain_tuning") or {}).items():
        each = ", ".join(f"{g}: {v:.2f}×" for g, v in t["predicted"].items())
        lines.append(f"chain length tuned (--tune-chain-length), T={float(temp):g}: chain {t['probed_length']} on "
                     f"the first {len(t['prompts'])} prompt(s) (untimed here; they are timed with the rest), "
                     f"{t['rounds']} rounds, cut at each length predicts "
                     f"{each or 'nothing (no round drafted 2 or more)'}; timed at {t['chosen']}.")
    for s in report.get("skipped", []):
        if s.get("asked", True):  # a default baseline that cannot run is in report.json only
            lines.append(f"skipped {s['method']}: {s['reason']}")
    return "\n".join(lines)


def heading_markdown(report: dict) -> str:
    """What was measured, in one line a reader sees first: target, drafter, prompts, dtype, threads."""
    cfg, m = report["config"], report["manifest"]
    choice = m.get("dtype_choice", {})
    dtypes = "; ".join(f"{who} {c['dtype']} ({c['reason']})" for who, c in choice.items()) or f"dtype {m['dtype']}"
    return (f"target `{cfg['target']}` · drafter `{cfg.get('drafter') or '–'}` · prompts `{cfg['bench']}` "
            f"({len(report['prompts'])}) · {dtypes} · {m.get('threads') or 'torch threads ' + str(m['hardware'].get('torch_threads'))}")


def acceptance_markdown(report: dict) -> str:
    rows = [r for r in report["results"] if r["acceptance_by_position"]]
    if not rows:
        return ""
    depth = max(len(r["acceptance_by_position"]) for r in rows)
    head = "| method | T | " + " | ".join(f"d{d + 1}" for d in range(depth)) + " |"
    lines = ["Acceptance by draft position (per depth, not per drafted node: a tree drafts several nodes at one "
             "depth): share of the rounds that drafted depth d whose accepted path "
             "reached depth d (unconditional: for one configuration it falls with d, except that rounds cut "
             "short by the token budget propose fewer depths)", "", head,
             "|" + "---|" * (depth + 2)]
    for r in rows:
        rates = r["acceptance_by_position"] + [None] * (depth - len(r["acceptance_by_position"]))
        lines.append(f"| {r['method']} | {r['temperature']:g} | " + " | ".join(fmt_num(x) for x in rates) + " |")
    return "\n".join(lines)


MAX_CATEGORY_ROWS = 20  # more categories (e.g. the testbed's source files): report.json only


def _speedup_cell(f: dict) -> str:
    decode = f.get("decode_speedup")
    both = f"{fmt_num(f['speedup'])}×" + ("" if decode is None else f" · {fmt_num(decode)}×")
    return f"{both} ({fmt_num(f['tau'])})"


def category_markdown(report: dict) -> str:
    """Speedup and τ per category (results[].by_category) for every speculative method, when there are two or
    more categories; the last row is the overall figure."""
    rows = [r for r in report["results"] if r.get("by_category") and r["method"] != "ar"]
    cats = list(dict.fromkeys(c for r in rows for c in r["by_category"]))
    if len(cats) < 2:
        return ""
    if len(cats) > MAX_CATEGORY_ROWS:
        return f"{len(cats)} categories: per-category τ and speedup are in report.json (results[].by_category)."
    lines = ["## Per category", "",
             "speedup vs AR end to end · decoding only, the target's prefill left out (the drafter encodes the prompt "
             "inside its first draft, which counts: at long context it lowers this figure) (τ +bonus), on each "
             "category's prompts, "
             "computed as the overall figures are, from the same records (a multi-turn question counts all its "
             "turns).", "",
             "| category | prompts | " + " | ".join(f"{r['method']} T={r['temperature']:g}" for r in rows) + " |",
             "|" + "---|" * (len(rows) + 2)]
    for cat in cats:
        figures = [r["by_category"].get(cat) for r in rows]
        prompts = next(f["num_prompts"] for f in figures if f)
        cells = ["–" if f is None else _speedup_cell(f) for f in figures]
        lines.append(f"| {cat} | {prompts} | " + " | ".join(cells) + " |")
    overall = [_speedup_cell(r) for r in rows]
    lines.append(f"| all | {len(report['prompts'])} | " + " | ".join(overall) + " |")
    return "\n".join(lines)


def category_cost_markdown(report: dict) -> str:
    """Per category, what grows with the context: its length, AR's prefill and verification forward, and each
    method's draft and harness time (results[].by_category[].per_round), when there are 2..MAX categories."""
    rows = [r for r in report["results"] if r.get("by_category")]
    cats = list(dict.fromkeys(c for r in rows for c in r["by_category"]))
    if not 2 <= len(cats) <= MAX_CATEGORY_ROWS:
        return ""
    ms = lambda v: "–" if v is None else f"{v * 1e3:.1f}"  # noqa: E731

    def mib(f, key):  # the median decode's held bytes
        held = ((f or {}).get("held") or {}).get(key) or {}
        return "–" if held.get("median") is None else f"{held['median'] / 2**20:.1f}"

    lines = ["## Per category: costs", "",
             "ms unless said; context = tokens decoded from (median); draft = per round, the drafter's encoding of "
             "the prompt (inside its first draft) spread over the rounds; verify = one target forward; harness = the "
             "time per target forward that is neither drafting nor verifying; KV / state MiB = the target's cache "
             "and the drafter's cache or state held at a decode's end (median).", "",
             "| category | context | " + " | ".join(
                 f"{r['method']} T={r['temperature']:g} {what}" for r in rows
                 for what in (("prefill s", "verify", "harness", "target KV MiB") if r["method"] == "ar" else
                              ("draft", "verify", "harness", "drafter state MiB")))
             + " |", "|" + "---|" * (2 + 4 * len(rows))]
    for cat in cats:
        cells, context = [], "–"
        for r in rows:
            f = r["by_category"].get(cat)
            cost = (f or {}).get("per_round") or {}
            if f and f.get("prompt_tokens"):
                context = f"{f['prompt_tokens']['median']:.0f}"
            first = (fmt_num(cost.get("prefill_s_per_prompt")) if r["method"] == "ar" else
                     ms(cost.get("draft_s_per_round")))
            cells += [first, ms(cost.get("verify_s_per_forward")), ms(cost.get("other_s_per_forward")),
                      mib(f, "target_cache_bytes" if r["method"] == "ar" else "drafter_state_bytes")]
        lines.append(f"| {cat} | {context} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def component_memory_markdown(report: dict) -> str:
    """Memory of the target and the drafter apart, per method and context (eval/components.py); '' without it."""
    found = report.get("component_memory")
    if not found:
        return ""

    def mib(part, key):
        value = (part or {}).get(key)
        return "–" if value is None else f"{value / 2**20:,.1f}"

    lines = ["## Memory by component", "",
             f"{found['what']}. MiB. weights: parameters and buffers; state: the most context state (KV cache, SSM "
             "state) held after any call; working: the largest rise of memory during one call above what was held "
             "when it began (activations, attention scores, scan intermediates).", "",
             "| method | context | target weights | target state | target working | drafter weights | drafter state "
             "| drafter working |", "|---|---|---|---|---|---|---|---|"]
    how = None
    for method, buckets in found["by_method"].items():
        for _, m in sorted(buckets.items(), key=lambda kv: int(kv[0])):
            t, d = m["target"], m["drafter"]
            how = m["how"]
            lines.append(f"| {method} | {m['prompt_tokens']:,} | {mib(t, 'weights_bytes')} | {mib(t, 'state_bytes')} | "
                         f"{mib(t, 'working_bytes')} | {mib(d, 'weights_bytes')} | {mib(d, 'state_bytes')} | "
                         f"{mib(d, 'working_bytes')} |")
    if how:
        lines += ["", f"Working memory: {how}."]
    return "\n".join(lines) + "\n"


def protocol_markdown(report: dict) -> str:
    """How the timing was done: the method order of every repeat and hf_assisted's own draft policy."""
    m = report["manifest"]
    lines = ["## How it was timed", "", CONVENTIONS["timing"].replace("manifest.method_order", "below") + ".", ""]
    by_temp: dict[float, list[str]] = {}
    for o in m.get("method_order", []):
        by_temp.setdefault(o["temperature"], []).append(f"repeat {o['repeat'] + 1}: {', '.join(o['order'])}")
    for temp, orders in by_temp.items():
        lines.append(f"- T={temp:g}: " + "; ".join(orders))
    hf = m.get("hf_assisted_policy")
    if hf:
        src = hf.get("source", {})
        adapts = "tuned during each call" if hf.get("confidence_threshold_adapts") else "fixed: no scikit-learn"
        lines += ["", f"hf_assisted drafts with transformers' own policy, read from the drafter's generation_config: "
                      f"num_assistant_tokens {hf['num_assistant_tokens']} ({src.get('num_assistant_tokens')}), "
                      f"schedule {hf['num_assistant_tokens_schedule']}, assistant_confidence_threshold "
                      f"{hf['assistant_confidence_threshold']} ({adapts})."]
        if hf.get("at_end"):
            lines.append(f"After the run the drafter's generation_config held {hf['at_end']} (transformers' schedule "
                         "persists across calls within a pass; hf_assisted puts the starting value back before each "
                         "timed pass).")
    return "\n".join(lines)


def definitions_markdown() -> str:
    lines = ["## Definitions", ""]
    for key, name in MD_NAMES.items():
        if key != "timing":
            lines.append(f"- **{name}** (`{key}`): {CONVENTIONS[key]}.")
    lines.append("- **draft/verify/other %**: share of generate() wall time spent drafting, verifying "
                 "(target forwards) and elsewhere (sampling, bookkeeping); the rest up to 100 is prefill.")
    return "\n".join(lines)


PLOT_TITLES = {"plot_speedup": "Speedup over AR", "plot_tau_histogram": "Tokens per round (τ histogram)",
               "plot_acceptance": "Acceptance by draft position"}


def plots_markdown(plot_paths: dict[str, str]) -> str:
    """Links to every PNG written, relative to report.md (they sit in the same directory)."""
    if not plot_paths:
        return ""
    lines = ["## Plots", ""]
    for key, path in plot_paths.items():
        lines += [f"![{PLOT_TITLES.get(key, key)}]({Path(path).name})", ""]
    return "\n".join(lines)


def write_reports(report: dict, out_dir: str | Path, *, plots: bool = True) -> dict[str, str]:
    """Write report.json, the PNG plots and report.md (which links them) into out_dir; return their paths."""
    out = Path(out_dir).expanduser()  # as check_out checked it (a shell leaves --out=~/x unexpanded)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": str(out / "report.json"), "markdown": str(out / "report.md")}
    atomic_write_text(out / "report.json", json.dumps(report, indent=1, default=str) + "\n")
    plot_paths = {}
    from draftforge.eval.plots import PLOT_FILES, write_plots

    if plots:
        plot_paths = write_plots(report, out)
    else:  # an earlier report's plots (check_out: eval's own) would stand beside this one as if they were its
        for name in PLOT_FILES:
            (out / name).unlink(missing_ok=True)
    pace = [f"**Warning:** {report['pace_warning']}", ""] if report.get("pace_warning") else []
    md = ["# draftforge eval", "", heading_markdown(report), "", *pace, markdown_table(report), "", acceptance_markdown(report), "",
          category_markdown(report), "", category_cost_markdown(report), "", component_memory_markdown(report), plots_markdown(plot_paths), protocol_markdown(report), "", definitions_markdown(), "",
          "Command: `" + report["manifest"]["command"] + "`", ""]
    atomic_write_text(out / "report.md", "\n".join(md))
    paths.update(plot_paths)
    return paths
