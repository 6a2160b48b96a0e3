"""Distillation losses aimed at acceptance, on a teacher's full distribution or on its cached top-K.

KL (forward, at a temperature), TVD = 1 − Σ min(p, q) (one minus the acceptance α of speculative sampling at T=1,
arXiv:2211.17192 §3.2) and CE on the target's top-1; on a cached top-K each is taken over the K cached ids plus one
tail bucket, which makes the cached KL and TVD lower bounds of the exact ones (TVD within m̃, the tail mass; KL
has no bound in m̃ alone), the cached α an upper bound, and CE on the top-1 exact. The notation, the K+1-outcome forms and the derivation of the bounds: docs/methods/distill.md.

Legend: P kept positions, S student vocabulary (V, or N for a reduced head), K cached top-k, B batch, T block,
A chain anchors, G draft depth γ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GAMMA = 5  # the chain length the acceptance metrics imply τ for
NEG_INF = float("-inf")


# ---------------------------------------------------------------- full distributions (teacher forward)

def kl_full(student_PS, teacher_PS, temperature: float = 1.0):
    """Per-position τ²·KL(softmax(t/τ) ‖ softmax(s/τ)) (fp32)."""
    t_logp_PS = (teacher_PS.float() / temperature).log_softmax(-1)
    s_logq_PS = (student_PS.float() / temperature).log_softmax(-1)
    return _kl_terms(t_logp_PS, s_logq_PS).sum(-1) * temperature**2


def _kl_terms(lp_PS, lq_PS):
    """p·(log p − log q) per entry, 0 where p = 0: a teacher logit of −inf (a masked or padded id) has no mass, and
    0·(−inf − log q) would otherwise be NaN."""
    p_PS = lp_PS.exp()
    return torch.where(p_PS > 0, p_PS * (lp_PS - lq_PS), 0.0)


CHUNK_BYTES = 1 << 24  # fp32 [rows, S] temporaries per chunk of full_terms: 16 MiB


def full_terms(student_PS, teacher_PS, temperature: float = 1.0, teacher_lZ_P=None) -> dict[str, torch.Tensor]:
    """Per-position kl (at τ, times τ²), tvd, ce_target and alpha (all three at T=1) of full distributions.

    teacher_PS: the teacher's logits over S; for a reduced head its logits at the draft ids, with teacher_lZ_P
    the log-normaliser of its logits over the whole vocabulary (α takes the unrestricted p); None: S is V.

    Positions are taken CHUNK_BYTES of fp32 rows at a time (every term is per row, so the values are the same
    bitwise): glibc hands each allocation above 32 MiB fresh pages from the kernel, so a whole-batch [P, S]
    temporary pays a page fault per 4 KiB every time it is made, where chunk-sized ones reuse the heap. On a
    2-core Xeon, the forward of an EAGLE-3 step's loss over 5 unrolled steps (P ≈ 1,900, S = 8,192) fell from
    ~3.7 s to ~1.1 s (docs/training.md, "Speed on a CPU").
    """
    return in_chunks(lambda s, t, lz: _full_terms(s, t, temperature, lz), student_PS, teacher_PS, teacher_lZ_P)


def in_chunks(terms, student_PS, *rows_of):
    """terms(student rows, *the same rows of each of `rows_of`) over CHUNK_BYTES of fp32 student rows at a time,
    its per-row outputs concatenated. `rows_of` holds tensors with a row per student row, None, or TopK. Chunks
    are torch.split views, whose backward is one concatenation (slices would each scatter into a zeroed copy of
    the whole gradient)."""
    rows = max(1, CHUNK_BYTES // (4 * student_PS.shape[-1]))
    if student_PS.shape[0] <= rows:
        return terms(student_PS, *rows_of)
    chunks = student_PS.split(rows)

    def split(x):
        if x is None:
            return [None] * len(chunks)
        if isinstance(x, TopK):
            return [TopK(*parts) for parts in zip(x.ids_PK.split(rows), x.logp_PK.split(rows), x.rest_P.split(rows))]
        return x.split(rows)

    parts = [terms(*args) for args in zip(chunks, *(split(x) for x in rows_of))]
    return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}


def _full_terms(student_PS, teacher_PS, temperature: float, teacher_lZ_P) -> dict[str, torch.Tensor]:
    s_PS, t_PS = student_PS.float(), teacher_PS.float()
    lp_PS, lq_PS = t_PS.log_softmax(-1), s_PS.log_softmax(-1)
    kl_P = _kl_terms(lp_PS, lq_PS).sum(-1) if temperature == 1.0 else kl_full(s_PS, t_PS, temperature)
    tvd_P = 1.0 - torch.minimum(lp_PS, lq_PS).exp().sum(-1)  # min of logs = log of min: one [P, S] temporary
    ce_target_P = -lq_PS.gather(-1, t_PS.argmax(-1, keepdim=True))[:, 0]
    if teacher_lZ_P is None:
        alpha_P = 1.0 - tvd_P.detach()
    else:
        alpha_P = torch.minimum(t_PS - teacher_lZ_P.float()[:, None], lq_PS.detach()).exp().sum(-1)
    return {"kl": kl_P, "tvd": tvd_P, "ce_target": ce_target_P, "alpha": alpha_P.detach()}


# ---------------------------------------------------------------- top-K form (logits cache)

@dataclass
class TopK:
    """A cached teacher row per kept position: ids_PK student columns (descending p), logp_PK the target's
    unrestricted log-probs of those ids, rest_P log of its remaining mass on S (-inf: none)."""

    ids_PK: torch.Tensor
    logp_PK: torch.Tensor
    rest_P: torch.Tensor


@dataclass
class _Buckets:
    lp_PK: torch.Tensor  # log p̃ of the K ids (renormalised over S)
    lrest_P: torch.Tensor  # log m̃
    lq_PS: torch.Tensor  # the student's log q over S
    lq_PK: torch.Tensor  # ... at the K ids
    lQ_P: torch.Tensor  # log of the student's mass on R


def _buckets(student_PS, top: TopK) -> _Buckets:
    logp_PK, rest_P = top.logp_PK.float(), top.rest_P.float()
    lZ_P = torch.cat([logp_PK, rest_P[:, None]], -1).logsumexp(-1)
    lq_PS = student_PS.float().log_softmax(-1)
    lQ_P = lq_PS.scatter(-1, top.ids_PK, NEG_INF).logsumexp(-1)
    return _Buckets(logp_PK - lZ_P[:, None], rest_P - lZ_P, lq_PS, lq_PS.gather(-1, top.ids_PK), lQ_P)


def _tail_term(lm_P, lQ_P):
    """m̃ · log(m̃ / Q), 0 where m̃ = 0 (no -inf · 0 = nan, and no gradient through the unused branch)."""
    has_tail_P = torch.isfinite(lm_P)
    lm_safe_P = torch.where(has_tail_P, lm_P, torch.zeros_like(lm_P))
    lQ_safe_P = torch.where(has_tail_P, lQ_P, torch.zeros_like(lQ_P))
    return torch.where(has_tail_P, lm_safe_P.exp() * (lm_safe_P - lQ_safe_P), torch.zeros_like(lm_P))


def topk_terms(student_PS, top: TopK) -> dict[str, torch.Tensor]:
    """Per-position kl, tvd, ce_target and alpha of the K+1-outcome form (module docstring), taken in chunks of
    positions as full_terms takes its own (every term is per row: the same values bitwise)."""
    return in_chunks(_topk_terms, student_PS, top)


def _topk_terms(student_PS, top: TopK) -> dict[str, torch.Tensor]:
    b = _buckets(student_PS, top)
    p_PK = b.lp_PK.exp()
    kl_P = (torch.xlogy(p_PK, p_PK) - p_PK * b.lq_PK).sum(-1) + _tail_term(b.lrest_P, b.lQ_P)
    q_PK, Q_P = b.lq_PK.exp(), b.lQ_P.exp()
    tvd_P = 1.0 - torch.minimum(p_PK, q_PK).sum(-1) - torch.minimum(b.lrest_P.exp(), Q_P)
    alpha_P = (torch.minimum(top.logp_PK.float().exp(), q_PK).sum(-1)
               + torch.minimum(top.rest_P.float().exp(), Q_P))
    return {"kl": kl_P, "tvd": tvd_P, "ce_target": -b.lq_PK[:, 0], "alpha": alpha_P.detach()}


@torch.no_grad()
def topk_bounds(student_PS, top: TopK) -> dict[str, torch.Tensor]:
    """Per-position upper bounds of (full − cached) for kl and tvd and of (cached − full) for alpha."""
    b = _buckets(student_PS, top)
    m_P, Q_P = b.lrest_P.exp(), b.lQ_P.exp()
    lqmin_P = b.lq_PS.scatter(-1, top.ids_PK, float("inf")).amin(-1)
    spread_P = b.lQ_P - lqmin_P + torch.clamp_max(b.lp_PK.amin(-1) - b.lrest_P, 0.0)
    kl_P = torch.where(m_P > 0, m_P * spread_P.nan_to_num(0.0), torch.zeros_like(m_P))
    return {"kl": kl_P, "tvd": torch.minimum(m_P, Q_P),
            "alpha": torch.minimum(top.rest_P.float().exp(), Q_P)}


# ---------------------------------------------------------------- acceptance along a chain

def chain_tau(alpha: float, gamma: int = GAMMA) -> float:
    """E[tokens per round] = (1 − α^(γ+1)) / (1 − α) for i.i.d. per-token acceptance α
    (arXiv:2211.17192 §3.1, Eq. 1)."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def chain_sums(alpha_BT, agree_BT, keep_BT, link_BT, gamma: int = GAMMA) -> dict[str, torch.Tensor]:
    """Sums over chain anchors of Π_{i<d} α_{a+i} and Π_{i<d} agree_{a+i}, d = 1..γ, and the anchor count.

    An anchor a needs γ kept positions a..a+γ-1 in a row (link_BT[t]: t and t+1 are consecutive positions of
    one row). Teacher-forced, so it is the chain's acceptance exactly when the rows are the target's own
    outputs (greedy rows for agree, sampled rows for α); on other text it is an estimate.
    """
    out = {"chain_anchors": torch.zeros((), device=keep_BT.device)}
    T = keep_BT.shape[1]
    zero = torch.zeros((), device=keep_BT.device)
    for d in range(1, gamma + 1):
        out[f"chain_alpha_d{d}"], out[f"chain_greedy_d{d}"] = zero, zero
    if T < gamma:
        return out
    ok_BA = keep_BT.unfold(1, gamma, 1).all(-1)
    if gamma > 1:
        ok_BA = ok_BA & link_BT.unfold(1, gamma - 1, 1)[:, : ok_BA.shape[1]].all(-1)
    out["chain_anchors"] = ok_BA.sum().float()
    for name, values_BT in (("alpha", alpha_BT), ("greedy", agree_BT)):
        prod_BAG = values_BT.float().unfold(1, gamma, 1).cumprod(-1) * ok_BA[..., None]
        for d, total in enumerate(prod_BAG.sum((0, 1)).tolist(), start=1):
            out[f"chain_{name}_d{d}"] = torch.tensor(total, device=keep_BT.device)
    return out


