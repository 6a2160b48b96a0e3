"""One way to declare a setting, for recipe sections, decoding-method options, eval settings and harvest jobs.

A setting is a dataclass field made with `option(default, help, ...)`: its default, a one-line help, and where
needed a value check `check(value, where) -> value`, a reader `parse(text)` for its flag's text, its flag, and
`repeat` (the flag is given once per item). A `Literal[...]` annotation lists the allowed values. From the same
declaration come the checks (`check_fields`: choices and checks, once, naming the key or flag), "did you mean"
for an unknown name (`unknown_key`), the help rows (`field_rows`) and the command-line flags (`add_flags`,
`values_from_args`), so `draftforge train --help-recipe`, `draftforge eval --help` and a recipe say the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
import typing
from dataclasses import MISSING, field
from typing import Any, Callable, Literal

from draftforge.errors import RecipeError


def option(default: Any = MISSING, help: str = "", *, check: Callable | None = None,
           parse: Callable[[str], Any] | None = None, flag: str | None = None, repeat: bool = False,
           cli: bool = True, metavar: str | None = None, aliases: tuple[str, ...] = (), group: str | None = None):
    """A setting: a dataclass field with its default (a list or dict default is copied per instance; MISSING =
    required), a one-line help and optionally `check(value, where)` -> the checked value (or RecipeError),
    `parse(text)` for its flag's text (default: from the annotation), its flag (default --the-name; a bool whose
    flag starts with --no- stores False), `repeat` (the flag is given once per item of a tuple value) and
    `cli=False` for a setting that has no flag; `metavar` names its value in --help; `aliases`, more flags
    for it (-n); `group`: settings of one group name are alternatives, exactly one of which must be given."""
    meta = {"help": help, "check": check, "parse": parse, "flag": flag, "repeat": repeat, "cli": cli,
            "metavar": metavar, "aliases": aliases, "group": group}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def help_of(f: dataclasses.Field) -> str:
    return f.metadata.get("help", "")


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else MISSING


def literal_choices(tp) -> tuple | None:
    """The values of a Literal[...] annotation (also inside Optional), else None."""
    for t in (tp, *typing.get_args(tp)):
        if typing.get_origin(t) is Literal:
            return typing.get_args(t)
    return None


def reader(tp) -> Callable[[str], Any]:
    """How a flag's text becomes a value of annotation `tp`: int / float / str (Optional[X] reads as X; Literal
    and others as str)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return {int: int, float: float}.get(tp, str)


# ---------------------------------------------------------------- value checks: check(value, where) -> value


