"""Draft plans of any shape through the unchanged engine: stop rules, uneven and dynamic trees, bound drafters.

Oracle: the target's own greedy generate(); rollback is checked against re-encoding the prefix.
"""

from __future__ import annotations

import pytest
import torch

from draftforge.decode import (
    Drafter,
    DraftTree,
    DynamicTree,
    SpeculativeDecoder,
    StoppableChain,
    StopRule,
    TreeBuilder,
    build_decoder,
    load_drafter,
    load_target,
)
from draftforge.decode.sampling import SamplingParams
from draftforge.errors import DraftforgeError
from tests.fixtures.decode import (assert_states_are_reencoded, greedy_reference, greedy_runs, noisy_copy, tiny_llama,
                                   tiny_mamba, tiny_mamba2)
from tests.fixtures.plans import PlanController

VOCAB = 12
PROMPTS = [[4], [3, 5, 7], [(7 * i + 3) % VOCAB for i in range(23)]]


reference = greedy_reference


def check_lossless(target, drafter, plan, max_news=(1, 13)):
    dec = SpeculativeDecoder("test", target, drafter, PlanController(plan))
    accepted = 0
    for _, res in greedy_runs(dec, target, PROMPTS, max_news):
        assert res.stats.new_tokens == sum(res.stats.accepted_per_round) + res.stats.target_forwards
        assert len(res.stats.proposed_by_position) <= plan.max_depth
        accepted += sum(res.stats.accepted_per_round)
    return dec.controller.rounds, accepted


# ---------------------------------------------------------------- throwaway drafters written here

class Recompute(Drafter):
    """A stateless drafter: runs its whole model over seq + drafts at every step (slow, obviously correct)."""

    kind = "recompute"

    def __init__(self, model, vocab):
        self.model, self.vocab_size = model, vocab

    def reset(self):
        pass

    def next_logits(self, ids):
        with torch.no_grad():
            return self.model(torch.tensor([ids])).logits[0, -1]

    def draft_levels(self, seq, shape, params, generator, stop=None):
        assert shape.is_chain
        tokens = []
        for depth in range(1, shape.depth + 1):
            logits = self.next_logits(seq + tokens)
            tokens.append(int(logits.argmax()))
            if stop is not None and stop.should_stop(_step(depth, tokens[-1], logits)):
                break
        return DraftTree(tokens, list(range(-1, len(tokens) - 1)), list(range(1, len(tokens) + 1)), is_chain=True)

    def accept_levels(self, path):
        pass


def _step(depth, token, logits):
    from draftforge.decode import DraftStep

    return DraftStep(depth, token, logits, float(logits.softmax(-1)[token]))


class ConfidenceStop(StopRule):
    """Stop once the drafter's probability of its own token falls under a threshold (SpecDec++-like)."""

    def __init__(self, threshold):
        self.threshold, self.seen, self.rounds = threshold, [], 0

    def start_round(self):
        self.rounds += 1

    def should_stop(self, step):
        self.seen.append((step.depth, step.prob))
        return step.prob < self.threshold


class Uneven(Recompute):
    """Builds its own tree of uneven widths: 3 children at the root, 2 under the first, 1 under its first."""

    def draft(self, seq, plan, params, generator):
        self.node_map = None
        top = self.next_logits(seq).topk(3).indices.tolist()
        first = self.next_logits(seq + top[:1]).topk(2).indices.tolist()
        deep = int(self.next_logits(seq + top[:1] + first[:1]).argmax())
        tokens, parents = top + first + [deep], [-1, -1, -1, 0, 0, 3]
        depths = [1, 1, 1, 2, 2, 3]
        keep = [j for j, d in enumerate(depths) if d <= plan.max_depth]
        return DraftTree([tokens[j] for j in keep], [parents[j] for j in keep], [depths[j] for j in keep])


def test_throwaway_drafter_with_a_stop_rule_is_lossless(target):
    rule = ConfidenceStop(0.14)  # the tiny random model is unsure: its top-1 probabilities are ~0.1-0.2
    drafter = Recompute(noisy_copy(target.model, noise=0.05), VOCAB)
    rounds, accepted = check_lossless(target, drafter, StoppableChain(6, rule))
    assert accepted > 0
    depths = {len(r.tree) for r in rounds}
    assert len(depths) > 1  # the rule really ended chains at different lengths
    probs = [p for _, p in rule.seen]
    assert min(probs) < 0.14 <= max(probs)  # the rule both stopped and continued chains
    assert rule.rounds == sum(r.plan is not None for r in rounds)  # told of every drafting round


def test_throwaway_drafter_with_an_uneven_tree_is_lossless(target):
    rounds, accepted = check_lossless(target, Uneven(noisy_copy(target.model, noise=0.01), VOCAB),
                                      DynamicTree(TreeBuilder(), 3))
    assert accepted > 0 and any(len(r.tree) == 6 for r in rounds)
    assert any(len(r.path) >= 2 for r in rounds)  # paths went through the uneven part of the tree


