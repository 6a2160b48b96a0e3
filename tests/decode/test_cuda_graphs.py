"""The Mamba drafter's static-buffer / CUDA-graph decode path drafts exactly what the eager path drafts.

On CPU a stand-in graph (ReplayGraph) is captured and replayed the way torch.cuda.CUDAGraph is: capture
runs the step (as the warm-up does, scribbling on the states) and returns the output tensor; replay
re-executes the recorded call and writes into that same output, after checking that the step still
reads and writes the addresses it had at capture. So if the drafter ever moved data by rebinding a
tensor instead of copying into the static buffers, or read a stale output, these tests would fail.
"""

from __future__ import annotations

import pytest
import torch

from draftforge.decode import build_decoder, load_drafter, load_target, parse_tree
from draftforge.decode.drafters.cuda_graphs import CudaGraph, StaticStep, use_cuda_graphs
from draftforge.decode.drafters.mamba import MambaDrafter
from draftforge.decode.sampling import SamplingParams
from draftforge.decode.drafters.ssm_state import layer_states
from draftforge.errors import DraftforgeError
from tests.fixtures.decode import tiny_llama, tiny_mamba, tiny_mamba2

VOCAB = 12
PROMPTS = [[4], [3, 5, 7, 1, 1, 2], [(7 * i + 3) % VOCAB for i in range(23)], [9, 9]]
MAKERS = {"mamba": tiny_mamba, "mamba2": tiny_mamba2}


class ReplayGraph:
    """CPU stand-in for CudaGraph: replay re-executes the captured call on the captured buffers."""

    def capture(self, fn):
        assert not hasattr(self, "fn"), "a graph is captured once"
        self.fn, self.step, self.replays = fn, fn.__self__, 0
        self.addresses = self._addresses()
        fn()  # the warm-up steps the states for real: the caller must put them back
        self.out = fn()
        return self.out

    def _addresses(self):
        return [t.data_ptr() for t in self.step.static_tensors()]

    def replay(self):
        assert self._addresses() == self.addresses, "a static buffer was reallocated after capture"
        for (conv, ssm), (conv_read, ssm_read) in zip(self.step.states, layer_states(self.step.cache)):
            assert conv_read is conv and ssm_read is ssm, "the step's cache no longer reads the static states"
        self.out.copy_(self.fn())  # a graph writes its output in place, never a new tensor
        self.replays += 1


def record_drafts(drafter):
    """Keep every DraftTree (tokens, parents, q) the drafter proposes."""
    trees, draft = [], drafter.draft

    def recording(*args):
        tree = draft(*args)
        trees.append((tree.tokens, tree.parents, None if tree.q_probs is None else tree.q_probs.clone()))
        return tree

    drafter.draft = recording
    return trees


def reference(target, prompt, max_new):
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt) :].tolist()


def drafter_pair(kind, target):
    """Same weights: one eager drafter, one on the graphed path with ReplayGraph."""
    model = MAKERS[kind](vocab=VOCAB, dtype=torch.float64)
    eager = MambaDrafter(model, target.vocab_size, cuda_graphs="off")
    graphed = MambaDrafter(model, target.vocab_size, graph_factory=ReplayGraph)
    assert not eager.cuda_graphs and graphed.cuda_graphs
    return eager, graphed


def assert_same_drafts(trees_a, trees_b):
    assert len(trees_a) == len(trees_b)
    for (tok_a, par_a, q_a), (tok_b, par_b, q_b) in zip(trees_a, trees_b):
        assert tok_a == tok_b and par_a == par_b
        if q_a is not None:  # identical CPU kernels on identical inputs: bit-for-bit equal
            assert torch.equal(q_a, q_b)


