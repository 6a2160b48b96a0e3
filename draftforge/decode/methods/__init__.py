"""The method registry: decoding methods and their typed options, each registered once; `draftforge eval`'s
flags and its runner read it. It knows no method: each method's module registers its own (decode/__init__.py
imports them all, so `import draftforge.decode` fills the registry).

A method declares its options as a frozen dataclass whose fields are made with `option(...)` (a default, a
one-line help, the CLI flag, how the flag's text is read and how a value is checked), like a recipe section.
Building the dataclass checks every value, once; an unknown key is named with "did you mean". Two methods
that read the same option (chain and eesd read `chain_length`) declare a field of the same name, and the
CLI gives it one flag; declaring it with another flag or type is an error at registration.

    @dataclass(frozen=True)
    class MineOptions(MethodOptions):
        chain_length: int = option(5, "draft tokens per round", check=positive_int)

    register_method(Method("mine", "my controller", needs_drafter=True, options=MineOptions,
                           make=lambda target, drafter, o: SpeculativeDecoder("mine", target, drafter, Mine(o))))

`build(method, target, drafter, **options)` (or `options=MineOptions(...)`) makes a decoder.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass
from typing import Any, Callable

from draftforge.errors import DraftforgeError, RecipeError
from draftforge.options import build_checked, check_fields, flag_of, help_of, literal_choices, option, reader

__all__ = ["Method", "MethodOptions", "NoOptions", "OptionInfo", "build", "get_method", "literal_choices",
           "method_names", "option", "per_method", "readers", "register_method", "resolve_options", "suggest"]

# ---------------------------------------------------------------- options
# `option`, `literal_choices` and the checks are draftforge/options.py's: one dialect for every setting.

@dataclass(frozen=True)
class OptionInfo:
    """One option as the CLI sees it: the field of some method's options dataclass."""

    name: str
    flag: str
    help: str
    default: Any
    type: Any
    repeat: bool
    read: Callable[[str], Any]  # the flag's text -> a value

    def parse(self, text: str) -> Any:
        """The flag's text -> a value (checked later, when the options dataclass is built)."""
        try:
            return self.read(text)
        except ValueError:
            raise RecipeError(f"{self.flag}: cannot read {text!r} ({self.help})") from None


@dataclass(frozen=True)
class MethodOptions:
    """Base of every method's options: building one checks each value (None = the field's default)."""

    def __post_init__(self):
        check_fields(self)

    @classmethod
    def from_dict(cls, given: dict, method: str = "") -> MethodOptions:
        """Values by option name (None = default); an unknown name is refused with 'did you mean'."""
        return build_checked(cls, given, "option", f" for method {method or cls.__name__!r}")


@dataclass(frozen=True)
class NoOptions(MethodOptions):
    """A method without options (ar, hf_assisted)."""


def option_infos(cls: type[MethodOptions]) -> list[OptionInfo]:
    hints = typing.get_type_hints(cls)
    return [OptionInfo(f.name, flag_of(f), help_of(f), f.default, hints[f.name],
                       bool(f.metadata.get("repeat")), f.metadata.get("parse") or reader(hints[f.name]))
            for f in dataclasses.fields(cls)]


# ---------------------------------------------------------------- methods


@dataclass(frozen=True)
class Method:
    name: str
    help: str
    needs_drafter: bool
    make: Callable  # (target, drafter, options dataclass) -> decoder with .generate(...)
    options: type[MethodOptions] = NoOptions
    baseline: bool = False  # an external baseline (hf_assisted): eval may skip it when it cannot run
    rows: Callable[[Any], tuple[int, ...]] = lambda options: ()  # static verification sizes (the cost model's)
    dynamic_trees: bool = False  # drafts through a TreeBuilder (begin / feed): drafters must follow dynamic trees


METHODS: dict[str, Method] = {}
OPTIONS: dict[str, OptionInfo] = {}  # every option of every method, by name: one CLI flag each


