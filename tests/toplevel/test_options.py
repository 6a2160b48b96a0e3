"""One way to declare a setting (draftforge/options.py): the checks, the "did you mean", and the flags generated
from the declarations for eval, harvest and generate, read back into the same typed values."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import MISSING, dataclass
from typing import Literal

import pytest

from draftforge.errors import RecipeError
from draftforge.options import add_flags, build_checked, check_fields, cli_fields, flag_of, option, positive_int
from draftforge.options import values_from_args
from draftforge.runtime import DTYPE_CHOICES, PRECISIONS, resolve_dtype, resolve_precision


@dataclass(frozen=True, kw_only=True)
class Job:
    out: str = option(MISSING, "where", metavar="DIR")
    source: str | None = option(None, "from a file", group="src")
    count: int | None = option(None, "so many", group="src", check=positive_int)
    temperatures: tuple[float, ...] = option((0.0,), "T list", repeat=True, flag="--temperature",
                                             parse=lambda t: tuple(float(x) for x in t.split(",")))
    mode: Literal["fast", "exact"] = option("exact", "how")
    num: int | None = option(None, "first N", aliases=("-n",), check=positive_int)
    plots: bool = option(True, "skip plots", flag="--no-plots")
    level: int = option(0, "a level")
    note: str = option("", "not a flag", cli=False)

    def __post_init__(self):
        check_fields(self)


def parse(argv):
    p = argparse.ArgumentParser(exit_on_error=False)
    add_flags(p, Job)
    return Job(**values_from_args(p.parse_args(argv), Job))


def test_flags_come_from_the_declarations_and_read_back_typed():
    job = parse(["--out", "o", "--count", "3", "--temperature", "0", "1", "--temperature", "0.5,2", "-n", "4",
                 "--no-plots", "--mode", "fast"])
    assert job == Job(out="o", count=3, temperatures=(0.0, 1.0, 0.5, 2.0), mode="fast", num=4, plots=False)
    assert parse(["--out", "o", "--source", "f"]) == Job(out="o", source="f")  # defaults where not given


def test_help_shows_every_default_that_says_something():
    p = argparse.ArgumentParser()
    add_flags(p, Job)
    text = " ".join(p.format_help().split())
    assert "a level (default 0)" in text and "T list (default 0.0)" in text and "how (default exact)" in text
    assert "skip plots (default" not in text  # a switch says what it does, not True/False


def test_bad_values_get_one_error_naming_the_flag():
    with pytest.raises(RecipeError, match=r"--count must be >= 1, got 0"):
        parse(["--out", "o", "--count", "0"])
    with pytest.raises(RecipeError, match=r"--mode must be one of fast, exact, got 'fsat' \(did you mean 'fast'\?\)"):
        Job(out="o", source="s", mode="fsat")
    with pytest.raises(RecipeError, match=r"unknown setting 'cuont'.*did you mean 'count'"):
        build_checked(Job, {"out": "o", "cuont": 2})
    with pytest.raises(SystemExit):  # a required alternative group: one of --source / --count
        parse(["--out", "o"])


def test_every_command_flag_is_a_declared_setting():
    from draftforge.cli import build_parser
    from draftforge.cli_generate import GenerateJob
    from draftforge.eval.config import EvalConfig
    from draftforge.harvest.c2t import TreeHarvestJob
    from draftforge.harvest.cali_ts import ThetaHarvestJob
    from draftforge.harvest.hidden import HiddenHarvestJob
    from draftforge.harvest.logits import LogitsHarvestJob

    def flags(parser):
        return {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"}

    def sub(parser, *names):
        for name in names:
            parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
        return parser

    for command, cls in ((("generate",), GenerateJob), (("harvest", "trees"), TreeHarvestJob),
                         (("harvest", "theta"), ThetaHarvestJob), (("harvest", "logits"), LogitsHarvestJob),
                         (("harvest", "hidden"), HiddenHarvestJob)):
        declared = {flag_of(f) for f in cli_fields(cls)} | {a for f in cli_fields(cls) for a in f.metadata["aliases"]}
        assert flags(sub(build_parser(command[0]), *command)) == declared, command
    from draftforge.decode.methods import OPTIONS

    eval_flags = flags(sub(build_parser("eval"), "eval"))
    assert eval_flags == {flag_of(f) for f in cli_fields(EvalConfig)} | {o.flag for o in OPTIONS.values()}
    assert {f.name for f in dataclasses.fields(EvalConfig)} - {f.name for f in cli_fields(EvalConfig)} == {
        "method_options", "command", "quiet", "extra_manifest"}


def test_train_precision_and_dtype_take_the_same_words_through_one_resolver():
    from draftforge.recipe import TrainConfig
    import typing

    assert typing.get_type_hints(TrainConfig)["precision"] == PRECISIONS
    assert set(DTYPE_CHOICES) == {"auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"}
    for short, long in (("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16")):
        assert resolve_dtype(short).name == resolve_dtype(long).name == long
        assert resolve_precision(short) == resolve_precision(long) == short
    # "auto" by hand (test_precision.py pins it with CUDA hidden; here: the same words through both resolvers)
    for flags, want in ((set(), "float32"), ({"avx512_bf16"}, "bfloat16")):
        assert resolve_dtype("auto", "cpu", flags=flags).name == want
