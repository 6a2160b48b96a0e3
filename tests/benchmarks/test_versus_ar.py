"""benchmarks.common.versus_ar: the eval's T=0 self-check for the benchmark scripts (eesd_bench, length_control,
tree_budget), on a tiny Llama whose top-2 tokens after the prompt are tied by construction."""

from __future__ import annotations

import pytest
import torch

from benchmarks.common import versus_ar, versus_ar_cell
from draftforge.decode import load_target
from draftforge.decode.engine import DecodeStats
from tests.fixtures.decode import TIED_PROMPT, save_tied_top2_llama


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    path = tmp_path_factory.mktemp("tied") / "target"
    a, b, far = save_tied_top2_llama(path)
    return str(path), list(TIED_PROMPT), a, b, far


def test_identical_near_tie_defect_and_early_stop_each_counted(tied):
    path, prompt, a, b, far = tied
    target = load_target(path, dtype=torch.bfloat16)
    ar = [[a, 7, 8]] * 4
    mine = [[a, 7, 8], [b, 7, 8], [far, 7, 8], [a, 7]]  # same, tie flipped, far token, stopped early
    stats = [DecodeStats(drafted_per_round=[3])] * 4
    check = versus_ar(target, [prompt] * 4, ar, mine, stats, check_ar_tokens=False)  # ar: not its greedy text
    assert (check["identical"], check["near_ties"], check["defects"], check["total"]) == (1, 1, 2, 4)
    assert [d["verdict"] for d in check["divergences"]] == ["near_tie", "defect", "defect"]
    assert check["divergences"][0]["gap"] == 0.0 and check["divergences"][0]["rows_probed"][-1] == len(prompt)
    assert not check["ok"] and versus_ar_cell(check) == "1/4 (1 near-tie, 2 DEFECT)"


def test_a_near_tie_is_ok_in_bf16_but_any_difference_fails_in_fp32(tied):
    path, prompt, a, b, _ = tied
    for dtype, ok in ((torch.bfloat16, True), (torch.float32, False)):
        check = versus_ar(load_target(path, dtype=dtype), [prompt, prompt], [[a], [a]], [[a], [b]],
                          check_ar_tokens=False)
        assert (check["near_ties"], check["defects"], check["ok"]) == (1, 0, ok)
        assert versus_ar_cell(check) == "1/2 (1 near-tie)"
