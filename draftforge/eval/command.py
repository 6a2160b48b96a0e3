"""The `draftforge eval` subcommand: flags → EvalConfig → run_eval → Markdown table on stdout."""

from __future__ import annotations

import argparse

from draftforge.argcheck import EVAL_DEFAULTS, floats
from draftforge.decode import methods as method_registry
from draftforge.errors import RecipeError
from draftforge.eval.runner import EvalConfig, run_eval
from draftforge.options import add_flags, values_from_args


parse_floats = floats  # one reader of --temperature 0,1 for the light precheck and the command


def _first_sentence(text: str, limit: int = 96) -> str:
    """A method's help on one line of the --help listing, cut at a word (the whole text: docs/evaluation.md)."""
    if len(text) <= limit:
        return text
    return text[: limit - 1].rsplit(" ", 1)[0].rstrip(",;:(") + " …"


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `draftforge eval` flags to parser: one per EvalConfig setting, then one per method option."""
    p = parser
    add_flags(p, EvalConfig, defaults={"repeats": EVAL_DEFAULTS["repeats"]})
    width = max(len(m.name) for m in method_registry.METHODS.values())
    p.epilog = "methods (--methods):\n" + "\n".join(
        f"  {m.name:<{width}}  {_first_sentence(m.help)}" for m in method_registry.METHODS.values())
    for option in method_registry.OPTIONS.values():  # each method's options dataclass, as registered
        used_by = ", ".join(method_registry.readers(option.name))
        choices = method_registry.literal_choices(option.type)  # a Literal field: argparse lists its values
        p.add_argument(option.flag, dest=option.name, action="append" if option.repeat else "store",
                       choices=choices, metavar=None if choices else "VALUE", help=f"[{used_by}] {option.help}")
    return p


def method_options_from_args(args: argparse.Namespace) -> dict:
    """Each option flag given, parsed (checked when EvalConfig is validated), by option name."""
    given = {}
    for option in method_registry.OPTIONS.values():
        raw = getattr(args, option.name, None)
        if raw is not None:
            given[option.name] = tuple(option.parse(r) for r in raw) if option.repeat else option.parse(raw)
    return given


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    values = values_from_args(args, EvalConfig)
    methods, baselines = values["methods"], values["baselines"]
    asked = set(methods) | set(baselines or ()) | {m.name for m in method_registry.METHODS.values() if m.baseline}
    # a flag read by several methods (--chain-length: chain and eesd) goes to each of them that runs
    options, unread = method_registry.per_method(method_options_from_args(args), asked)
    if unread:
        flags = ", ".join(method_registry.OPTIONS[n].flag for n in unread)
        readers = ", ".join(sorted({m for n in unread for m in method_registry.readers(n)}))
        raise RecipeError(f"{flags} given, but no method of this run reads it (read by {readers}); add the method "
                          f"to --methods (running: {', '.join(dict.fromkeys(('ar',) + methods))})")
    return EvalConfig(**values, method_options=options)


def run(args: argparse.Namespace) -> int:
    """Run the eval and print the table and the report paths; user errors propagate as DraftforgeError."""
    from draftforge.eval.report import markdown_table

    report = run_eval(config_from_args(args))
    print(markdown_table(report))
    print()
    for kind, path in report["files"].items():
        print(f"{kind}: {path}")
    if report.get("pace_warning"):
        print(f"warning: {report['pace_warning']}")
    return 0
