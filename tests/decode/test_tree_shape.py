"""Static trees given as parent lists per layer (STree's 13-token config A is the preset `stree13`): the
parser against hand-written parent arrays, what the drafters put in such a tree (the r-th child of a node
is the node's r-th ranked token; at T>0 q rows sit on the nodes with children), drafter rollback, bad input."""

from __future__ import annotations

import argparse

import pytest
import torch

from draftforge.decode import (
    StaticTree,
    TreeShape,
    build_decoder,
    load_drafter,
    load_target,
    parse_tree,
)
from draftforge.decode.sampling import SamplingParams, probs_from_logits
from draftforge.decode.tree import root_path
from draftforge.errors import RecipeError
from draftforge.eval import command
from tests.fixtures.decode import assert_states_are_reencoded, greedy_reference, tiny_llama, tiny_mamba2

VOCAB = 16
STREE13 = parse_tree("stree13")
SEQ = [3, 1, 4, 1, 5, 9, 2]


def test_stree13_is_the_papers_config_a():
    # L1 = [r, r, r], L2 = [L1₀, L1₀, L1₁], L3 = [L2₀, L2₀, L2₁], L4 = [L3₀, L3₀, L3₀]
    assert STREE13.layers == ((0, 0, 0), (0, 0, 1), (0, 0, 1), (0, 0, 0))
    # breadth first: nodes 0-2 at depth 1, 3-5 at depth 2, 6-8 at depth 3, 9-11 at depth 4
    assert STREE13.parents == [-1, -1, -1, 0, 0, 1, 3, 3, 4, 6, 6, 6]
    assert (STREE13.size, STREE13.depth, STREE13.widths, STREE13.name) == (12, 4, None, "stree13")
    assert parse_tree("parents:0,0,0/0,0,1/0,0,1/0,0,0") == STREE13
    assert parse_tree("stree13") == STREE13 == parse_tree(" parents:0,0,0/0,0,1/0,0,1/0,0,0 ")


@pytest.mark.parametrize("text,parents,widths", [
    ("parents:0,0/0,0,1,1", [-1, -1, 0, 0, 1, 1], (2, 2)),
    ("parents:0/0/0", [-1, 0, 1], (1, 1, 1)),
    ("parents:0,0/1", [-1, -1, 1], None),
    ("parents:0,0,0/0,2,2/1", [-1, -1, -1, 0, 2, 2, 4], None),
    ("parents:0, 0 / 0", [-1, -1, 0], None),
])
def test_parent_lists_parse_to_breadth_first_parent_arrays(text, parents, widths):
    shape = parse_tree(text)
    assert shape.parents == parents and shape.widths == widths
    assert parse_tree(shape.text) == shape


def test_widths_parse_to_the_tree_shape_of_their_parent_lists():
    assert parse_tree("3,1,1,1") == TreeShape.from_widths((3, 1, 1, 1))
    assert parse_tree("3,1,1,1").widths == (3, 1, 1, 1)
    assert TreeShape.from_widths((3, 2)).parents == [-1, -1, -1, 0, 0, 1, 1, 2, 2]
    assert TreeShape.from_widths((3, 2)) == parse_tree("parents:0,0,0/0,0,1,1,2,2")
    uniform = StaticTree(parse_tree("parents:0,0/0,0,1,1"))  # drafted exactly like widths (2, 2)
    assert (uniform.widths, uniform.name, uniform.max_depth) == ((2, 2), "2x2", 2)
    assert StaticTree(STREE13).widths is None and StaticTree(STREE13).capped(2).tree.layers == STREE13.layers[:2]


def test_drafting_indices_of_stree13():
    """Fed nodes (with children) per depth, where each node's token sits in the [fed rows, branch] block."""
    assert STREE13.fed == ((0,), (0, 1), (0, 1), (0,)) and STREE13.branch == (3, 2, 2, 3)
    assert [STREE13.take_list(d) for d in (1, 2, 3, 4)] == [None, [0, 1, 2], [0, 1, 2], None]
    assert [STREE13.feed_list(d) for d in (1, 2, 3)] == [[0, 1], [0, 1], [0]]
    assert [STREE13.parent_rows(d) for d in (1, 2, 3)] == [[0, 0], [0, 0], [0]]
    irregular = parse_tree("parents:0,0,0/0,2,2/1")  # the middle root child has no children
    assert irregular.take_list(2) == [0, 2, 3] and irregular.feed_list(1) == [0, 2]
    # accepted root paths: how many leading nodes were fed (the drafter rolls back to the last of them)
    assert [STREE13.fed_prefix(p) for p in ([0, 3, 6, 9], [1, 5], [2], [0, 4, 8], [])] == [3, 1, 0, 2, 0]