def derive_acceptance(means: dict, gamma: int = GAMMA, cost: tuple[float, float] | None = None) -> dict[str, float]:
    """From per-position means (the loop's metric sums over one count): τ implied by α (T=1) and by top-1
    agreement (T=0), and, where chain sums are present, acceptance per depth and the chain's measured τ.
    Ratios of the sums are exact because every metric is divided by the same count. With `cost` =
    (draft_cost, verify_cost), also the speedup the cost model predicts for a chain of γ (predicted_speedup)."""
    out = _acceptance(means, gamma)
    if cost is not None:
        for kind in ("", "_greedy"):
            tau = out.get(f"tau_chain_g{gamma}{kind}", out.get(f"tau_g{gamma}{kind}"))
            if tau is not None:
                out[f"predicted_speedup{kind}"] = predicted_speedup(tau, gamma, *cost)
    return out


def predicted_speedup(tau: float, gamma: int, draft_cost: float, verify_cost: float) -> float:
    """τ tokens per round over the round's cost in target-token times: γ drafter steps of draft_cost each and
    one verification of γ + 1 rows (verify_cost = t(γ+1)/t(1)); the cost model `draftforge eval` reports."""
    return tau / (gamma * draft_cost + verify_cost)


def _acceptance(means: dict, gamma: int) -> dict[str, float]:
    out = {}
    if "alpha" in means:
        out[f"tau_g{gamma}"] = chain_tau(float(means["alpha"]), gamma)
    if "top1_agree" in means:
        out[f"tau_g{gamma}_greedy"] = chain_tau(float(means["top1_agree"]), gamma)
    anchors = float(means.get("chain_anchors", 0.0))
    if anchors > 0:
        for name, label in (("alpha", "alpha"), ("greedy", "greedy")):
            prev, reached = anchors, 0.0
            for d in range(1, gamma + 1):
                cur = float(means[f"chain_{name}_d{d}"])
                out[f"{label}_depth{d}"] = cur / prev if prev > 0 else 0.0
                prev, reached = cur, reached + cur / anchors
            out[f"tau_chain_g{gamma}" + ("" if name == "alpha" else "_greedy")] = 1.0 + reached
    return out
