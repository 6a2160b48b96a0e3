"""The EAGLE-3 loss's fast paths against the plain forms they replace: the full-distribution terms taken in chunks
of positions, the teacher's per-position values taken once per batch, and the head's logits taken at the scored
anchors only, each against the whole-batch, per-step, every-anchor form (bitwise where the sums are the same)."""

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_topk_terms_and_their_gradients_equal_the_whole_batch_bitwise(monkeypatch, dtype):
    from draftforge.train.divergences import TopK, _topk_terms, topk_terms

    s, t = _inputs(dtype, rows=37, width=301)
    logp = t.float().log_softmax(-1)
    top_p, ids = logp.topk(8, -1)
    rest = (1 - top_p.exp().sum(-1)).clamp_min(0).log()
    rest[::4] = float("-inf")  # rows whose cache holds every id: no tail
    top = TopK(ids, top_p, rest)
    whole = _topk_terms(s, top)
    (whole["kl"].sum() + whole["tvd"].sum()).backward()
    want_grad, s.grad = s.grad.clone(), None
    monkeypatch.setattr(divergences, "CHUNK_BYTES", 4 * 301 * 6)  # 6 rows a chunk
    chunked = topk_terms(s, top)
    (chunked["kl"].sum() + chunked["tvd"].sum()).backward()
    for name in whole:
        assert torch.equal(whole[name], chunked[name]), name
    assert torch.equal(want_grad, s.grad)


def test_the_default_chunk_is_one_chunk_for_small_inputs_and_many_for_a_real_batch(monkeypatch):
    rows = divergences.CHUNK_BYTES // (4 * 8192)
    assert 64 <= rows <= 4096  # a real head (8,192 ids) gets chunks of some hundreds of positions
    chunks = []  # the rows of each call of the per-chunk terms
    monkeypatch.setattr(divergences, "_full_terms", lambda s, *rest: chunks.append(len(s)) or _full_terms(s, *rest))
    full_terms(*_inputs(torch.float32, rows=3, width=7))
    assert chunks == [3]
    chunks.clear()
    with torch.no_grad():
        full_terms(*_inputs(torch.float32, rows=rows + 1, width=8192))
    assert chunks == [rows, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reduced_teacher_taken_once_equals_the_per_step_form(dtype, monkeypatch):
    g = torch.Generator().manual_seed(1)
    b, t_len, v = 2, 9, 50
    teacher = (4 * torch.randn(b, t_len, v, generator=g)).to(dtype)
    teacher[0, 3, 7] = teacher[0, 3, 11] = teacher[0, 3].max() + 1  # a tie: the first id is the top-1 both ways
    d2t = torch.tensor([0, 3, 7, 11, 20, 33, 49])
    keep = torch.rand(b, t_len, generator=g) > 0.3
    monkeypatch.setattr(divergences, "CHUNK_BYTES", 4 * v * 4)  # 4 teacher positions a chunk: 5 over the 18
    terms_at = full_teacher(teacher, 1.0, d2t)
    for k in range(3):
        keep_BT = keep[:, 1 + k :]
        s = (2 * torch.randn(int(keep_BT.sum()), len(d2t), generator=g)).to(dtype)
        got, agree = terms_at(k, keep_BT, s)
        t_PV = teacher[:, 1 + k :][keep_BT].float()  # what each step computed before
        want = _full_terms(s, t_PV[:, d2t], 1.0, t_PV.logsumexp(-1))
        for name in want:
            assert torch.equal(got[name], want[name]), (k, name)
        assert torch.equal(agree, d2t[s.argmax(-1)] == t_PV.argmax(-1))


@pytest.mark.parametrize("body", ["attention", "mamba2"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_logits_at_the_kept_rows_give_the_full_logits_loss_and_gradients(body, dtype):
    """Oracle: the head's logits over every anchor, indexed by the loss. The head asked for the kept rows only
    (kept_by_step, as training asks) gives the same logits there and the same loss, bitwise in the dtypes training
    uses. In float64 the CPU's matrix product may choose its kernel, and so its summation order, by the number of
    rows (it does on an AMD EPYC: the kept rows' logits differ from the full ones in the last bits), so there the
    logits and the loss are compared to float64's rounding. The gradients are the same sums without the zero rows of
    the anchors no loss reads, so a weight's gradient may round differently: they are compared in float64, to its
    rounding."""
    from draftforge.models.eagle3 import Eagle3Config, Eagle3Head
    from draftforge.models.feature_mamba import FeatureMamba2Head, FeatureMambaConfig
    from draftforge.train.eagle3 import Eagle3TaskConfig, kept_by_step, step_losses, unrolled_anchors
    from tests.models.test_eagle3 import V, tiny_target

    target = tiny_target().float()
    torch.manual_seed(3)
    head = (Eagle3Head(Eagle3Config.from_target(target.config, draft_vocab=list(range(0, V, 2))))
            if body == "attention" else
            FeatureMamba2Head(FeatureMambaConfig.from_target(target.config, draft_vocab=list(range(0, V, 2)),
                                                             head_dim=16, state_size=8)))
    head = head.to(dtype)
    head.use_embedding(target.get_input_embeddings())
    steps, t_len = 3, 12
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, V, (2, t_len), generator=g)
    aux = torch.randn(2, t_len, head.fc.in_features, generator=g).to(dtype)
    next_BT = torch.full((2, t_len), -100)
    next_BT[0, 2:11], next_BT[1, 5:9] = 1, 1  # two answers' labels after their prompts
    teacher = torch.randn(2, t_len, V, generator=g).to(dtype)
    cfg, d2t = Eagle3TaskConfig(steps=steps, loss="mix"), torch.arange(0, V, 2)
    keep = kept_by_step(next_BT, steps)

    def run(kept):
        head.zero_grad()
        logits = head(tokens, aux, steps, unrolled_anchors(next_BT, steps), kept)
        total, _, metrics = step_losses(logits, teacher, next_BT, cfg, cfg.weights(), d2t, evaluating=True)
        total.backward()
        return logits, total.detach(), metrics, [p.grad.clone() for p in head.parameters() if p.grad is not None]

    (full, loss_full, m_full, g_full), (part, loss_part, m_part, g_part) = run(None), run(keep)

    def same(a, b):
        if dtype == torch.float64:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
        else:
            assert torch.equal(a, b)

    for k, rows in enumerate(keep):
        same(part[k], full[k][:, : rows.shape[1]][rows])
    same(loss_part, loss_full)
    assert m_part.keys() == m_full.keys()
    for name in m_full:
        same(m_part[name], m_full[name])
    assert len(g_full) == len(g_part) > 0
    if dtype == torch.float64:
        for a, b in zip(g_full, g_part):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-14)
