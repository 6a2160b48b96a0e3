"""The T=0 self-check: each prompt's speculative output against AR's in the same run, and, where they differ,
whether the difference is rounding (a near-tie) or a defect.

A multi-row forward (a verification) sums in another order than a one-row forward (an AR step), so in
reduced precision the same position gets slightly different logits, and where two tokens are within that
difference of each other the two decodes may legitimately part. At the first differing position we
measure that difference on the very prefix: the logits after it computed with one row and with the row
counts the method verified (target.prefill + target.verify of a chain), noise = max |Δlogit| over the
vocabulary. AR chose a where a's logit beat b's in its computation, the method chose b in its own; each
computation is within `noise` of the one-row logits, so a flip needs |l(a) − l(b)| ≤ 2·noise: inside that
it is a **near-tie**, outside it a **defect** (the harness changed the output). fp32 stays bitwise:
there any difference fails the run.

Legend: V vocabulary.
"""

from __future__ import annotations

import statistics

import torch

from draftforge.decode.tree import DraftTree


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, len(shorter) if one is a strict prefix, None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def chain_tree(tokens: list[int]) -> DraftTree:
    n = len(tokens)
    return DraftTree(list(tokens), list(range(-1, n - 1)), list(range(1, n + 1)), is_chain=True)


@torch.inference_mode()
def logits_after(target, prefix: list[int], rows: int) -> torch.Tensor:
    """Logits [V] of the token after `prefix`, from a verification forward of `rows` rows (1 = an AR step)."""
    rows = max(1, min(rows, len(prefix)))
    seq = prefix[: len(prefix) - rows + 1]
    target.prefill(seq)
    logits_NV = target.verify(seq[-1], chain_tree(prefix[len(seq):]))
    target.commit([])
    return logits_NV[-1].float().cpu()


def rows_to_probe(records) -> list[int]:
    """Row counts a method verified: 2, its median and its largest (root included)."""
    rows = [d + 1 for r in records for d in r.stats.drafted_per_round if d > 0]
    if not rows:
        return [2]
    return sorted({2, int(statistics.median(rows)), max(rows)})


def classify(target, prefix: list[int], ar_token: int, other: int | None, rows: list[int]) -> dict:
    """The evidence at one divergence: logit gap of the two tokens, top-2 margin, measured noise, verdict."""
    one_V = logits_after(target, prefix, 1)
    noise = max((float((one_V - logits_after(target, prefix, n)).abs().max()) for n in rows if n > 1), default=0.0)
    top2 = torch.topk(one_V, 2).values
    out = {"ar_token": ar_token, "other_token": other, "noise": noise, "rows_probed": rows,
           "top2_margin": float(top2[0] - top2[1])}
    if other is None:  # one output stopped early: no rounding explains a missing token
        return {**out, "gap": None, "verdict": "defect"}
    gap = float(one_V[ar_token] - one_V[other])
    return {**out, "gap": gap, "verdict": "near_tie" if abs(gap) <= 2 * noise else "defect"}


def self_check(records, ar_records, prompt_ids: dict[str, list[int]], target=None) -> dict:
    """Prompts identical to AR in every repeat, and each differing prompt classified (needs `target`).

    Only a prompt's first differing record is examined: after it the two contexts differ anyway."""
    ar_by_prompt = {}
    for r in ar_records:
        ar_by_prompt.setdefault(r.prompt_id, r.tokens)
    identical: dict[str, bool] = {}
    divergences = []
    rows = rows_to_probe(records)
    for r in records:
        ref = ar_by_prompt.get(r.prompt_id)
        if ref is None:
            continue
        same = r.tokens == ref
        if not same and identical.get(r.prompt_id, True):
            i = first_divergence(ref, r.tokens)
            found = {"prompt_id": r.prompt_id, "repeat": r.repeat, "position": i}
            if target is not None and i < len(ref):
                other = r.tokens[i] if i < len(r.tokens) else None
                found.update(classify(target, prompt_ids[r.prompt_id] + ref[:i], ref[i], other, rows))
            else:
                found["verdict"] = "unchecked" if target is None else "defect"
            divergences.append(found)
        identical[r.prompt_id] = identical.get(r.prompt_id, True) and same
    verdicts = [d["verdict"] for d in divergences]
    return {"identical": sum(identical.values()), "total": len(identical),
            "near_ties": verdicts.count("near_tie"), "defects": verdicts.count("defect"),
            "mismatched_prompts": [d["prompt_id"] for d in divergences], "divergences": divergences,
            "near_tie_checked": target is not None}