@pytest.mark.parametrize("text,match", [
    ("parents:0,0/0,2", r"layer 2, node 1: parent index 2 is out of range; it must index layer 1's 2 nodes"),
    ("parents:1", r"layer 1, node 0: parent index 1 is out of range; it must index the root \(0\)"),
    ("parents:0,0//0", r"layer 2 is empty"),
    ("parents:", r"layer 1 is empty"),
    ("parents:0,0/1,0", r"lists parent 0 after 1.*parents in increasing order"),
    ("parents:0,x", r"cannot read the tree 'parents:0,x'"),
    ("stree12", r"comma-separated integers.*parents:0,0,0/0,0,1/0,0,1/0,0,0.*stree13"),
    ("3,0", r"every tree width must be >= 1"),
])
def test_bad_tree_text_gets_one_clear_error(text, match):
    with pytest.raises(RecipeError, match=match) as err:
        parse_tree(text)
    assert "--tree" in str(err.value)
    args = command.configure(argparse.ArgumentParser()).parse_args(["--target", "t", "--bench", "b", "--tree", text])
    with pytest.raises(RecipeError, match=match):
        command.config_from_args(args)


def test_a_tree_beyond_the_targets_context_is_refused(drafters):
    small = load_target(tiny_llama(vocab=VOCAB, ctx=12))
    drafter = load_drafter(tiny_mamba2(vocab=VOCAB), small)
    with pytest.raises(RecipeError, match=r"--tree stree13 has 12 draft tokens; .* holds 13, beyond the target's "
                                          r"context of 12 tokens"):
        build_decoder("tree", small, drafter, tree=STREE13)
    with pytest.raises(RecipeError, match=r"--ucb-trees 4x4 has 20 draft tokens"):
        build_decoder("ucb", small, drafter, ucb_trees=[(1,), (4, 4)])
    res = build_decoder("tree", small, drafter, tree="parents:0,0,0/0,0,1/0,0,1").generate([1, 2], max_new_tokens=5)
    assert res.tokens == greedy_reference(small, [1, 2], 5)


def _next_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("kind", ["transformer", "mamba", "mamba2"])
def test_the_rth_child_takes_its_parents_rth_ranked_token(drafters, kind):
    drafter = drafters[kind]
    drafter.reset()
    tree = drafter.draft(SEQ, STREE13, SamplingParams(), torch.Generator().manual_seed(0))
    assert tree.parents == STREE13.parents and tree.depths == [1] * 3 + [2] * 3 + [3] * 3 + [4] * 3
    assert not tree.is_chain
    for node in range(-1, len(tree)):
        kids = tree.children(node)
        if kids:
            path = root_path(tree.parents, node) if node >= 0 else []
            logits_V = _next_logits(drafter.model, SEQ + [tree.tokens[j] for j in path])
            assert [tree.tokens[k] for k in kids] == torch.topk(logits_V, len(kids)).indices.tolist(), (kind, node)


@pytest.mark.parametrize("kind", ["transformer", "mamba", "mamba2"])
def test_sampled_children_have_q_rows_on_the_nodes_with_children(drafters, kind):
    drafter, params = drafters[kind], SamplingParams(temperature=1.0)
    drafter.reset()
    tree = drafter.draft(SEQ, STREE13, params, torch.Generator().manual_seed(1))
    for node in range(-1, len(tree)):
        q_V = tree.q_probs[node + 1]
        if tree.children(node):
            path = root_path(tree.parents, node) if node >= 0 else []
            want_V = probs_from_logits(_next_logits(drafter.model, SEQ + [tree.tokens[j] for j in path]), params)
            torch.testing.assert_close(q_V, want_V.to(q_V.dtype), rtol=1e-5, atol=1e-6)
            assert all(float(q_V[tree.tokens[k]]) > 0 for k in tree.children(node))
        else:
            assert float(q_V.abs().sum()) == 0.0  # a leaf's children are never drawn


@pytest.mark.parametrize("kind", ["transformer", "mamba", "mamba2"])
def test_rollback_to_any_stree13_path_equals_reencoding(drafters, kind):
    """Accept paths ending at leaves of every depth, at nodes with children, and nothing: the drafter's
    state (SSM states; K/V through the next logits) equals encoding the committed sequence afresh."""
    drafter, params, gen = drafters[kind], SamplingParams(), torch.Generator().manual_seed(2)
    drafter.reset()
    seq = list(SEQ)
    for node in [11, 5, 2, 8, -1, 7, 4, 0, 10]:
        tree = drafter.draft(seq, STREE13, params, gen)
        path = root_path(tree.parents, node) if node >= 0 else []
        drafter.accept(path)
        seq = seq + [tree.tokens[j] for j in path] + [int(torch.randint(0, VOCAB, (), generator=gen))]
        if kind != "transformer":
            assert drafter.consumed == len(seq) - 1 - (len(path) - STREE13.fed_prefix(path))
            assert_states_are_reencoded(drafter, seq)
        got_V = drafter._sync(seq).float()
        torch.testing.assert_close(got_V, _next_logits(drafter.model, seq).float(), rtol=1e-4, atol=1e-5)