def positive_int(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RecipeError(f"{where} must be >= 1, got {value!r}")
    return value


def non_negative_int(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RecipeError(f"{where} must be an integer >= 0, got {value!r}")
    return value


def non_negative(value, where: str) -> float:
    if value is None or value < 0:
        raise RecipeError(f"{where} must be >= 0, got {value!r}")
    return float(value)


def positive(value, where: str) -> float:
    if value is None or float(value) <= 0:
        raise RecipeError(f"{where} must be > 0, got {value!r}")
    return float(value)


def unit_interval(value, where: str, open_: bool = False) -> float:
    """A value in [0, 1], or in (0, 1) with `open_`."""
    ok = value is not None and (0.0 < float(value) < 1.0 if open_ else 0.0 <= float(value) <= 1.0)
    if not ok:
        raise RecipeError(f"{where} must be in {'(0, 1)' if open_ else '[0, 1]'}, got {value!r}")
    return float(value)


def one_of(value, where: str, choices):
    if value not in choices:
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise RecipeError(f"{where} must be one of {', '.join(map(str, choices))}, got {value!r}{hint}")
    return value


def check_fields(obj, where: Callable[[dataclasses.Field], str] = flag_of) -> None:
    """Check every set field of dataclass `obj` once: Literal choices, then the field's `check`; a checked value
    replaces the given one (frozen dataclasses too). None is a field's "not set" and is not checked."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None:
            continue
        choices = literal_choices(hints[f.name])
        if choices:
            value = one_of(value, where(f), choices)
        check = f.metadata.get("check")
        if check is not None:
            value = check(value, where(f))
        object.__setattr__(obj, f.name, value)


def unknown_key(key, names, what: str, whose: str = "") -> RecipeError:
    """The error for a name that is not one of `names` ("unknown {what} 'key'{whose}: did you mean ...")."""
    names = list(names)
    close = difflib.get_close_matches(str(key), names, n=1)
    hint = (f"did you mean {close[0]!r}?" if close else f"it reads {', '.join(names)}" if names else
            "it has no settings")
    return RecipeError(f"unknown {what} {key!r}{whose}: {hint}")


def build_checked(cls, given: dict, what: str = "setting", whose: str = ""):
    """`cls(**given)` after refusing an unknown name (None values = defaults)."""
    names = [f.name for f in dataclasses.fields(cls)]
    for key in given:
        if key not in names:
            raise unknown_key(key, names, what, whose)
    return cls(**{k: v for k, v in given.items() if v is not None})


def field_rows(cls: type, prefix: str = "", skip=lambda f: False) -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every leaf setting of `cls`, nested dataclasses flattened."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if skip(f):
            continue
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            rows.extend(field_rows(hints[f.name], key + ".", skip))
            continue
        default = default_of(f)
        rows.append((key, "required" if default is MISSING else repr(default), help_of(f)))
    return rows


# ---------------------------------------------------------------- command-line flags


def cli_fields(cls: type) -> list[dataclasses.Field]:
    """The settings that have a flag, the class's own first, then those it inherits (a job's common settings)."""
    own = cls.__dict__.get("__annotations__", {})
    fields = [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True) and "help" in f.metadata]
    return [f for f in fields if f.name in own] + [f for f in fields if f.name not in own]


def add_flags(parser: argparse.ArgumentParser, cls: type, *, defaults: dict | None = None, group=None) -> None:
    """One flag per setting of `cls` (those with `cli`): its help and default from the declaration (`defaults`
    overrides a shown default by field name), Literal values as choices, a bool as a switch, a repeated setting
    as a flag given once or more with one or more values each (`--temperature 0 1`, `--temperature 0,1`)."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, Any] = {}
    for f in cli_fields(cls):
        name = f.metadata.get("group")
        if name and name not in groups:
            groups[name] = (group or parser).add_mutually_exclusive_group(required=True)
        target = groups[name] if name else (group or parser)
        flag, tp = flag_of(f), hints[f.name]
        default = (defaults or {}).get(f.name, default_of(f))
        text = ",".join(map(str, default)) if isinstance(default, tuple) else default
        hidden = default is MISSING or default is None or isinstance(default, bool) or default == ()
        shown = "" if hidden else f" (default {text})"
        kw: dict[str, Any] = {"dest": f.name, "help": help_of(f) + shown}
        if tp is bool or tp == "bool":
            kw["action"] = "store_false" if flag.startswith("--no-") else "store_true"
        else:
            choices = literal_choices(tp)
            kw.update(action="store", choices=choices, metavar=None if choices else _metavar(f, tp))
            if f.metadata.get("repeat"):
                kw.update(action="extend", nargs="+")
            if not name:
                kw["required"] = default is MISSING
        target.add_argument(*f.metadata.get("aliases", ()), flag, **kw)
        if not f.metadata.get("repeat"):  # a repeated flag starts empty; values_from_args gives its default
            parser.set_defaults(**{f.name: None if default is MISSING else default})


def _metavar(f: dataclasses.Field, tp) -> str:
    by_type = {int: "N", float: "X"}.get(reader(tp))
    return f.metadata.get("metavar") or by_type or f.name.split("_")[-1].upper().removesuffix("S")


def values_from_args(args: argparse.Namespace, cls: type) -> dict:
    """The flags of `cls` read back from parsed `args`, each text through the field's reader: {name: value}. A
    repeated flag gives a tuple (a reader that returns a tuple, such as a comma list, adds its items); a flag not
    given gives the declared default."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in cli_fields(cls):
        raw = getattr(args, f.name, None)
        read = f.metadata.get("parse") or reader(hints[f.name])
        if raw is None:
            default = default_of(f)
            out[f.name] = None if default is MISSING else default
        elif f.metadata.get("repeat"):
            items = [parse_text(read, r, f) for r in raw]
            out[f.name] = tuple(x for item in items for x in (item if isinstance(item, tuple) else (item,)))
        else:
            out[f.name] = parse_text(read, raw, f) if isinstance(raw, str) else raw
    return out


def parse_text(read: Callable[[str], Any], text: str, f: dataclasses.Field):
    try:
        return read(text)
    except ValueError:
        what = help_of(f).split(". ")[0].split(" (")[0]  # the help's first clause: the whole help made a paragraph
        raise RecipeError(f"{flag_of(f)}: cannot read {text!r} ({what})") from None
