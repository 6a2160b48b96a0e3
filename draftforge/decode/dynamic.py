"""Drive a TreeBuilder (plan.py) over any drafter with the node interface `begin` / `feed` / `accept_nodes`.

Depth by depth: the frontier's next-token logits go to `builder.expand`, which names each frontier
node's children; every new node gets its joint probability (product of the drafter's probabilities
along its root path); `builder.frontier` picks which new nodes the drafter is fed (their children
come next); at the end `builder.finish` keeps a subtree, renumbered breadth-first for the target.
The drafter's `accept` then maps the verified path back to its own node ids.

Legend: B frontier nodes at one depth, V vocabulary.
"""

from __future__ import annotations

import torch

from draftforge.decode.sampling import SamplingParams, match_vocab, probs_from_logits
from draftforge.decode.tree import DraftTree
from draftforge.errors import DraftforgeError


def draft_dynamic(drafter, seq: list[int], plan, params: SamplingParams, generator) -> DraftTree:
    builder = plan.builder
    if not params.greedy and not builder.sampling_ok:
        raise DraftforgeError(f"{type(builder).__name__} chooses children deterministically, which speculative "
                              "sampling cannot verify losslessly; use it at temperature 0")
    if not drafter.follows_dynamic_trees:
        raise DraftforgeError(f"the {drafter.kind} drafter cannot follow a dynamic tree builder (it has no "
                              "begin/feed/accept_nodes)")
    logits_BV = match_vocab(drafter.begin(seq), drafter.vocab_size, drafter.d2t)
    tokens, parents, depths, joint = [], [], [], []
    frontier, frontier_joint = [-1], [1.0]
    q_of = {}  # node id (-1 = root) -> the distribution its children were drawn from (T > 0)
    for depth in range(1, plan.max_depth + 1):
        probs_BV = logits_BV.float().softmax(-1) if params.greedy else probs_from_logits(logits_BV, params)
        children = builder.expand(depth, logits_BV, torch.tensor(frontier_joint))
        new = []
        for row, parent in enumerate(frontier):
            if not params.greedy:
                q_of[parent] = probs_BV[row]
            for tok in children[row]:
                tokens.append(int(tok))
                parents.append(parent)
                depths.append(depth)
                joint.append(frontier_joint[row] * float(probs_BV[row, int(tok)]))
                new.append((len(tokens) - 1, joint[-1]))
        fed = builder.frontier(depth, new) if new and depth < plan.max_depth else []
        if not fed:
            break
        logits_BV = match_vocab(drafter.feed([parents[n] for n in fed], [tokens[n] for n in fed], fed),
                                drafter.vocab_size, drafter.d2t)
        frontier, frontier_joint = fed, [joint[n] for n in fed]
    return _subtree(drafter, tokens, parents, depths, builder.finish(parents, joint), q_of, params)


def _subtree(drafter, tokens, parents, depths, keep, q_of, params) -> DraftTree:
    """The kept nodes renumbered in breadth-first order; the drafter remembers the map back."""
    keep = sorted(set(keep), key=lambda n: (depths[n], n))
    index = {n: i for i, n in enumerate(keep)}
    if any(parents[n] != -1 and parents[n] not in index for n in keep):
        raise DraftforgeError("a tree builder's finish() kept a node without its parent; keep whole root paths")
    new_parents = [-1 if parents[n] == -1 else index[parents[n]] for n in keep]
    q_probs = None
    if not params.greedy:
        vocab = next(iter(q_of.values())).shape[-1]
        q_probs = torch.zeros(1 + len(keep), vocab, dtype=next(iter(q_of.values())).dtype)
        for row, node in enumerate([-1] + keep):
            if node in q_of:
                q_probs[row] = q_of[node]
    drafter.node_map = keep  # final index -> the drafter's own node id, for accept()
    chain = all(p == i - 1 for i, p in enumerate(new_parents))
    return DraftTree([tokens[n] for n in keep], new_parents, [depths[n] for n in keep], q_probs, is_chain=chain)
