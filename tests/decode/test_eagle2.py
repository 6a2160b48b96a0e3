"""EAGLE-2 dynamic trees: against a brute-force construction, lossless with every drafter, bad input.

The brute force works on root paths (token tuples) of a fake drafter whose logits are a fixed random
function of the path, so every node's joint probability, each frontier and the rerank can be
recomputed without the dynamic-tree driver's node bookkeeping.
"""

from __future__ import annotations

import pytest
import torch

from draftforge.decode import DraftTree, Drafter, build_decoder, load_target
from draftforge.decode.methods.eagle2 import Eagle2Builder
from draftforge.decode.sampling import SamplingParams
from draftforge.decode.tree import root_path
from draftforge.errors import DraftforgeError, RecipeError
from tests.fixtures.decode import greedy_runs, tiny_llama

VOCAB = 12
PROMPTS = [[4], [3, 5, 7], [(7 * i + 3) % VOCAB for i in range(23)]]


class PathDrafter(Drafter):
    """Logits are a seeded random function of (prompt, path): no state beyond a node -> path map."""

    kind = "fake"
    follows_dynamic_trees = True

    def __init__(self, vocab=VOCAB, scale=2.5):
        self.vocab_size, self.scale, self.d2t = vocab, scale, None

    def logits(self, path) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash(tuple(self.seq) + (-1,) + tuple(path)) % (2**31))
        return self.scale * torch.randn(self.vocab_size, generator=g, dtype=torch.float64)

    def reset(self):
        pass

    def begin(self, seq):
        self.seq, self.paths = list(seq), {-1: ()}
        return self.logits(())[None]

    def feed(self, parents, tokens, nodes):
        for parent, tok, node in zip(parents, tokens, nodes):
            self.paths[node] = self.paths[parent] + (tok,)
        return torch.stack([self.logits(self.paths[n]) for n in nodes])

    def accept_nodes(self, nodes):
        pass

    def draft_levels(self, *a, **k):
        raise NotImplementedError

    def accept_levels(self, path):
        pass


class Recording(Eagle2Builder):
    def frontier(self, depth, candidates):
        fed = super().frontier(depth, candidates)
        self.frontiers.append(fed)
        return fed

    def finish(self, parents, joint):
        self.joint = list(joint)
        return super().finish(parents, joint)


def brute_force(drafter, k, depth, n_total, softmax_dtype=torch.float64):
    """EAGLE-2 on paths: (pool in code order with joints, frontier path sets per layer, reranked paths in order).
    Equal P keeps code order (Python's sort is stable): parents before children, earlier siblings first."""
    pool, frontier, frontiers = [], [()], []
    joint = {(): 1.0}
    for _ in range(depth + 1):
        new = []
        for path in frontier:
            probs = drafter.logits(path).to(softmax_dtype).softmax(-1).double()
            for tok in probs.topk(k).indices.tolist():
                joint[path + (tok,)] = joint[path] * float(probs[tok])
                new.append(path + (tok,))
        pool += new
        frontier = sorted(new, key=lambda q: -joint[q])[:k]
        frontiers.append(frontier)
    best = set(sorted(pool, key=lambda q: -joint[q])[: n_total - 1])
    return pool, joint, frontiers[:-1], [q for q in pool if q in best]


def tree_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    return [tuple(tree.tokens[j] for j in root_path(tree.parents, i)) for i in range(len(tree))]


@pytest.mark.parametrize("k,depth,n_total", [(3, 3, 12), (4, 2, 30), (2, 4, 5)])
def test_eagle2_tree_equals_brute_force(k, depth, n_total):
    drafter = PathDrafter()
    seq, params = [1, 2, 3], SamplingParams()
    drafter.seq = seq
    pool, joint, frontiers, reranked = brute_force(drafter, k, depth, n_total)
    assert len(pool) == k + depth * k * k

    full = Recording(k, depth, n_total, rerank=False)
    full.frontiers = []
    tree = drafter.draft(seq, full.plan(), params, None)
    paths = tree_paths(tree)
    assert paths == pool  # the whole pool T1, in EAGLE's code order
    for i, path in enumerate(paths):  # every node's joint probability
        assert full.joint[drafter.node_map[i]] == pytest.approx(joint[path], rel=1e-5)  # the driver softmaxes in float32
    fed = [[drafter.paths[n] for n in layer] for layer in full.frontiers]
    assert fed == frontiers  # each frontier: the global top-k by P, best first

    reranking = Recording(k, depth, n_total)
    reranking.frontiers = []
    tree = drafter.draft(seq, reranking.plan(), params, None)
    assert tree_paths(tree) == reranked  # top N-1 by P, in code order
    assert len(tree) == min(n_total - 1, len(pool))
    assert all(p < i for i, p in enumerate(tree.parents))  # a valid subtree, parents first


