"""The decoding methods, registered once with their options; `draftforge eval`'s flags and its runner read this.

A method names the options it reads; an option has a CLI flag, a parser for the flag's text, a
check, a default and a help line. `build(method, target, drafter, **options)` makes a decoder.

    register_method(Method("mine", "my controller", needs_drafter=True, options=("chain_length",),
                           make=lambda target, drafter, o: SpeculativeDecoder("mine", target, drafter, Mine(o))))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from draftforge.decode.tree import validate_widths
from draftforge.decode.tree_shape import (
    OTHER_FORMS,
    PARENTS_PREFIX,
    TREE_PRESETS,
    TreeShape,
    parse_tree,
    tree_name,
    tree_size,
)
from draftforge.errors import DraftforgeError, RecipeError


def parse_widths(text: str, flag: str = "--tree") -> tuple[int, ...] | TreeShape:
    """'3,2,2,1' -> (3, 2, 2, 1); 'parents:0,0,0/0,0,1' or a preset ('stree13') -> TreeShape; checked."""
    text = str(text).strip()
    if text in TREE_PRESETS or text.startswith(PARENTS_PREFIX):
        try:
            return parse_tree(text)
        except DraftforgeError as e:
            raise RecipeError(f"{flag} {text!r}: {e}") from None
    try:
        widths = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise RecipeError(f"{flag} expects comma-separated integers like 3,2,2,1, got {text!r} (or give "
                          f"{OTHER_FORMS})") from None
    return check_widths(widths, flag)


def check_widths(widths, where: str = "tree") -> tuple[int, ...] | TreeShape:
    """A widths tuple checked, a TreeShape (checked when built) as is, a string parsed as --tree reads it."""
    if isinstance(widths, TreeShape):
        return widths
    if isinstance(widths, str):
        return parse_widths(widths, where)
    try:
        return validate_widths(widths)
    except DraftforgeError:
        raise RecipeError(f"{where} {tuple(widths)}: every tree width must be >= 1, i.e. a positive integer "
                          "(a tree needs every width >= 1, e.g. 3,2,2,1)") from None


def check_tree_context(trees, target, flag: str) -> None:
    """One verification forward holds the root and every draft token: refuse trees beyond the context."""
    ctx = getattr(target, "max_context", None)
    for tree in trees:
        size = tree_size(tree)
        if ctx is not None and 1 + size > ctx:
            raise RecipeError(f"{flag} {tree_name(tree)} has {size} draft tokens; with the root one verification "
                              f"forward holds {1 + size}, beyond the target's context of {ctx} tokens: use a "
                              "smaller tree")


def _positive_int(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RecipeError(f"{where} must be >= 1, got {value!r}")
    return value


def _non_negative(value, where: str) -> float:
    if value is None or value < 0:
        raise RecipeError(f"{where} must be >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Option:
    name: str  # keyword of build() and field of EvalConfig
    flag: str
    parse: Callable[[str], Any]  # the flag's text -> value
    check: Callable[[Any], Any]  # value -> checked value, or RecipeError
    default: Any
    help: str
    repeat: bool = False  # the flag is given once per item of a list value


OPTIONS: dict[str, Option] = {}


def register_option(option: Option) -> Option:
    OPTIONS[option.name] = option
    return option


@dataclass(frozen=True)
class Method:
    name: str
    help: str
    needs_drafter: bool
    make: Callable  # (target, drafter, options dict) -> decoder with .generate(...)
    options: tuple[str, ...] = ()
    baseline: bool = False  # an external baseline (hf_assisted): eval may skip it when it cannot run


METHODS: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    for name in method.options:
        if name not in OPTIONS:
            raise ValueError(f"method {method.name!r} reads option {name!r}, which is not registered")
    METHODS[method.name] = method
    return method


def method_names() -> tuple[str, ...]:
    return tuple(METHODS)


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise DraftforgeError(f"unknown decoding method {name!r}; choose one of {', '.join(METHODS)}")
    return METHODS[name]


def resolve_options(method: str, given: dict) -> dict:
    """The method's options: given values (None = default) checked, defaults filled in."""
    out = {}
    for name in get_method(method).options:
        value = given.get(name)
        option = OPTIONS[name]
        out[name] = option.default if value is None else option.check(value)
    return out