def register_method(method: Method) -> Method:
    """Add `method`; ValueError when its name is registered already, its options are not a MethodOptions
    dataclass, or one of them clashes with another method's option of the same name (other flag or type)."""
    if method.name in METHODS:
        raise ValueError(f"decoding method {method.name!r} is registered already")
    if not (isinstance(method.options, type) and issubclass(method.options, MethodOptions)):
        raise ValueError(f"method {method.name!r}: options must be a MethodOptions dataclass, got {method.options!r}")
    for info in option_infos(method.options):
        known = OPTIONS.get(info.name)
        if known is not None and (known.flag, known.type) != (info.flag, info.type):
            raise ValueError(f"method {method.name!r} declares option {info.name!r} as {info.flag} ({info.type}); "
                             f"another method has it as {known.flag} ({known.type})")
        clash = [o.name for o in OPTIONS.values() if o.flag == info.flag and o.name != info.name]
        if clash:
            raise ValueError(f"method {method.name!r}: flag {info.flag} is option {clash[0]!r} already")
    for info in option_infos(method.options):
        OPTIONS.setdefault(info.name, info)
    METHODS[method.name] = method
    return method


def method_names() -> tuple[str, ...]:
    return tuple(METHODS)


def suggest(name: str) -> str:
    """'did you mean ...? choose one of ...' for a method name that is not registered."""
    close = difflib.get_close_matches(name, list(METHODS), n=1)
    return (f"did you mean {close[0]!r}? " if close else "") + f"choose one of {', '.join(METHODS)}"


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise RecipeError(f"unknown decoding method {name!r}; {suggest(name)}")
    return METHODS[name]


def readers(option_name: str) -> list[str]:
    """The methods that read an option."""
    return [m.name for m in METHODS.values() if option_name in {f.name for f in dataclasses.fields(m.options)}]


def per_method(values: dict, methods) -> tuple[dict[str, dict], list[str]]:
    """Option values by name (None = not given) spread over the methods of `methods` that read them:
    ({method: {name: value}}, the names none of them reads). One value may go to several methods."""
    out: dict[str, dict] = {}
    unread = []
    for name, value in values.items():
        if value is None:
            continue
        takers = [m for m in readers(name) if m in methods]
        for m in takers:
            out.setdefault(m, {})[name] = value
        if not takers:
            unread.append(name)
    return out, unread


def resolve_options(method: str, given: MethodOptions | dict | None = None) -> MethodOptions:
    """The method's options dataclass: `given` as is when it already is one, else built (and so checked) from
    a dict of values by option name (None = default)."""
    cls = get_method(method).options
    if isinstance(given, cls):
        return given
    if isinstance(given, MethodOptions):
        raise RecipeError(f"method {method!r} takes {cls.__name__}, got {type(given).__name__}")
    return cls.from_dict(dict(given or {}), method)


def build(method: str, target, drafter=None, options: MethodOptions | dict | None = None, **values):
    """A decoder for `method`; `ar` ignores the drafter, the others need one. Options come as a dataclass
    (`options=`) or as keywords (`chain_length=3`), not both."""
    m = get_method(method)
    if options is not None and values:
        raise DraftforgeError("give the method's options either as options=... or as keywords, not both")
    resolved = resolve_options(method, options if options is not None else values)
    if m.needs_drafter and drafter is None:
        raise DraftforgeError(f"method {method!r} needs a drafter (load one with load_drafter)")
    from draftforge.decode.drafters.base import Drafter  # the contract (no method): imported when a decoder is built

    if m.needs_drafter and isinstance(drafter, Drafter):  # anything else reaches `make`, which says what it needs
        target = verifying_target(drafter, target)
    return m.make(target, drafter if m.needs_drafter else None, resolved)


def verifying_target(drafter, target):
    """The target that verifies `drafter`'s drafts: the one it was paired with when it was loaded (load_drafter
    binds it; an EESD head is paired with the early-exit split of the same model), or, for a drafter built by hand
    and never bound, its pairing with `target` now (`Drafter.attach`). A drafter loaded for another model is
    refused."""
    bound = drafter.target
    if bound is None:
        return drafter.attach(target)
    if bound is not target and bound.model is not target.model:
        raise DraftforgeError(f"this {drafter.kind} drafter was loaded for another target model; load it with "
                              "load_drafter(path, target) for the target you decode with (for generate(): "
                              "load_drafter(path, model), the model whose generate() you call)")
    return bound
