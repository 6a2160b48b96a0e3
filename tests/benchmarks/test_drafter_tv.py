"""benchmarks/decoding/drafter_tv.py: α = 1 - TV and the calibration scale, and the decode-path check, on tiny
random models."""

from __future__ import annotations

import pytest
import torch

drafter_tv = pytest.importorskip("benchmarks.decoding.drafter_tv")


def test_alpha_is_one_minus_tv_and_scale_finds_temperature():
    logits_TV = torch.randn(20, 50) * 3
    p_TV = (logits_TV / 0.7).softmax(-1)  # the "target" is the drafter at a lower temperature
    stats = drafter_tv.position_stats(p_TV, logits_TV, temperature=1.0)
    q_TV = logits_TV.softmax(-1)
    assert stats["alpha"] == pytest.approx(float((1 - 0.5 * (p_TV - q_TV).abs().sum(-1)).mean()), abs=1e-6)
    assert stats["best_scale"] == 0.7 and stats["alpha_at_best_scale"] == pytest.approx(1.0, abs=1e-5)
    same = drafter_tv.position_stats(q_TV, logits_TV, 1.0)
    assert same["alpha"] == pytest.approx(1.0, abs=1e-6) and same["top1"] == 1.0


def test_mamba_decode_path_equals_full_forward():
    from transformers import Mamba2Config, Mamba2ForCausalLM

    from draftforge.decode.drafter_mamba import MambaDrafter

    torch.manual_seed(0)
    cfg = Mamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=16, head_dim=16, expand=2,
                       n_groups=1, num_heads=4, chunk_size=8)
    drafter = MambaDrafter(Mamba2ForCausalLM(cfg).eval(), 64, cuda_graphs="off")
    seq = torch.randint(0, 64, (20,)).tolist()
    full = drafter_tv.drafter_logits(drafter, seq, 8)
    stepped = drafter_tv.stepped_logits(drafter, seq, 8)
    assert stepped.shape == full.shape == (12, 64)
    torch.testing.assert_close(stepped, full, atol=1e-4, rtol=1e-4)