def build(method: str, target, drafter=None, **options):
    """A decoder for `method`; `ar` ignores the drafter, the others need one."""
    m = get_method(method)
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise DraftforgeError(f"unknown decoding option(s) {sorted(unknown)}; known: {', '.join(OPTIONS)}")
    if m.needs_drafter and drafter is None:
        raise DraftforgeError(f"method {method!r} needs a drafter (load one with load_drafter)")
    if m.needs_drafter and hasattr(drafter, "paired_target"):  # e.g. EESD: verification is split after layer N
        target = drafter.paired_target(target)
    return m.make(target, drafter if m.needs_drafter else None, resolve_options(method, options))


# ---------------------------------------------------------------- built-in options and methods

def _register_builtins() -> None:
    from draftforge.decode.control import DEFAULT_UCB_TREES, FixedChain, FixedTree, NoDraft, UCBTree
    from draftforge.decode.engine import HFAssistedDecoder, HFPromptLookupDecoder, SpeculativeDecoder

    register_option(Option("chain_length", "--chain-length", int, lambda v: _positive_int(v, "--chain-length"), 5,
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
    register_option(Option("ucb_lambda", "--ucb-lambda", float, lambda v: _non_negative(v, "--ucb-lambda"), 0.1,
                           "UCB exploration weight λ_UCB (default 0.1)"))
    register_option(Option("lambda_gamma", "--lambda-gamma", float, lambda v: _non_negative(v, "--lambda-gamma"),
                           None, "draft-cost weight λ_γ in the UCB reward (default: T_draft/T_target measured online)"))
    register_option(Option("lookup_tokens", "--lookup-tokens", int, lambda v: _positive_int(v, "--lookup-tokens"),
                           10, "drafts per round of transformers' prompt lookup (prompt_lookup_num_tokens; default 10)"))

    def spec(name, controller):
        return lambda target, drafter, o: SpeculativeDecoder(name, target, drafter, controller(o))

    register_method(Method("ar", "plain autoregressive decoding (always run as the baseline)", False,
                           spec("ar", lambda o: NoDraft())))
    register_method(Method("chain", "a chain of --chain-length drafts per round", True,
                           spec("chain", lambda o: FixedChain(o["chain_length"])), ("chain_length",)))
    def fixed_tree(target, drafter, o):
        check_tree_context([o["tree"]], target, "--tree")
        return SpeculativeDecoder("tree", target, drafter, FixedTree(o["tree"]))

    def ucb(target, drafter, o):
        check_tree_context(o["ucb_trees"], target, "--ucb-trees")
        return SpeculativeDecoder("ucb", target, drafter, UCBTree(o["ucb_trees"], o["ucb_lambda"], o["lambda_gamma"]))

    register_method(Method("tree", "a static tree (--tree) drafted by batch expansion, verified in one forward",
                           True, fixed_tree, ("tree",)))
    register_method(Method("ucb", "a UCB bandit over tree shapes (Mamba Drafters §4.2)", True, ucb,
                           ("ucb_trees", "ucb_lambda", "lambda_gamma")))
    register_method(Method("hf_assisted", "transformers' assisted generation (Transformer drafters only)", True,
                           lambda target, drafter, o: HFAssistedDecoder(target, drafter), baseline=True))
    # Not baseline=True: eval adds every baseline whenever a drafter is given; this one runs only when named
    # (--methods or --baseline), and needs no drafter.
    register_method(Method("hf_prompt_lookup", "transformers' prompt lookup decoding (--lookup-tokens drafts copied "
                           "from the prompt by n-gram match; KV-cache targets only)", False,
                           lambda target, drafter, o: HFPromptLookupDecoder(target, o["lookup_tokens"]),
                           ("lookup_tokens",)))
    from draftforge.decode.length_control import register_length_methods

    register_length_methods()  # beta_ts, cali_ts, specdec_pp (EESD §3.3; SpecDec++)
    from draftforge.decode import c2t, eagle2  # dynamic trees, registered from their own modules
    eagle2.register()
    c2t.register()
    register_method(Method("eesd", "EESD early-exit drafter (an eesd export): a chain of --chain-length drafts "
                           "from the target's first N layers + exit head, verified by layers N+1..L", True,
                           _eesd_decoder, ("chain_length",)))


def _eesd_decoder(target, drafter, o):
    from draftforge.decode.control import FixedChain
    from draftforge.decode.early_exit import make_eesd_decoder

    return make_eesd_decoder(target, drafter, FixedChain(o["chain_length"]))


_register_builtins()
