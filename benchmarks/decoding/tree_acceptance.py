"""Acceptance of static trees vs a chain, without timing: τ over many prompts, with its standard error.

    python -m benchmarks.decoding.tree_acceptance --target DIR --drafter DIR --bench instructions \
        --tree stree13 --tree 6,1 --tree 12 --num-prompts 16 --out runs/tree_acceptance.json

τ needs no clock, so this runs more prompts than a timed eval can afford, which is what STree's τ claims
need (a 6-prompt timed eval moves τ by ±0.15 between runs at T = 1): the chain (--chain-length drafts),
each --tree at T = 0, and at each T > 0 with sibling drafts drawn distinct (without replacement) and i.i.d.
Every configuration decodes the same prompts with the same seeds (seed = prompt index, as `draftforge
eval` does). Prints τ (+bonus) = emitted tokens / rounds over all prompts with its standard error, and
τ − τ_chain. Rounds of one prompt are not independent (easy and hard prompts), so the standard errors
are over prompts: the ratio estimator's cluster s.e., and for differences (tree − chain, distinct −
i.i.d.) the s.e. of the per-prompt τ differences, paired on the same prompts. Writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from benchmarks.common import add_dtype_flag, add_flags, checked_args, load_models, number_list, print_table, write_json


def configs(trees: list[str], temperatures: list[float], chain_length: int):
    """(label, method, options, T, tree_draws): the chain per T, each tree at T = 0 and with both draws at T > 0."""
    from draftforge.decode import parse_tree

    out = []
    for t in temperatures:
        out.append((f"chain {chain_length}", "chain", {"chain_length": chain_length}, t, "distinct"))
        for tree in trees:
            draws = ["distinct"] if t == 0 else ["distinct", "iid"]
            out += [(f"tree {tree}", "tree", {"tree": parse_tree(tree)}, t, d) for d in draws]
    return out


def measure(target, drafter, prompts, method, options, temperature, draws, max_new_tokens) -> dict:
    from draftforge.decode import build_decoder

    dec = build_decoder(method, target, drafter, **options)
    emitted, rounds = [], []  # per prompt: tokens emitted (accepted drafts + bonus/correction) and rounds
    for i, ids in enumerate(prompts):
        res = dec.generate(list(ids), max_new_tokens=max_new_tokens, temperature=temperature, seed=i,
                           eos_token_id=[], tree_draws=draws)
        emitted.append(sum(res.stats.accepted_per_round) + len(res.stats.accepted_per_round))
        rounds.append(len(res.stats.accepted_per_round))
    return {"tau": sum(emitted) / sum(rounds), "sem": ratio_sem(emitted, rounds), "rounds": sum(rounds),
            "per_prompt": {"emitted": emitted, "rounds": rounds}}


def ratio_sem(num: list[float], den: list[float]) -> float:
    """Cluster standard error of sum(num) / sum(den) over n clusters (prompts)."""
    n, r = len(num), sum(num) / sum(den)
    if n < 2:
        return float("nan")
    return (n / (n - 1) * sum((a - r * b) ** 2 for a, b in zip(num, den))) ** 0.5 / sum(den)


def paired(a: dict, b: dict) -> tuple[float, float]:
    """Mean and s.e. of per-prompt τ(a) − τ(b) on the same prompts."""
    diffs = [ea / ra - eb / rb for ea, ra, eb, rb in zip(a["per_prompt"]["emitted"], a["per_prompt"]["rounds"],
                                                        b["per_prompt"]["emitted"], b["per_prompt"]["rounds"])]
    sem = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
    return statistics.fmean(diffs), sem


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--bench", required=True, help="prompt file or a named bench (instructions, humaneval)")
    p.add_argument("--tree", action="append", required=True, help="a static tree (widths, parents:..., stree13); repeat")
    p.add_argument("--chain-length", type=int, default=4)
    p.add_argument("--temperatures", type=number_list(float, 0), default="0,1", help="comma list (default 0,1)")
    add_flags(p, num_prompts=16, max_new_tokens=64, out="runs/tree_acceptance.json")
    add_dtype_flag(p)
    a = checked_args(p, argv)
    from draftforge.data.prompts import load_prompts

    target, drafter = load_models(a)
    prompts = [q.input_ids for q in load_prompts(a.bench, target.tokenizer, num_prompts=a.num_prompts)]
    temps = list(a.temperatures)
    rows, t0 = [], time.perf_counter()
    todo = configs(a.tree, temps, a.chain_length)
    for k, (label, method, options, temp, draws) in enumerate(todo, 1):
        with torch.inference_mode():
            r = measure(target, drafter, prompts, method, options, temp, draws, a.max_new_tokens)
        rows.append({"config": label, "temperature": temp, "tree_draws": draws if method == "tree" else None, **r})
        print(f"[{k}/{len(todo)} {time.perf_counter() - t0:.0f}s] {label} T={temp:g} {draws}: τ {r['tau']:.3f} "
              f"± {r['sem']:.3f} ({r['rounds']} rounds)", file=sys.stderr, flush=True)
    chain = {r["temperature"]: r for r in rows if r["config"].startswith("chain")}
    iid = {(r["config"], r["temperature"]): r for r in rows if r["tree_draws"] == "iid"}
    for r in rows:
        r["tau_minus_chain"] = r["tau"] - chain[r["temperature"]]["tau"]
        r["paired_minus_chain"] = paired(r, chain[r["temperature"]])
        twin = iid.get((r["config"], r["temperature"])) if r["tree_draws"] == "distinct" else None
        r["paired_distinct_minus_iid"] = paired(r, twin) if twin else None

    def pm(row, key):
        pair = row[key]
        return "–" if pair is None or row["config"].startswith("chain") else f"{pair[0]:+.2f} ± {pair[1]:.2f}"

    print_table(["config", "T", "siblings", "τ (+bonus) ± s.e.", "τ − τ_chain (paired)", "distinct − iid (paired)",
                 "rounds"],
                [[r["config"], f"{r['temperature']:g}", r["tree_draws"] or "–", f"{r['tau']:.2f} ± {r['sem']:.2f}",
                  pm(r, "paired_minus_chain"), pm(r, "paired_distinct_minus_iid"), r["rounds"]] for r in rows])
    result = {"target": a.target, "drafter": a.drafter, "bench": a.bench, "num_prompts": len(prompts),
              "max_new_tokens": a.max_new_tokens, "threads": torch.get_num_threads(), "rows": rows}
    return write_json(a.out, result)


if __name__ == "__main__":
    main()
