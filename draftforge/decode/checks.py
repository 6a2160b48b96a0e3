"""Checks that every decoding method's options share: value validators, tree widths, and the limits a
target or drafter sets. Each raises a RecipeError naming the flag; none knows any method. The value
checks take (value, flag), as a method option's `check` is called (decode/methods/__init__.py):

    chain_length: int = option(5, "draft tokens per round", check=positive_int)
"""

from __future__ import annotations

from draftforge.decode.tree_shape import TreeShape, parse_tree, widths_shape
from draftforge.errors import DraftforgeError, RecipeError
from draftforge.options import (  # noqa: F401  (the value checks every setting shares: options.py)
    non_negative, non_negative_int, one_of, positive, positive_int, unit_interval)

# ---------------------------------------------------------------- values


# ---------------------------------------------------------------- tree widths (--tree and its kin)


def check_widths(widths, where: str = "tree") -> TreeShape:
    """A tree option's value as its TreeShape: a TreeShape as is, text read by `parse_tree`, widths checked."""
    if isinstance(widths, TreeShape):
        return widths
    if isinstance(widths, str):
        return parse_tree(widths, where)
    return widths_shape(widths, where)


def parse_widths(text: str, flag: str = "--tree") -> TreeShape:
    """Deprecated: `parse_tree(text, flag)` (draftforge/decode/tree_shape.py) is the one reader of a tree's text."""
    import warnings

    warnings.warn("draftforge.decode.checks.parse_widths is parse_tree now (draftforge.decode.parse_tree); the old "
                  "name goes in the next release", DeprecationWarning, stacklevel=2)
    return parse_tree(text, flag)


# ---------------------------------------------------------------- what the target and drafter allow


def check_tree_context(trees, target, flag: str) -> None:
    """One verification forward holds the root and every draft token: refuse trees beyond the context."""
    ctx = getattr(target, "max_context", None)
    for tree in trees:
        size = tree.size
        if ctx is not None and 1 + size > ctx:
            raise RecipeError(f"{flag} {tree.name} has {size} draft tokens; with the root one verification "
                              f"forward holds {1 + size}, beyond the target's context of {ctx} tokens: use a "
                              "smaller tree")


def check_context(tokens: int, target, flag: str) -> None:
    ctx = getattr(target, "max_context", None)
    if ctx is not None and tokens > ctx:
        raise RecipeError(f"{flag} {tokens} is beyond the target's context of {ctx} tokens; one verification "
                          f"forward must fit in it, use at most {ctx}")


def draft_vocab_size(drafter, target) -> int:
    """Tokens the drafter can propose: its reduced draft vocabulary, else the target's vocabulary."""
    d2t = drafter.d2t
    return int(d2t.numel()) if d2t is not None else int(target.vocab_size)


def check_dynamic_drafter(drafter, method: str) -> None:
    """A method that grows its tree from the drafter's next-token probabilities (EAGLE-2, C2T) needs a drafter
    that follows dynamic trees: refused when the decoder is built, not at the first round of a decode."""
    if drafter is not None and not drafter.follows_dynamic_trees:
        raise RecipeError(f"method {method} ranks the drafter's next-token probabilities to grow its tree, and the "
                          f"{drafter.kind} drafter has none to follow it with (begin / feed / accept_nodes); use "
                          "chain, tree or ucb with it")