# ---------------------------------------------------------------- the real drafters follow any plan

class TopKBuilder(TreeBuilder):
    """EAGLE-2-like expansion with uneven widths: each frontier node proposes `k` children, the best
    `beam` by joint probability are fed next; finish keeps every node."""

    def __init__(self, k=(3, 2, 2), beam=2):
        self.k, self.beam = k, beam

    def expand(self, depth, logits_BV, joint_B):
        k = self.k[min(depth - 1, len(self.k) - 1)]
        return logits_BV.topk(k, dim=-1).indices.tolist()

    def frontier(self, depth, candidates):
        best = sorted(candidates, key=lambda c: -c[1])[: self.beam]
        return sorted(node for node, _ in best)


@pytest.mark.parametrize("kind", ["transformer", "mamba", "mamba2"])
def test_real_drafters_follow_a_dynamic_builder_losslessly(target, drafters, kind):
    rounds, _ = check_lossless(target, drafters[kind], DynamicTree(TopKBuilder(), 4))
    assert any(len(r.tree) == 3 + 2 * 2 + 2 * 2 + 2 * 2 for r in rounds)  # 3 | 2x2 | 2x2 | 2x2 nodes


@pytest.mark.parametrize("kind", ["transformer", "mamba", "mamba2"])
def test_real_drafters_stop_chains_by_rule_losslessly(target, drafters, kind):
    rounds, _ = check_lossless(target, drafters[kind], StoppableChain(5, ConfidenceStop(0.14)))
    assert len({len(r.tree) for r in rounds}) > 1


@pytest.mark.parametrize("make", [tiny_mamba, tiny_mamba2], ids=["mamba", "mamba2"])
def test_dynamic_rollback_equals_reencoding(target, make):
    drafter = load_drafter(make(vocab=VOCAB, dtype=torch.float64), target)
    seq, params, gen = [3, 1, 4, 1, 5, 9, 2], SamplingParams(), torch.Generator().manual_seed(0)
    for pick in (3, 1, 2, 0, 4):
        tree = drafter.draft(seq, DynamicTree(TopKBuilder(), 4), params, gen)
        leaf = max(range(len(tree)), key=lambda j: (tree.depths[j], j))
        path = []
        while leaf != -1:
            path.append(leaf)
            leaf = tree.parents[leaf]
        path = path[::-1][:pick]
        drafter.accept(path)
        seq = seq + [tree.tokens[j] for j in path] + [int(torch.randint(0, VOCAB, (), generator=gen))]
        assert_states_are_reencoded(drafter, seq)


def test_dynamic_builder_is_refused_when_sampling(target, drafters):
    dec = SpeculativeDecoder("t", target, drafters["mamba"], PlanController(DynamicTree(TopKBuilder(), 3)))
    with pytest.raises(DraftforgeError, match="temperature 0"):
        dec.generate([1, 2], max_new_tokens=4, temperature=1.0)


# ---------------------------------------------------------------- drafters bound to their target

class HiddenReader(Recompute):
    """Reads the target's last verification: hidden states at the verified rows, the accepted path."""

    def bind(self, target):
        super().bind(target)
        target.want_hidden = True
        self.seen = []

    def draft_levels(self, seq, shape, params, generator, stop=None):
        last = self.target.last
        if last is not None:
            self.seen.append((list(seq), last.hidden_ND.clone(), list(last.path), len(last.tree)))
        return super().draft_levels(seq, shape, params, generator, stop)


def test_a_bound_drafter_reads_the_targets_hidden_states_and_accepted_path():
    target = load_target(tiny_llama(vocab=VOCAB, dtype=torch.float64))
    drafter = HiddenReader(noisy_copy(target.model, noise=0.05), VOCAB)
    drafter.bind(target)
    build_decoder("chain", target, drafter, chain_length=3).generate(PROMPTS[2], max_new_tokens=12)
    assert len(drafter.seen) > 2
    for seq, hidden_ND, path, n_nodes in drafter.seen:
        assert hidden_ND.shape == (1 + n_nodes, target.model.config.hidden_size)
        # the last verified rows up to the bonus are a plain prefix of seq: compare with a full forward
        with torch.no_grad():
            full = target.model(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0]
        rows = 1 + len(path)  # the fed root token and the accepted drafts
        torch.testing.assert_close(hidden_ND[:rows], full[len(seq) - 1 - rows: len(seq) - 1], rtol=1e-9, atol=1e-9)


def test_hidden_states_cost_nothing_unless_asked(target):
    target.want_hidden = False
    build_decoder("ar", target).generate([1, 2], max_new_tokens=2)
    assert target.last.hidden_ND is None
