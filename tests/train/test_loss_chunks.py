"""The full-distribution loss terms taken in chunks of positions, and the EAGLE-3 teacher's per-position values
taken once per batch, give what the whole-batch, per-step forms give, bitwise, gradients included."""

from __future__ import annotations

import pytest
import torch

from draftforge.train import divergences
from draftforge.train.divergences import _full_terms, full_terms
from draftforge.train.eagle3 import full_teacher


def _inputs(dtype, rows=37, width=1001, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = (3 * torch.randn(rows, width, generator=g)).to(dtype).requires_grad_()
    t = (3 * torch.randn(rows, width, generator=g)).to(dtype)
    return s, t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduced", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_chunked_terms_and_their_gradients_equal_the_whole_batch_bitwise(monkeypatch, dtype, reduced, temperature):
    s, t = _inputs(dtype)
    lz = (t.float().logsumexp(-1) + 0.5) if reduced else None  # as if the vocabulary went on past these ids
    whole = _full_terms(s, t, temperature, lz)  # the unchunked form, on purpose
    (whole["kl"].sum() + whole["tvd"].sum()).backward()
    want_grad, s.grad = s.grad.clone(), None
    monkeypatch.setattr(divergences, "CHUNK_BYTES", 4 * 1001 * 5)  # 5 rows a chunk: 8 chunks, the last of 2
    chunked = full_terms(s, t, temperature, lz)
    (chunked["kl"].sum() + chunked["tvd"].sum()).backward()
    for name in whole:
        assert torch.equal(whole[name], chunked[name]), name
    assert torch.equal(want_grad, s.grad)


def test_the_default_chunk_is_one_chunk_for_small_inputs_and_many_for_a_real_batch():
    rows = divergences.CHUNK_BYTES // (4 * 8192)
    assert 64 <= rows <= 4096  # a real head (8,192 ids) gets chunks of some hundreds of positions
    s, t = _inputs(torch.float32, rows=3, width=7)
    assert torch.equal(full_terms(s, t)["kl"], _full_terms(s, t, 1.0, None)["kl"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reduced_teacher_taken_once_equals_the_per_step_form(dtype):
    g = torch.Generator().manual_seed(1)
    b, t_len, v = 2, 9, 50
    teacher = (4 * torch.randn(b, t_len, v, generator=g)).to(dtype)
    teacher[0, 3, 7] = teacher[0, 3, 11] = teacher[0, 3].max() + 1  # a tie: the first id is the top-1 both ways
    d2t = torch.tensor([0, 3, 7, 11, 20, 33, 49])
    keep = torch.rand(b, t_len, generator=g) > 0.3
    terms_at = full_teacher(teacher, 1.0, d2t, rows=4)  # 4 positions a chunk: 5 chunks over the 18
    for k in range(3):
        keep_BT = keep[:, 1 + k :]
        s = (2 * torch.randn(int(keep_BT.sum()), len(d2t), generator=g)).to(dtype)
        got, agree = terms_at(k, keep_BT, s)
        t_PV = teacher[:, 1 + k :][keep_BT].float()  # what each step computed before
        want = _full_terms(s, t_PV[:, d2t], 1.0, t_PV.logsumexp(-1))
        for name in want:
            assert torch.equal(got[name], want[name]), (k, name)
        assert torch.equal(agree, d2t[s.argmax(-1)] == t_PV.argmax(-1))
