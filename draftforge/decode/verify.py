"""Verifiers: turn target logits over a packed draft tree into an accepted root path + one token.

- greedy: walk down while the target's argmax is a child (lossless by construction);
- chain speculative sampling (Leviathan et al. 2023; Chen et al. 2023): accept x with
  min(1, p(x)/q(x)), on rejection draw from norm(max(0, p - q)), bonus token if all accepted;
- multi-step speculative sampling for trees (SpecInfer §4.2): at each node, try the children in
  order against the current residual p, replacing p by norm(max(0, p - q)) after every rejection;
  when all are rejected, draw from the last residual. Children drawn i.i.d. keep q as it is;
  children drawn without replacement (STree, SpecExec; `tree_draws="distinct"`) are tried against
  q with the tokens already tried removed and renormalised (recursive rejection sampling without
  replacement), and a token already tried is skipped. Both are exact: given the tokens tried so
  far, the next child is a draw from the q it is tested against.
- fixed drafts (`DraftTree.fixed_drafts`: prompt lookup's copied n-gram continuations, not draws):
  each child's q is the point mass on itself, so it is accepted with probability p(x) and a rejection
  leaves p with x removed and renormalised (Lookahead decoding's sampling verification, arXiv:2402.02057);
  exact whatever `tree_draws` says, since no sibling was drawn from a shared q.

Legend: N tree nodes, V vocabulary. Row 0 of logits/probs is the root, row 1+j is node j.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftforge.decode.sampling import SamplingParams, draw_one, probs_from_logits
from draftforge.decode.tree import DraftTree


@dataclass
class Verdict:
    path: list[int]  # accepted node indices, depth 1 first
    next_token: int  # correction (after a rejection) or bonus (after a leaf) token


def _normalised(w_V: torch.Tensor) -> torch.Tensor:
    w_V = w_V.to(torch.float64)
    return w_V / w_V.sum()


def _share(w_V: torch.Tensor, x: int) -> float:
    """x's probability under the row of weights w_V, in float64. p and q rows come as float32 (bf16 models, the
    EAGLE-3 and exit heads' .float()), whose sums miss 1 by up to ~1e-5 at V = 152k; draws normalise them (the
    CDF's total), so the accept ratio and the residual must too, or the output is off by that much."""
    return float(w_V[x]) / float(w_V.sum(dtype=torch.float64))


def residual(p_V: torch.Tensor, q_V: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) of the normalised rows, in float64; p itself when p <= q everywhere (then p == q,
    nothing to fix)."""
    p_V, q_V = _normalised(p_V), _normalised(q_V)
    r_V = (p_V - q_V).clamp_min(0)
    total = r_V.sum()
    return r_V / total if total > 0 else p_V


def _draw(probs_V: torch.Tensor, generator) -> int:
    return int(draw_one(probs_V.to(generator.device)[None], generator))


def _uniform(generator) -> float:
    return float(torch.rand((), generator=generator, device=generator.device))


def verify_greedy(tree: DraftTree, logits_NV: torch.Tensor) -> Verdict:
    argmax = logits_NV.argmax(-1).tolist()
    path, node = [], -1
    while True:
        best = argmax[node + 1]
        match = [c for c in tree.children(node) if tree.tokens[c] == best]
        if not match:
            return Verdict(path, best)
        node = match[0]
        path.append(node)


def verify_chain_sps(tree: DraftTree, p_NV: torch.Tensor, generator) -> Verdict:
    """Chain speculative sampling; p_NV, tree.q_probs are the warped target/drafter distributions."""
    path = []
    for j, x in enumerate(tree.tokens):
        if _uniform(generator) < min(1.0, _share(p_NV[j], x) / _share(tree.q_probs[j], x)):
            path.append(j)
            continue
        return Verdict(path, _draw(residual(p_NV[j], tree.q_probs[j]), generator))
    return Verdict(path, _draw(p_NV[len(tree.tokens)], generator))


def verify_tree_mss(tree: DraftTree, p_NV: torch.Tensor, generator, distinct: bool = False) -> Verdict:
    """Multi-step speculative sampling; `distinct`: siblings were drawn without replacement (see above)."""
    path, node = [], -1
    while True:
        if tree.fixed_drafts:
            accepted, p_V = _try_fixed(tree, node, p_NV[node + 1], generator)
        else:
            accepted, p_V = _try_drawn(tree, node, p_NV[node + 1], tree.q_probs[node + 1], generator, distinct)
        if accepted is None:
            return Verdict(path, _draw(p_V, generator))
        node = accepted
        path.append(node)


def _try_drawn(tree: DraftTree, node: int, p_V, q_V, generator, distinct: bool):
    """(accepted child or None, the residual p left) for children drawn from q_V."""
    for child in tree.children(node):
        x = tree.tokens[child]
        if distinct and not float(q_V[x]) > 0:
            continue  # tried already: a spare slot of a row with fewer tokens than children
        if _uniform(generator) < min(1.0, _share(p_V, x) / _share(q_V, x)):
            return child, p_V
        p_V = residual(p_V, q_V)
        if distinct:  # the next sibling was drawn from q without x: in float64, as the draw summed it
            q_V = q_V.to(torch.float64, copy=True)
            q_V[x] = 0
            if not float(q_V.sum()) > 0:
                break
            q_V = q_V / q_V.sum()
    return None, p_V


def _try_fixed(tree: DraftTree, node: int, p_V, generator):
    """(accepted child or None, the residual p left) for fixed children: q = point mass on each in turn."""
    for child in tree.children(node):
        x = tree.tokens[child]
        if _uniform(generator) < _share(p_V, x):  # min(1, p(x) / 1)
            return child, p_V
        point_V = torch.zeros_like(p_V)
        point_V[x] = 1.0
        p_V = residual(p_V, point_V)  # p without x, renormalised (p itself if p was the point mass)
    return None, p_V


def verify(tree: DraftTree, logits_NV: torch.Tensor, params: SamplingParams, vocab: int, generator) -> Verdict:
    """Pick the verifier for the sampling mode and tree shape."""
    logits_NV = logits_NV[:, :vocab]
    if params.greedy:
        return verify_greedy(tree, logits_NV)
    p_NV = probs_from_logits(logits_NV, params)
    if len(tree) == 0:
        return Verdict([], _draw(p_NV[0], generator))
    if tree.is_chain:
        return verify_chain_sps(tree, p_NV, generator)
    return verify_tree_mss(tree, p_NV, generator, distinct=params.tree_draws == "distinct")
