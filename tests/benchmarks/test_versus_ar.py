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


def _greedy(target, ids: list[int], n: int) -> list[int]:
    from draftforge.decode import build_decoder

    return build_decoder("ar", target).generate(ids, max_new_tokens=n, eos_token_id=[]).tokens


def test_identical_near_tie_defect_and_early_stop_each_counted(tied):
    path, prompt, a, b, far = tied
    target = load_target(path, dtype=torch.bfloat16)
    ar = [[a, 7, 8]] * 4
    after_b = [b, *_greedy(target, prompt + [b], 2)]  # the tie flipped, then the model's own greedy continuation
    mine = [[a, 7, 8], after_b, [far, 7, 8], [a, 7]]  # same, tie flipped, far token, stopped early
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


def test_a_token_after_a_near_tie_that_its_own_context_cannot_explain_is_a_defect(tied):
    # only a prompt's first difference used to be examined: a near-tie there hid any later token
    from draftforge.eval.selfcheck import plain_logits

    path, prompt, a, b, _ = tied
    target = load_target(path, dtype=torch.bfloat16)
    good = [b, *_greedy(target, prompt + [b], 3)]
    worst = int(plain_logits(target.model, prompt + good[:2], keep=1)[-1].argmin())
    bad = good[:2] + [worst]  # the tie flipped, one right token, then the least likely one
    check = versus_ar(target, [prompt] * 2, [[a, 7, 8, 9]] * 2, [good, bad], check_ar_tokens=False)
    assert [d["verdict"] for d in check["divergences"]] == ["near_tie", "defect"]
    later = check["divergences"][1]["later"]
    assert [d["position"] for d in later if d["verdict"] == "defect"] == [2]
    assert check["divergences"][0]["later"] == [] or all(d["verdict"] == "near_tie"
                                                         for d in check["divergences"][0]["later"])
