"""The method registry: decoding methods and their options, each registered once; `draftforge eval`'s flags
and its runner read it. It knows no method: each method's module registers its own (decode/__init__.py
imports them all, so `import draftforge.decode` fills the registry).

A method names the options it reads; an option has a CLI flag, a parser for the flag's text, a
check, a default and a help line. `build(method, target, drafter, **options)` makes a decoder.

    register_method(Method("mine", "my controller", needs_drafter=True, options=("chain_length",),
                           make=lambda target, drafter, o: SpeculativeDecoder("mine", target, drafter, Mine(o))))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from draftforge.decode.checks import check_widths, parse_widths  # noqa: F401  (callers import them from here)
from draftforge.errors import DraftforgeError


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
    """Add `option`; ValueError when its name is registered already (two methods would share one flag)."""
    if option.name in OPTIONS:
        raise ValueError(f"decoding option {option.name!r} is registered already")
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
    """Add `method`; ValueError when its name is registered already or it reads an option that is not."""
    if method.name in METHODS:
        raise ValueError(f"decoding method {method.name!r} is registered already")
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
