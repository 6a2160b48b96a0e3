"""The cost model of every eval: the target's measured verification curve t(N) and the speedup it predicts.

Before the timed runs, one verification forward of N rows (the last committed token + N-1 drafts, as a
chain, on top of a real prompt's cache) is timed for every row count the methods will verify, N = 1
included, after a warm-up pass, shapes interleaved, median of `repeats`. For each method the report then
puts the predicted speedup next to the measured one:

    predicted = τ · t(1) / (mean over rounds of t(N_r) + draft seconds per round)

τ, N_r (1 + the drafts verified in round r) and the draft seconds come from the method's own rounds; t
from the curve (linear between measured points; a row count past the grid's largest is timed after the runs).
AR predicts 1 by construction. What the model leaves out is why measured can fall short of predicted: the
prefill and the harness's bookkeeping (the report's "other" share), and inside each round's verify time the
verdict, the sampling and the commit (a hybrid's state replay, a KV gather), which t(N), timing the forward alone,
does not hold. (STree, arXiv:2505.14969 §4, models a hybrid's t(N)
the same way.)

Attention's share of a verification grows with the context, so t(N)/t(1) does too (SmolLM2 in bf16 on one CPU
thread: a chain of 5 costs 1.29·t(1) at 1k tokens and 2.11·t(1) at 8k). A bench whose prompts span several length
buckets (`length_bucket`: powers of two from MIN_BUCKET tokens up) gets one curve per bucket, timed on its first
prompt, and every record is priced with its own bucket's curve.

A chain's rounds also say what a shorter chain would have done: a draft at depth d is accepted or not by the
same test whatever follows it (greedy match, or speculative sampling's min(1, p/q), arXiv:2211.17192 §2.3),
so cutting round r at γ' keeps min(a_r, γ') accepted drafts and one bonus/correction token, verifies
min(d_r, γ') + 1 rows and drafts min(d_r, γ') steps; a decode then needs more rounds for its tokens, while a
drafter's once-per-decode work (its prompt encoding, inside its first draft) does not shrink with γ'.
`shorter_chains` predicts every γ' up to the chain's length from those rounds; with a weak drafter a short chain
often wins, because drafting and the rising part of t(N) cost more than the drafts that are rarely reached bring.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from draftforge.eval.metrics import emitted_per_round
from draftforge.eval.selfcheck import chain_tree

GRID = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)


def _clock(device) -> float:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


SAMPLE_S = 0.005  # a timed sample of t(N) spans at least this long (tiny models: several verifications averaged)


@torch.inference_mode()
def verify_curve(target, prompt_ids: list[int], rows: list[int], repeats: int = 5) -> dict[int, float]:
    """Median seconds of one verification of N rows, for each N in `rows`. The first pass is untimed: per row
    count a cold call, then one that sets how many verifications each sample averages (enough to span SAMPLE_S: a
    sub-millisecond forward timed once is mostly clock and scheduler noise; a cold first call would set that to
    one); row counts are rotated across passes.

    Each verification keeps one row (the root), so the context grows by a token per call; the prompt is encoded
    again once it has grown by more than 1/64 of its length (or 1 token), not before every call: at 8k tokens a
    prefill costs ~600 verifications.

    A target that shares work with its drafter (`stage_drafted`: EESD's split target, whose drafting already ran
    layers 1..N over the round's rows) is given what drafting leaves before each timed verification, untimed: its
    curve is then the verification's own cost, not the whole target's."""
    rows = sorted(set(rows))
    times: dict[int, list[float]] = {n: [] for n in rows}
    calls = {n: 1 for n in rows}
    device = target.device
    stage = getattr(target, "stage_drafted", None)
    grown = [None]  # tokens kept since the last prefill (None: no prefill yet)
    regrow = max(1, len(prompt_ids) // 64)

    def once(n: int) -> float:
        if grown[0] is None or grown[0] >= regrow:
            target.prefill(prompt_ids)
            grown[0] = 0
        drafts = [prompt_ids[-1]] * (n - 1)
        if stage is not None:
            stage(prompt_ids[-1], drafts)
        t0 = _clock(device)
        target.verify(prompt_ids[-1], chain_tree(drafts))
        dt = _clock(device) - t0
        target.commit([])
        grown[0] += 1
        return dt

    for rep in range(repeats + 1):
        order = rows[rep % len(rows):] + rows[: rep % len(rows)]  # no row count always first
        for n in order:
            if not rep:  # a first call of a shape pays one-time costs (allocation, kernel choice, CUDA setup)
                once(n)
                calls[n] = max(1, min(50, math.ceil(SAMPLE_S / max(once(n), 1e-6))))
                continue
            times[n].append(sum(once(n) for _ in range(calls[n])) / calls[n])
    return {n: statistics.median(v) for n, v in times.items()}


MIN_BUCKET = 512  # prompts up to this many tokens share one curve


def length_bucket(n_tokens: int) -> int:
    """The context-length bucket a prompt of `n_tokens` is priced in: the power of two at or above it, at least
    MIN_BUCKET (513..1024 -> 1024, 1025..2048 -> 2048, every prompt up to 512 tokens -> 512)."""
    return max(MIN_BUCKET, 1 << max(0, n_tokens - 1).bit_length())


def bucket_prompts(lengths: list[int]) -> dict[int, int]:
    """bucket -> index of its first prompt, for prompts of these token counts (in bench order)."""
    out: dict[int, int] = {}
    for i, n in enumerate(lengths):
        out.setdefault(length_bucket(n), i)
    return out


def curve_for(by_length: dict[int, dict[int, float]], n_tokens: int) -> dict[int, float]:
    """The curve of the bucket of `n_tokens`; a context in no timed bucket (a later turn grown past its first) gets
    the nearest timed bucket below it, else the smallest."""
    b = length_bucket(n_tokens)
    if b in by_length:
        return by_length[b]
    below = [k for k in by_length if k < b]
    return by_length[max(below) if below else min(by_length)]


def t_of(curve: dict[int, float], n: int) -> float:
    """t(n) from the measured curve: exact where measured, linear between neighbours, else the nearest end."""
    if n in curve:
        return curve[n]
    xs = sorted(curve)
    lo = max((x for x in xs if x < n), default=None)
    hi = min((x for x in xs if x > n), default=None)
    if lo is None or hi is None:
        return curve[lo if hi is None else hi]
    w = (n - lo) / (hi - lo)
    return (1 - w) * curve[lo] + w * curve[hi]


def rows_per_round(records) -> list[int]:
    """1 + the drafts verified, for every round of every record."""
    out = []
    for r in records:
        drafted = r.stats.drafted_per_round or [0] * r.stats.target_forwards
        out += [d + 1 for d in drafted]
    return out


def missing_rows(curve: dict[int, float], records) -> list[int]:
    """Row counts the methods verified beyond the measured grid (timed after the runs)."""
    return sorted({n for n in rows_per_round(records) if n > max(curve)})


def _rounds(records, curve, by_length, verify=None) -> list[tuple[dict, int, int]]:
    """(curve, accepted, drafted) for every round of every record; the curve is `verify` when given (a method whose
    target shares work with its drafter), else the record's length bucket's when `by_length` has several, else
    `curve`."""
    out = []
    for r in records:
        c = verify or (curve_for(by_length, r.prompt_len) if by_length and len(by_length) > 1 else curve)
        drafted = r.stats.drafted_per_round or [0] * r.stats.target_forwards
        accepted = list(r.stats.accepted_per_round)[:len(drafted)]
        out += [(c, a, d) for a, d in zip(accepted + [0] * (len(drafted) - len(accepted)), drafted)]
    return out


def _t1(records, curve, by_length) -> float:
    """t(1) the AR baseline pays per token: the curve's, or, over several buckets, the records' new tokens'
    average of their own buckets' t(1) (what AR would have spent on the same tokens, per token)."""
    if not by_length or len(by_length) <= 1:
        return curve[1]
    tokens = sum(r.stats.new_tokens for r in records)
    if not tokens:
        return curve[1]
    return sum(r.stats.new_tokens * curve_for(by_length, r.prompt_len)[1] for r in records) / tokens


def predict(summary: dict, records, curve: dict[int, float],
            by_length: dict[int, dict[int, float]] | None = None, verify: dict[int, float] | None = None) -> dict:
    """Predicted vs measured speedup of one method at one temperature (records: its rounds). With `by_length`
    (bucket -> curve, several buckets) each round is priced at its prompt's bucket, and `by_length` in the
    result gives the prediction and the best chain length per bucket. `verify`: the method's own verification
    curve (EESD's layers N+1..L after drafting), pricing its rounds; t(1), AR's cost a token, stays `curve`'s."""
    if verify and by_length and len(by_length) > 1:
        verify = None  # timed at the first prompt's length only: the buckets' plain curves price it
    rounds_cad = _rounds(records, curve, by_length, verify)
    rounds = len(rounds_cad)
    if not rounds or 1 not in curve:
        return {}
    t1 = _t1(records, curve, by_length)
    verify_s = statistics.fmean(t_of(c, d + 1) for c, _, d in rounds_cad)
    draft_s = summary["time"]["draft_s"] / rounds
    steps = sum(sum(r.stats.proposed_by_position) for r in records) / rounds
    tau = summary["tau"] or 0.0
    predicted = tau * t1 / (verify_s + draft_s)
    measured = summary.get("speedup")
    decode = summary.get("decode_speedup")
    shorter = shorter_chains(records, curve, by_length, verify)
    out = {
        "tau": tau, "rows_per_round": statistics.fmean(d + 1 for _, _, d in rounds_cad), "verify_s_per_round": verify_s,
        "verify_over_t1": verify_s / t1, "draft_steps_per_round": steps, "draft_s_per_round": draft_s,
        "draft_step_s": draft_step_s(records) if steps else None, "predicted_speedup": predicted,
        "measured_speedup": measured,
        "measured_over_predicted": measured / predicted if measured and predicted else None,
        "measured_decode_speedup": decode,
        "decode_over_predicted": decode / predicted if decode and predicted else None,
        "shorter_chains": shorter,
        "best_chain_length": max(shorter, key=shorter.get) if shorter else None,
        "verify_curve": "own" if verify else "target",
    }
    if by_length and len(by_length) > 1:
        out["by_length"] = {}
        for b in sorted(by_length):
            mine = [r for r in records if curve_for(by_length, r.prompt_len) is by_length[b]]
            n_rounds = sum(len(r.stats.drafted_per_round or [0] * r.stats.target_forwards) for r in mine)
            if not n_rounds:
                continue
            own = {"tau": sum(r.stats.new_tokens for r in mine) / n_rounds,
                   "time": {"draft_s": sum(r.stats.draft_time_s for r in mine)}}
            one = predict(own, mine, by_length[b])
            out["by_length"][b] = {k: one[k] for k in ("tau", "verify_over_t1", "predicted_speedup",
                                                       "shorter_chains", "best_chain_length")}
            out["by_length"][b]["t1_s"] = by_length[b][1]
    return out


def draft_costs(records) -> tuple[float, float]:
    """(seconds of one drafter step, seconds per decode that no step accounts for). A drafter with a cache or a
    state encodes the prompt inside its first draft, once per decode whatever the chain length: the step is the
    later rounds' drafting time over their steps, and what the first round took beyond its steps at that rate is
    the decode's fixed cost. Without a recorded first round (transformers' assisted generation), or with no later
    steps, all drafting is per step (0, 0: nothing drafted)."""
    steps = sum(sum(r.stats.proposed_by_position) for r in records)
    total = sum(r.stats.draft_time_s for r in records)
    split = [r for r in records if r.stats.first_draft_time_s > 0]
    later_steps = steps - sum(r.stats.first_draft_depth for r in split)
    if not split or later_steps <= 0:
        return (total / steps if steps else 0.0), 0.0
    step = (total - sum(r.stats.first_draft_time_s for r in split)) / later_steps
    fixed = sum(max(r.stats.first_draft_time_s - step * r.stats.first_draft_depth, 0.0) for r in split)
    return step, fixed / len(records)


def draft_step_s(records) -> float:
    """Seconds of one drafter step (draft_costs)."""
    return draft_costs(records)[0]


def shorter_chains(records, curve: dict[int, float], by_length: dict[int, dict[int, float]] | None = None,
                   verify: dict[int, float] | None = None) -> dict[int, float]:
    """γ' -> predicted speedup of the same rounds cut at γ' (module docstring), for every γ' up to the longest
    chain drafted; {} unless every round drafted a chain (as many drafts as depths) and some drafted 2 or more.
    With `by_length` every round is priced at its own bucket's curve, as in `predict`. A cut chain emits fewer
    tokens a round, so a decode takes more rounds: each round's cost is paid per τ(γ') tokens, and the drafter's
    cost per decode (its prompt encoding: draft_costs) per decode's tokens, whatever γ'."""
    rounds = _rounds(records, curve, by_length, verify)
    proposed = sum(sum(r.stats.proposed_by_position) for r in records)
    longest = max((d for _, _, d in rounds), default=0)
    if longest < 2 or proposed != sum(d for _, _, d in rounds) or 1 not in curve:
        return {}
    t1 = _t1(records, curve, by_length)
    step_s, fixed_s = draft_costs(records)
    fixed_per_token = fixed_s * len(records) / max(sum(r.stats.new_tokens for r in records), 1)
    emitted = []  # per round, what it emitted: a + 1, or less in a decode's last round (an EOS draft, the budget)
    for r in records:
        n = len(r.stats.drafted_per_round or [0] * r.stats.target_forwards)
        e = emitted_per_round(r.stats)[:n]
        emitted += e + [1] * (n - len(e))
    out = {}
    for g in range(1, longest + 1):
        # cut at g: a round that accepted more keeps g drafts + the target's token (no more than it emitted); one
        # that accepted g or fewer is unchanged, its EOS or budget cut included
        tau = statistics.fmean(e if a <= g else min(g + 1, e) for (_, a, _), e in zip(rounds, emitted))
        cost_s = statistics.fmean(t_of(c, min(d, g) + 1) + step_s * min(d, g) for c, _, d in rounds)
        out[g] = t1 / (cost_s / tau + fixed_per_token)
    return out


def curve_markdown(cost: dict) -> list[str]:
    """The verification curve as a table row pair: N, ms, t(N)/t(1)."""
    curve = {int(k): v for k, v in cost["curve_s"].items()}
    if not curve:
        return []
    t1 = curve.get(1)
    ns = sorted(curve)
    head = "| N rows | " + " | ".join(str(n) for n in ns) + " |"
    ms = "| ms | " + " | ".join(f"{curve[n] * 1e3:.1f}" for n in ns) + " |"
    rel = "| t(N)/t(1) | " + " | ".join(f"{curve[n] / t1:.2f}" if t1 else "–" for n in ns) + " |"
    lines = [f"Target verification cost, measured before the runs ({cost['what']}):", "", head,
             "|" + "---|" * (len(ns) + 1), ms, rel]
    by_length = {int(b): {int(k): v for k, v in c.items()} for b, c in (cost.get("curves_by_length_s") or {}).items()}
    if by_length:
        tokens = {int(b): n for b, n in (cost.get("bucket_prompt_tokens") or {}).items()}
        ns = sorted(set().union(*by_length.values()))
        lines += ["", "t(N)/t(1) per context length (each bucket's first prompt; every record is priced at its own "
                      "bucket's curve):", "",
                  "| context bucket | prompt tokens | t(1) ms | " + " | ".join(f"N={n}" for n in ns) + " |",
                  "|" + "---|" * (len(ns) + 3)]
        for b in sorted(by_length):
            c = by_length[b]
            lines.append(f"| ≤{b} | {tokens.get(b, '–')} | {c[1] * 1e3:.1f} | "
                         + " | ".join(f"{c[n] / c[1]:.2f}" if n in c else "–" for n in ns) + " |")
    return lines


def prediction_markdown(results: list[dict]) -> list[str]:
    rows = [r for r in results if r.get("cost_model")]
    if not rows:
        return []
    lines = ["Cost model: predicted = τ·t(1) / (t(N) averaged over rounds + draft s per round), the decoding "
             "steps only. Measured is given end to end · decoding only: end to end adds the prefill, which the "
             "prediction leaves out and no drafter shortens; what remains between decoding only and the prediction "
             "is sampling, bookkeeping and the drift of t(1) between the curve and the runs.", "",
             "| method | T | τ | rows / round | t(N)/t(1) | draft steps / round | draft ms / step | predicted | "
             "measured | measured / predicted |", "|---|---|---|---|---|---|---|---|---|---|"]

    def pair(end_to_end, decoding, unit=""):
        if not end_to_end:
            return "–"
        return f"{end_to_end:.2f}{unit}" + (f" · {decoding:.2f}{unit}" if decoding else "")

    for r in rows:
        c = r["cost_model"]
        step = f"{c['draft_step_s'] * 1e3:.2f}" if c.get("draft_step_s") else "–"
        meas = pair(c.get("measured_speedup"), c.get("measured_decode_speedup"), "×")
        ratio = pair(c.get("measured_over_predicted"), c.get("decode_over_predicted"))
        name = r["method"] + (" (own t(N))" if c.get("verify_curve") == "own" else "")  # EESD's split target
        lines.append(f"| {name} | {r['temperature']:g} | {c['tau']:.2f} | {c['rows_per_round']:.1f} | "
                     f"{c['verify_over_t1']:.2f} | {c['draft_steps_per_round']:.1f} | {step} | "
                     f"{c['predicted_speedup']:.2f}× | {meas} | {ratio} |")
    cut = [r for r in rows if r["cost_model"].get("shorter_chains")]
    if cut:
        lines += ["", "The same chain rounds cut at γ' drafts (predicted speedup; the best γ' in bold):", ""]
        for r in cut:
            c = r["cost_model"]
            best = c["best_chain_length"]
            each = ", ".join((f"**{g}: {v:.2f}×**" if int(g) == best else f"{g}: {v:.2f}×")
                             for g, v in c["shorter_chains"].items())
            lines.append(f"- {r['method']} T={r['temperature']:g}: {each}")
    per = [r for r in rows if r["cost_model"].get("by_length")]
    if per:
        lines += ["", "Per context length (the same model, each bucket's rounds at its own curve):", "",
                  "| method | T | context bucket | τ | t(N)/t(1) | predicted | best γ' (predicted) |",
                  "|---|---|---|---|---|---|---|"]
        for r in per:
            for b, c in r["cost_model"]["by_length"].items():
                best, cut = c.get("best_chain_length"), {int(g): v for g, v in (c.get("shorter_chains") or {}).items()}
                gain = f"{best} ({cut[int(best)]:.2f}×)" if best else "–"
                lines.append(f"| {r['method']} | {r['temperature']:g} | ≤{b} | {c['tau']:.2f} | "
                             f"{c['verify_over_t1']:.2f} | {c['predicted_speedup']:.2f}× | {gain} |")
    return lines


PACE_TOLERANCE = 1.15  # AR's passes, or t(1) before and after, further apart than this: the report says so


def pace_warning(records, after: dict | None) -> str | None:
    """One line when the machine's pace moved more than a comparison of methods timed at different moments can
    absorb: AR's tokens/s over its timed passes at one temperature (its repeats: the same work each time; another
    temperature decodes other tokens, to other lengths) spread by more than PACE_TOLERANCE at any temperature, or
    t(1) re-timed after the runs off by as much. None when it held still."""
    passes: dict[tuple, list[float]] = {}
    for r in records:
        if r.method == "ar":
            passes.setdefault((r.temperature, r.repeat), [0, 0.0])
            passes[(r.temperature, r.repeat)][0] += r.stats.new_tokens
            passes[(r.temperature, r.repeat)][1] += r.stats.total_time_s
    by_temperature: dict[float, list[float]] = {}
    for (temperature, _), (n, secs) in sorted(passes.items()):
        if secs > 0 and n > 0:  # a pass that emitted nothing has no pace
            by_temperature.setdefault(temperature, []).append(n / secs)
    found = []
    spreads = {t: max(rates) / min(rates) for t, rates in by_temperature.items() if len(rates) > 1}
    if spreads and max(spreads.values()) > PACE_TOLERANCE:
        t = max(spreads, key=spreads.get)
        rates = by_temperature[t]
        found.append(f"AR at T = {t:g} ran at {min(rates):.1f}–{max(rates):.1f} tok/s over its {len(rates)} timed "
                     f"passes ({spreads[t]:.2f}×)")
    if after and after.get("t1_s") and after.get("t1_before_s"):
        ratio = after["t1_s"] / after["t1_before_s"]
        if not 1 / PACE_TOLERANCE <= ratio <= PACE_TOLERANCE:
            found.append(f"t(1) was {after['t1_before_s'] * 1e3:.1f} ms before the runs and "
                         f"{after['t1_s'] * 1e3:.1f} ms after ({ratio - 1:+.0%})")
    if not found:
        return None
    return ("the machine's pace moved during this run: " + "; ".join(found) + ". Speedups of methods timed at "
            "different moments can be off by as much: re-run on a quiet machine, or with more --repeats.")