# (VOCAB, 2, 1) always accepts depth 1, so restores from deep depth buffers are exercised
RUNS = [("chain", {"chain_length": 3}), ("tree", {"tree": (2, 2, 1)}), ("tree", {"tree": (VOCAB, 2, 1)}),
        ("ucb", {"ucb_trees": [(1, 1), (3, 2), (VOCAB, 1, 1)], "lambda_gamma": 0.1})]


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_graphed_drafts_equal_eager_and_output_equals_generate(target, kind):
    """Several prompts back to back (persistent live buffer) and configurations alternating on one drafter."""
    eager, graphed = drafter_pair(kind, target)
    trees_eager, trees_graphed = record_drafts(eager), record_drafts(graphed)
    accepted = 0
    for prompt in PROMPTS:
        for method, options in RUNS:  # the same drafters switch configuration every prompt and every UCB round
            res_e = build_decoder(method, target, eager, **options).generate(prompt, max_new_tokens=13)
            res_g = build_decoder(method, target, graphed, **options).generate(prompt, max_new_tokens=13)
            assert res_g.tokens == res_e.tokens == reference(target, prompt, 13)
            assert res_g.stats.accepted_per_round == res_e.stats.accepted_per_round
            accepted += sum(res_g.stats.accepted_per_round)
    assert_same_drafts(trees_eager, trees_graphed)
    assert accepted > 0
    # one graph for the live batch-1 step plus one per fed depth (1..γ-1) of every configuration seen
    # the rounds cut short at the end of a prompt, and UCB's (1, 1), reuse a longer configuration's buffers
    assert set(graphed.banks) == {(1, 1, 1), (2, 2, 1), (VOCAB, 2, 1), (3, 2), (VOCAB, 1, 1)}
    assert len(graphed.runner.steps) == 1 + sum(len(w) - 1 for w in graphed.banks)
    assert all(isinstance(s.graph, ReplayGraph) and s.graph.replays > 0 for s in graphed.runner.steps)
    assert {s.graph is None for s in eager.runner.steps} == {True}


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_graphed_sampling_drafts_equal_eager(target, kind):
    """At T>0 the drafts and their q distributions agree bit for bit, so the same seed gives the same output."""
    eager, graphed = drafter_pair(kind, target)
    trees_eager, trees_graphed = record_drafts(eager), record_drafts(graphed)
    for prompt in PROMPTS[1:3]:
        for tree in [(2, 2, 1), (3, 1)]:
            res_e = build_decoder("tree", target, eager, tree=tree).generate(prompt, max_new_tokens=9, temperature=1.0)
            res_g = build_decoder("tree", target, graphed, tree=tree).generate(prompt, max_new_tokens=9, temperature=1.0)
            assert res_g.tokens == res_e.tokens
    assert trees_eager and trees_eager[0][2] is not None
    assert_same_drafts(trees_eager, trees_graphed)


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_graphed_drafts_of_a_parent_list_tree_equal_eager(target, kind):
    """STree's 13-token tree (nodes with 2, 1 or 0 children; batches 1, 2, 2, 1) greedy and sampled: the same
    drafts, q included; the shallower trees of a prompt's last rounds reuse its buffers and graphs."""
    eager, graphed = drafter_pair(kind, target)
    trees_eager, trees_graphed = record_drafts(eager), record_drafts(graphed)
    stree13 = parse_tree("stree13")
    for prompt in PROMPTS:
        for temperature in (0.0, 1.0):
            res_e = build_decoder("tree", target, eager, tree=stree13).generate(
                prompt, max_new_tokens=13, temperature=temperature)
            res_g = build_decoder("tree", target, graphed, tree=stree13).generate(
                prompt, max_new_tokens=13, temperature=temperature)
            assert res_g.tokens == res_e.tokens
            assert temperature > 0 or res_g.tokens == reference(target, prompt, 13)
    assert_same_drafts(trees_eager, trees_graphed)
    assert set(graphed.banks) == {stree13.layers} and len(graphed.runner.steps) == 1 + 3
    assert [len(buf[0][0]) for buf in graphed.banks[stree13.layers].buffers] == [1, 2, 2, 1]


def test_live_state_after_new_prompt_equals_fresh_drafter(target):
    """The persistent live buffer holds exactly the new prompt's state, nothing left from the previous one."""
    model = tiny_mamba2(vocab=VOCAB, dtype=torch.float64)
    reused = MambaDrafter(model, target.vocab_size, graph_factory=ReplayGraph)
    params, gen = SamplingParams(), torch.Generator().manual_seed(0)
    reused.draft(PROMPTS[2], (2, 2), params, gen)
    reused.accept([0, 2])
    reused.draft(PROMPTS[2] + [1, 2, 3, 4], (2, 2), params, gen)  # steps the live graph too
    live_buffers = [t.data_ptr() for pair in reused.live for t in pair]
    reused.reset()
    fresh = MambaDrafter(model, target.vocab_size, cuda_graphs="off")
    tree_reused = reused.draft(PROMPTS[1], (2, 2), params, gen)
    tree_fresh = fresh.draft(PROMPTS[1], (2, 2), params, gen)
    assert tree_reused.tokens == tree_fresh.tokens
    assert [t.data_ptr() for pair in reused.live for t in pair] == live_buffers  # same buffer, new contents
    for (conv, ssm), (conv_f, ssm_f) in zip(reused.live, fresh.live):
        assert torch.equal(conv, conv_f) and torch.equal(ssm, ssm_f)


def test_on_without_cuda_is_a_clear_error(target):
    model = tiny_mamba(vocab=VOCAB)
    with pytest.raises(DraftforgeError, match="cuda_graphs='on' needs the drafter on a CUDA device"):
        MambaDrafter(model, VOCAB, cuda_graphs="on")
    with pytest.raises(DraftforgeError, match="cuda_graphs='on' needs"):
        load_drafter(model, load_target(tiny_llama(vocab=VOCAB)), cuda_graphs="on")
    with pytest.raises(DraftforgeError, match="must be one of auto, on, off"):
        use_cuda_graphs("yes", torch.device("cpu"))
    assert use_cuda_graphs("auto", torch.device("cpu")) is False
    assert use_cuda_graphs("auto", torch.device("cuda")) is True  # resolving needs no GPU


