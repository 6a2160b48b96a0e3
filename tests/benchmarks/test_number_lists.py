"""Comma-list flags of the benchmarks (--temperatures, --ns, --betas, ...): a bad value ends in argparse's usage line
and exit 2 at parse time, not a ValueError traceback after the models load (`--ns 4,x` used to get one)."""

import pytest

from benchmarks.common import number_list
from benchmarks.decoding import spec_decode, tree_budget
from benchmarks.pipelines import hybrid_testbed

TREE_BUDGET = ["--target", "t", "--drafter", "d", "--bench", "b"]


def test_number_list_parses_and_refuses():
    assert number_list(float, 0)("0, 0.7,1") == (0.0, 0.7, 1.0)
    assert number_list(int, 1)("10,20") == (10, 20)
    assert number_list(int, 1, empty_ok=True)("") == ()
    for text, words in [("0,x", "comma list of numbers"), ("-1", ">= 0"), ("nan", "finite"), ("inf", "finite"),
                        ("0,0", "twice"), ("", "at least one"), (",", "at least one")]:
        with pytest.raises(Exception, match=words):
            number_list(float, 0)(text)
    with pytest.raises(Exception, match="whole numbers"):
        number_list(int, 1)("4.5")  # int("4.5") fails: 4.5 is not silently 4


@pytest.mark.parametrize("parse, argv, words", [
    (spec_decode.parse_args, ["--temperatures", "0,x"], "--temperatures: expects a comma list of numbers, got 'x'"),
    (hybrid_testbed.parse_args, ["--temperatures", "1,-1"], "--temperatures: values must be >= 0"),
    (tree_budget.parse_args, TREE_BUDGET + ["--ns", "4,x"], "--ns: expects a comma list of whole numbers"),
    (tree_budget.parse_args, TREE_BUDGET + ["--ns", "20,20"], "'20' is given twice"),
    (tree_budget.parse_args, TREE_BUDGET + ["--betas", "0.5,y"], "--betas: expects a comma list of numbers"),
    (tree_budget.parse_args, TREE_BUDGET + ["--c2t-head", "noequals"], "--c2t-head: expects NAME=PATH"),
    (tree_budget.parse_args, TREE_BUDGET + ["--chain-betas", "0.5"], "give --c2t"),
    (tree_budget.parse_args, TREE_BUDGET + ["--c2t", "h", "--c2t-head", "c2t=x"], "'c2t' is used twice"),
    (tree_budget.parse_args, TREE_BUDGET + ["--c2t-head", "a=x", "--c2t-head", "a=y"], "'a' is used twice"),
])
def test_bad_lists_are_usage_errors(parse, argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_lists_reach_the_run_as_numbers():
    a = tree_budget.parse_args(TREE_BUDGET + ["--c2t", "h", "--c2t-head", "no_f=p", "--ns", "10,40",
                                              "--chains", "3", "--chain-betas", "0.5"])
    assert (a.ns, a.chains, a.chain_betas, a.betas[:2], a.c2t_head) == ((10, 40), (3,), (0.5,), (0.3, 0.4),
                                                                          [("no_f", "p")])
    assert tree_budget.parse_args(TREE_BUDGET).chains == ()
    assert spec_decode.parse_args([]).temperatures == (0.0, 1.0)