def test_equal_joint_probabilities_keep_parents_before_children():
    """A confident drafter (logits 60× a normal draw) gives its top child p = 1.0 exactly in float32, the driver's
    softmax: a child's P then equals its parent's, and only the documented tie rule (creation order) keeps every
    kept node's parent in the tree. The tree must equal the brute force with float32 probabilities."""
    drafter = PathDrafter(scale=60.0)
    seq = [1, 2, 3]
    drafter.seq = seq
    for n_total in (2, 3, 4, 6):  # budgets that cut between a node and its equally likely child, and that do not
        pool, joint, _, reranked = brute_force(drafter, 3, 3, n_total, softmax_dtype=torch.float32)
        assert sum(joint[q] == joint[q[:-1]] for q in pool if len(q) > 1) >= 2  # ties between a node and its parent
        tree = drafter.draft(seq, Eagle2Builder(3, 3, n_total).plan(), SamplingParams(), None)
        assert tree_paths(tree) == reranked, n_total
        assert all(p < i for i, p in enumerate(tree.parents))


def test_masks_and_positions_of_an_uneven_eagle2_tree():
    """Each node of an EAGLE-2 tree (uneven: some nodes have k children, most none) gets the logits
    of a plain forward over prompt + its root path."""
    target = load_target(tiny_llama(vocab=VOCAB, dtype=torch.float64))
    drafter = PathDrafter()
    seq = [3, 1, 4, 1, 5]
    tree = drafter.draft(seq, Eagle2Builder(3, 3, 14).plan(), SamplingParams(), None)
    widths = {len(tree.children(j)) for j in range(-1, len(tree))}
    assert len(widths) > 2 and len({d for d in tree.depths}) == 4
    target.prefill(seq)
    logits_NV = target.verify(seq[-1], tree)
    for i, path in enumerate(tree_paths(tree)):
        with torch.no_grad():
            expected = target.model(torch.tensor([seq + list(path)])).logits[0, -1]
        torch.testing.assert_close(logits_NV[1 + i], expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", ["transformer", "mamba", "mamba2", "eagle3", "feature_mamba2"])
def test_eagle2_is_lossless_with_every_drafter(target, drafters, kind):
    dec = build_decoder("eagle2", target, drafters[kind], eagle_top_k=3, eagle_depth=3, total_tokens=12)
    sizes = set()
    for _, res in greedy_runs(dec, target, PROMPTS, (1, 2, 17)):
        assert res.stats.new_tokens == sum(res.stats.accepted_per_round) + res.stats.target_forwards
        sizes.update(res.stats.drafted_per_round)
    assert max(sizes) == 11  # total_tokens counts the root: 11 drafts verified per full round


def test_eagle2_bad_input(target, drafters):
    with pytest.raises(RecipeError, match="larger than the drafter's vocabulary"):
        build_decoder("eagle2", target, drafters["mamba"], eagle_top_k=VOCAB + 1)
    with pytest.raises(RecipeError, match="beyond the target's context of 256"):
        build_decoder("eagle2", target, drafters["mamba"], eagle_top_k=3, total_tokens=257)
    with pytest.raises(RecipeError, match="--eagle-depth must be >= 1"):
        build_decoder("eagle2", target, drafters["mamba"], eagle_top_k=3, eagle_depth=0)
    dec = build_decoder("eagle2", target, drafters["mamba"], eagle_top_k=3, eagle_depth=2, total_tokens=8)
    with pytest.raises(DraftforgeError, match="temperature 0"):
        dec.generate([1, 2], max_new_tokens=4, temperature=0.8)