def test_eval_flag_reaches_the_config():
    import argparse

    from draftforge.eval.command import config_from_args, configure

    parser = configure(argparse.ArgumentParser())
    args = parser.parse_args(["--target", "t", "--bench", "b", "--cuda-graphs", "off"])
    assert config_from_args(args).cuda_graphs == "off"
    assert config_from_args(parser.parse_args(["--target", "t", "--bench", "b"])).cuda_graphs == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--target", "t", "--bench", "b", "--cuda-graphs", "maybe"])
    from draftforge.eval.runner import validate

    with pytest.raises(DraftforgeError, match="needs the drafter on a CUDA device"):  # before any model loads
        validate(config_from_args(parser.parse_args(["--target", "t", "--bench", "b", "--cuda-graphs", "on"])))


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_graphed_step_has_no_host_sync_or_data_dependent_shape(target, kind):
    """What breaks CUDA-graph capture, checked on CPU: a step that reads a value back to the host
    (.item(), bool(tensor), nonzero) or allocates by data cannot be captured. Record the ATen ops of
    one drafter step at batch 1 and at a tree depth's batch and refuse any such op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    syncing = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique",
               "aten._unique2", "aten.item", "aten.is_nonzero", "aten.equal"}

    class AtenOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    drafter = MambaDrafter(MAKERS[kind](vocab=VOCAB, dtype=torch.float64), target.vocab_size, cuda_graphs="off")
    drafter.draft(PROMPTS[1], (3, 2, 1), SamplingParams(), torch.Generator().manual_seed(0))  # builds the steps
    steps = [drafter.live_step] + [s for s in drafter.depth_steps[(3, 2, 1)] if s is not None]
    for step in steps:
        with AtenOps() as seen:
            step(torch.ones(step.ids_B1.shape, dtype=torch.long))
        assert seen.ops, "the step ran no ATen op: the check would be vacuous"
        assert not seen.ops & syncing, f"batch {step.ids_B1.shape[0]}: {sorted(seen.ops & syncing)}"


# ---- real CUDA graphs (skipped without a GPU) ----

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


@cuda
@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_cuda_graph_replay_equals_eager_for_every_batch_size(kind):
    model = MAKERS[kind](vocab=64).cuda()
    drafter = MambaDrafter(model, 64, cuda_graphs="off")
    drafter._sync([5, 6, 7])  # real state shapes for the buffers
    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch in (1, 3, 6, 12):  # B_i of the configuration (3, 2, 2, 1)
        states = [(torch.randn((batch, *c.shape[1:]), device="cuda", generator=gen),
                   torch.randn((batch, *s.shape[1:]), device="cuda", generator=gen)) for c, s in drafter.live]
        copies = [(c.clone(), s.clone()) for c, s in states]
        eager = StaticStep(model, copies)
        graphed = StaticStep(model, states, graph=CudaGraph())
        for step in range(3):  # replays keep stepping the same buffers
            ids_B1 = torch.randint(0, 64, (batch, 1), device="cuda", generator=gen)
            logits_e, logits_g = eager(ids_B1).clone(), graphed(ids_B1).clone()
            torch.testing.assert_close(logits_g, logits_e, rtol=1e-5, atol=1e-5)
            for (c, s), (c_e, s_e) in zip(states, copies):
                torch.testing.assert_close(c, c_e, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(s, s_e, rtol=1e-5, atol=1e-5)


@cuda
@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_cuda_graphs_decoding_stays_lossless(kind):
    target = load_target(tiny_llama(vocab=VOCAB), device="cuda")  # (a model object is moved to `device`)
    assert target.model.device.type == "cuda"
    graphed = load_drafter(MAKERS[kind](vocab=VOCAB), target, device="cuda", cuda_graphs="on")
    eager = load_drafter(MAKERS[kind](vocab=VOCAB), target, device="cuda", cuda_graphs="off")
    assert graphed.cuda_graphs and not eager.cuda_graphs
    for prompt in PROMPTS:
        for method, options in RUNS:
            res_g = build_decoder(method, target, graphed, **options).generate(prompt, max_new_tokens=13)
            res_e = build_decoder(method, target, eager, **options).generate(prompt, max_new_tokens=13)
            ids = torch.tensor([prompt], device="cuda")
            ref = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=13, do_sample=False)
            assert res_g.tokens == ref[0, len(prompt) :].tolist()
            assert res_g.stats.accepted_per_round == res_e.stats.accepted_per_round
