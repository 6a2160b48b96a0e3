"""The core methods: `ar` (the baseline every run measures against), `chain`, `tree` (static trees) and `ucb`
(a bandit over tree shapes): the controllers of control.py run by the engine's loop. Registers them with
their options; `chain_length` is read by `eesd` too (decode/early_exit.py).
"""

from __future__ import annotations

from draftforge.decode.checks import check_tree_context, check_widths, non_negative, parse_widths, positive_int
from draftforge.decode.control import DEFAULT_UCB_TREES, FixedChain, FixedTree, NoDraft, UCBTree
from draftforge.decode.engine import SpeculativeDecoder
from draftforge.decode.methods import Method, Option, register_method, register_option

register_option(Option("chain_length", "--chain-length", int, lambda v: positive_int(v, "--chain-length"), 5,
                       "draft tokens per round for chain (default 5)"))
register_option(Option("tree", "--tree", parse_widths, check_widths, (3, 2, 2, 1),
                       "static tree: children per node at each depth, e.g. 3,2,2,1 (default); or parent "
                       "lists per layer, each node's parent index among the previous layer's nodes, e.g. "
                       "parents:0,0,0/0,0,1/0,0,1/0,0,0; or a preset: stree13 (STree's 13-token config A, "
                       "that parent list)"))
register_option(Option("ucb_trees", "--ucb-trees", lambda t: parse_widths(t, "--ucb-trees"),
                       lambda v: tuple(check_widths(w, "--ucb-trees") for w in v), DEFAULT_UCB_TREES,
                       "a UCB candidate tree like 4,2,1 (or any --tree form); repeat for each arm (default: "
                       "5 shapes from a chain of 5 to 3,2,2,1)", repeat=True))
register_option(Option("ucb_lambda", "--ucb-lambda", float, lambda v: non_negative(v, "--ucb-lambda"), 0.1,
                       "UCB exploration weight λ_UCB (default 0.1)"))
register_option(Option("lambda_gamma", "--lambda-gamma", float, lambda v: non_negative(v, "--lambda-gamma"),
                       None, "draft-cost weight λ_γ in the UCB reward (default: T_draft/T_target measured online)"))


def _spec(name, controller):
    return lambda target, drafter, o: SpeculativeDecoder(name, target, drafter, controller(o))


def make_tree(target, drafter, o):
    check_tree_context([o["tree"]], target, "--tree")
    return SpeculativeDecoder("tree", target, drafter, FixedTree(o["tree"]))


def make_ucb(target, drafter, o):
    check_tree_context(o["ucb_trees"], target, "--ucb-trees")
    return SpeculativeDecoder("ucb", target, drafter, UCBTree(o["ucb_trees"], o["ucb_lambda"], o["lambda_gamma"]))


register_method(Method("ar", "plain autoregressive decoding (always run as the baseline)", False,
                       _spec("ar", lambda o: NoDraft())))
register_method(Method("chain", "a chain of --chain-length drafts per round", True,
                       _spec("chain", lambda o: FixedChain(o["chain_length"])), ("chain_length",)))
register_method(Method("tree", "a static tree (--tree) drafted by batch expansion, verified in one forward",
                       True, make_tree, ("tree",)))
register_method(Method("ucb", "a UCB bandit over tree shapes (Mamba Drafters §4.2)", True, make_ucb,
                       ("ucb_trees", "ucb_lambda", "lambda_gamma")))
