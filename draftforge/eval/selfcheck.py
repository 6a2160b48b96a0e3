"""The T=0 self-check: each prompt's speculative output against AR's in the same run, and, where they differ,
whether the difference is rounding (a near-tie) or a defect.

A multi-row forward (a verification) sums in another order than a one-row forward (an AR step), and the
KV entries it leaves differ in the same way, so in reduced precision the same position gets slightly
different logits, and where two tokens are within that difference of each other the two decodes may
legitimately part. At the first differing position we measure that difference on the very prefix: AR's
own logits there (prompt prefill, then one row per generated token, exactly as AR ran) against the same
logits computed in chunks (the prefix prefilled at once, then a verification of each row count the method
used), noise = max |Δlogit| over the vocabulary and those computations. AR chose a, the method b in a
computation within `noise` of AR's, so a flip needs l(a) − l(b) ≤ 2·noise; logits are rounded to the
model's dtype, so one rounding step (2 eps · |logit|) is the least tolerance. Inside it is a **near-tie**,
outside a **defect** (the harness changed the output). fp32 stays bitwise: any difference fails the run.
Each turn of a multi-turn question is a prompt of its own, compared only where its context (the conversation
with the method's own earlier answers) is AR's: after an earlier turn's near-tie it is not (`context_differs`).

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


@torch.inference_mode()
def ar_logits(target, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """Logits [V] after prompt + generated, computed as AR computes them: one row per generated token."""
    target.prefill(prompt)
    last = prompt[-1]
    for tok in generated:
        target.verify(last, chain_tree([]))
        target.commit([])
        last = tok
    logits_NV = target.verify(last, chain_tree([]))
    target.commit([])
    return logits_NV[0].float().cpu()


def rounding_step(target, logit: float) -> float:
    """Twice the spacing of the model dtype's numbers at |logit| (logits come out rounded to it)."""
    model = getattr(target, "model", None)
    dtype = next(model.parameters()).dtype if model is not None else torch.float32
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps
    return 2 * eps * max(1.0, abs(logit))


def rows_to_probe(records) -> list[int]:
    """Row counts a method verified: 2, its median and its largest (root included)."""
    rows = [d + 1 for r in records for d in r.stats.drafted_per_round if d > 0]
    if not rows:
        return [2]
    return sorted({2, int(statistics.median(rows)), max(rows)})


def classify(target, prompt: list[int], generated: list[int], ar_token: int, other: int | None,
             rows: list[int]) -> dict:
    """The evidence at one divergence: logit gap of the two tokens, top-2 margin, measured noise, verdict."""
    prefix = prompt + generated
    ar_V = ar_logits(target, prompt, generated)
    probes = sorted({1, *rows, len(prefix)})
    noise = max(float((ar_V - logits_after(target, prefix, n)).abs().max()) for n in probes)
    top2 = torch.topk(ar_V, 2).values
    out = {"ar_token": ar_token, "other_token": other, "noise": noise, "rows_probed": probes,
           "top2_margin": float(top2[0] - top2[1])}
    if other is None:  # one output stopped early: no rounding explains a missing token
        return {**out, "gap": None, "tolerance": None, "verdict": "defect"}
    gap = float(ar_V[ar_token] - ar_V[other])
    tolerance = max(2 * noise, rounding_step(target, float(ar_V[ar_token])))
    return {**out, "gap": gap, "tolerance": tolerance, "verdict": "near_tie" if abs(gap) <= tolerance else "defect"}


def _key(record) -> tuple[str, int]:
    return record.prompt_id, record.turn


def _label(key: tuple[str, int]) -> str:
    """A prompt's id, or "id#turnK" for a later turn of a multi-turn question."""
    return key[0] if key[1] == 0 else f"{key[0]}#turn{key[1] + 1}"


def self_check(records, ar_records, prompt_ids: dict[str, list[int]], target=None) -> dict:
    """Prompts (each turn of a multi-turn one counted alone) identical to AR in every repeat, and each differing
    one classified (needs `target`).

    Only a prompt's first differing record is examined: after it the two contexts differ anyway. A later turn is
    compared only when its context (the conversation with the method's own earlier answers) is AR's; where an
    earlier turn parted from AR it is not, and the turn counts under `context_differs`, neither identical nor a
    defect (the earlier turn's own verdict says why)."""
    ar_by_key = {}
    for r in ar_records:
        ar_by_key.setdefault(_key(r), r)
    identical: dict[tuple[str, int], bool] = {}
    other_context: set[tuple[str, int]] = set()
    divergences = []
    rows = rows_to_probe(records)
    for r in records:
        key, ar = _key(r), ar_by_key.get(_key(r))
        if ar is None:
            continue
        if r.context != ar.context:  # a later turn whose conversation already parted from AR's
            other_context.add(key)
            continue
        ref, same = ar.tokens, r.tokens == ar.tokens
        if not same and identical.get(key, True):
            i = first_divergence(ref, r.tokens)
            found = {"prompt_id": r.prompt_id, "turn": key[1], "repeat": r.repeat, "position": i}
            if target is not None and i < len(ref):
                other = r.tokens[i] if i < len(r.tokens) else None
                context = prompt_ids[r.prompt_id] if r.context is None else r.context
                found.update(classify(target, context, ref[:i], ref[i], other, rows))
            else:
                found["verdict"] = "unchecked" if target is None else "defect"
            divergences.append(found)
        identical[key] = identical.get(key, True) and same
    verdicts = [d["verdict"] for d in divergences]
    return {"identical": sum(identical.values()), "total": len(identical),
            "near_ties": verdicts.count("near_tie"), "defects": verdicts.count("defect"),
            "context_differs": len(other_context - set(identical)),
            "mismatched_prompts": [_label((d["prompt_id"], d["turn"])) for d in divergences],
            "divergences": divergences, "near_tie_checked": target is not None}
