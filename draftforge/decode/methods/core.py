"""The core methods: `ar` (the baseline every run measures against), `chain`, `tree` (static trees) and `ucb`
(a bandit over tree shapes): the controllers of control.py run by the engine's loop. Registers them with
their options; `chain_length` is read by `eesd` too (decode/methods/eesd.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from draftforge.decode.checks import check_tree_context, check_widths, non_negative, positive_int
from draftforge.decode.tree_shape import parse_tree
from draftforge.decode.control import DEFAULT_UCB_TREES, FixedChain, FixedTree, NoDraft, UCBTree
from draftforge.decode.engine import SpeculativeDecoder
from draftforge.decode.methods import Method, MethodOptions, option, register_method
from draftforge.decode.tree_shape import TreeShape


@dataclass(frozen=True)
class ChainOptions(MethodOptions):
    chain_length: int = option(5, "draft tokens per round for chain (default 5)", check=positive_int)


@dataclass(frozen=True)
class TreeOptions(MethodOptions):
    tree: TreeShape = option(
        (3, 2, 2, 1), "static tree: children per node at each depth, e.g. 3,2,2,1 (default); or parent lists per "
        "layer, each node's parent index among the previous layer's nodes, e.g. parents:0,0,0/0,0,1/0,0,1/0,0,0; "
        "or a preset: stree13 (STree's 13-token config A, that parent list)", check=check_widths, parse=parse_tree)


def _check_trees(trees, flag: str) -> tuple[TreeShape, ...]:
    return tuple(check_widths(t, flag) for t in trees)


@dataclass(frozen=True)
class UCBOptions(MethodOptions):
    ucb_trees: tuple[TreeShape, ...] = option(
        DEFAULT_UCB_TREES, "a UCB candidate tree like 4,2,1 (or any --tree form); repeat for each arm (default: 5 "
        "shapes from a chain of 5 to 3,2,2,1)", check=_check_trees,
        parse=lambda text: parse_tree(text, "--ucb-trees"), repeat=True)
    ucb_lambda: float = option(0.1, "UCB exploration weight λ_UCB (default 0.1)", check=non_negative)
    lambda_gamma: float | None = option(
        None, "draft-cost weight λ_γ in the UCB reward (default: T_draft/T_target measured online)",
        check=non_negative)


def _spec(name, controller):
    return lambda target, drafter, o: SpeculativeDecoder(name, target, drafter, controller(o))


def make_tree(target, drafter, o: TreeOptions):
    check_tree_context([o.tree], target, "--tree")
    return SpeculativeDecoder("tree", target, drafter, FixedTree(o.tree))


def make_ucb(target, drafter, o: UCBOptions):
    check_tree_context(o.ucb_trees, target, "--ucb-trees")
    return SpeculativeDecoder("ucb", target, drafter, UCBTree(o.ucb_trees, o.ucb_lambda, o.lambda_gamma))


def chain_rows(o) -> tuple[int, ...]:
    """One verification of a chain: its drafts and the root."""
    return (o.chain_length + 1,)


register_method(Method("ar", "plain autoregressive decoding (always run as the baseline)", False,
                       _spec("ar", lambda o: NoDraft())))
register_method(Method("chain", "a chain of --chain-length drafts per round", True,
                       _spec("chain", lambda o: FixedChain(o.chain_length)), ChainOptions, rows=chain_rows))
register_method(Method("tree", "a static tree (--tree) drafted by batch expansion, verified in one forward",
                       True, make_tree, TreeOptions, rows=lambda o: (o.tree.size + 1,)))
register_method(Method("ucb", "a UCB bandit over tree shapes (Mamba Drafters §4.2)", True, make_ucb, UCBOptions,
                       rows=lambda o: tuple(t.size + 1 for t in o.ucb_trees)))
