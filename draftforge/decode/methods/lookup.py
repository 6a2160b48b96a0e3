"""`lookup`: draftforge's own prompt lookup as a method of any run, a chain of `--lookup-chain-length` drafts copied
by n-gram match (decode/drafters/lookup.py), whatever `--drafter` the run loaded.

It exists so the honest peer of a trained drafter runs in the same eval, rotated with it and measured against the
same AR: `--methods chain,lookup` with a trained drafter, or `--lookup-first ... --methods chain,lookup` to see
whether the trained drafter behind lookup adds anything over lookup alone. Before it, lookup ran in a separate eval
with `--drafter prompt-lookup`, and two evals' tokens per second are not comparable on a machine whose pace moves
between runs (docs/evaluation.md). Registers the method and its options `lookup_chain_length`, `lookup_spec`.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftforge.decode.checks import positive_int
from draftforge.decode.control import FixedChain
from draftforge.decode.engine import SpeculativeDecoder
from draftforge.decode.methods import Method, MethodOptions, option, register_method
from draftforge.errors import RecipeError


def _check_spec(spec, where: str) -> str:
    from draftforge.decode.loading import LOOKUP_FORM, lookup_options

    if lookup_options(spec) is None:  # a malformed prompt-lookup spec raises there, naming what is wrong
        raise RecipeError(f"{where} must be a prompt-lookup spec ({LOOKUP_FORM}), got {spec!r}")
    return spec


@dataclass(frozen=True)
class LookupOptions(MethodOptions):
    lookup_chain_length: int = option(5, "drafts per round of the lookup method (default 5)", check=positive_int)
    lookup_spec: str = option("prompt-lookup", "the lookup method's drafter: prompt-lookup or "
                              "prompt-lookup:KEY=N,... (keys ngram, min_ngram, tokens; default prompt-lookup)",
                              check=_check_spec)


def make_lookup(target, drafter, o: LookupOptions) -> SpeculativeDecoder:
    """A chain decoder over a prompt-lookup drafter of its own (the run's `drafter` is not used)."""
    from draftforge.decode.loading import load_drafter

    return SpeculativeDecoder("lookup", target, load_drafter(o.lookup_spec, target),
                              FixedChain(o.lookup_chain_length))


register_method(Method("lookup", "draftforge's prompt lookup, a chain of --lookup-chain-length copied drafts, in any "
                       "run (the peer of a trained drafter, timed in the same run)", False, make_lookup,
                       LookupOptions, rows=lambda o: (o.lookup_chain_length + 1,)))
