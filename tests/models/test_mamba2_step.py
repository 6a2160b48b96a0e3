"""Mamba2Step (the lean single-token step) against its oracle, transformers' own Mamba2 forward with a cache.

Every parameter is perturbed away from its init (norm weights are ones at init, which would hide a
wrong fold), states come from a transformers prefill, and several consecutive steps compare logits,
the final hidden state and every layer's conv / SSM state, which must be stepped in place.

Legend: B batch, T prompt tokens, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Mamba2Config, Mamba2ForCausalLM

from draftforge.decode.drafters.ssm_state import layer_states
from draftforge.errors import DraftforgeError
from draftforge.models.mamba2_step import Mamba2Step, mamba2_step_ref
from draftforge.hfcompat import cache_kwargs

VOCAB = 40
# (rtol, atol) per dtype. transformers returns float32 logits and keeps SSM states in float32 for every model
# dtype, so a float64 model's logits match to float32 rounding; its conv states and hidden state are float64.
TOLS = {
    torch.float64: {"logits": (1e-6, 1e-6), "state": (1e-12, 1e-12)},
    torch.float32: {"logits": (1e-5, 1e-5), "state": (1e-5, 1e-5)},
    torch.bfloat16: {"logits": (5e-2, 1e-1), "state": (5e-2, 1e-1)},
}
SHAPES = {  # name: Mamba2Config overrides (hidden 32, expand 2 -> inner 64 = heads * head_dim)
    "g1_p16": dict(n_groups=1, head_dim=16, num_heads=4),
    "g2_p8": dict(n_groups=2, head_dim=8, num_heads=8),
    "g2_p16_biases": dict(n_groups=2, head_dim=16, num_heads=4, use_bias=True, use_conv_bias=False),
    "g1_p8_tied_bf16res": dict(n_groups=1, head_dim=8, num_heads=8, tie_word_embeddings=True,
                               residual_in_fp32=False),
}


def make_model(dtype=torch.float32, seed=0, **overrides) -> Mamba2ForCausalLM:
    torch.manual_seed(seed)
    dims = dict(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
                chunk_size=16) | SHAPES["g2_p8"] | overrides
    model = Mamba2ForCausalLM(Mamba2Config(**dims)).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():  # norm weights are ones and D is one at init: move them all
            p.add_(0.2 * torch.randn_like(p))
    return model


def prefilled(model, batch: int = 1, ids_BT: torch.Tensor | None = None):
    """Two independent copies of the per-layer states after a transformers prefill (of a random prompt by default)."""
    if ids_BT is None:
        ids_BT = torch.randint(0, VOCAB, (batch, 6), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids_BT, use_cache=True, **cache_kwargs(model, cache))
    states = layer_states(cache)
    return [(c.clone(), s.clone()) for c, s in states], [(c.clone(), s.clone()) for c, s in states]


def assert_close(got, want, tol):
    rtol, atol = tol
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("batch", [1, 3, 6])
def test_steps_match_transformers(dtype, shape, batch):
    model = make_model(dtype, **SHAPES[shape])
    step, tols = Mamba2Step(model), TOLS[dtype]
    lean, ref = prefilled(model, batch)
    addresses = [t.data_ptr() for pair in lean for t in pair]
    gen = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for _ in range(4):
            ids_B1 = torch.randint(0, VOCAB, (batch, 1), generator=gen)
            logits_BV, hidden_BD = step(ids_B1, lean, return_hidden=True)
            logits_ref, hidden_ref = mamba2_step_ref(model, ids_B1, ref, return_hidden=True)
            assert logits_BV.shape == (batch, VOCAB) and logits_BV.dtype == torch.float32
            assert_close(logits_BV, logits_ref, tols["logits"])
            assert_close(hidden_BD, hidden_ref, tols["state"])
            for (conv, ssm), (conv_ref, ssm_ref) in zip(lean, ref):
                assert_close(conv, conv_ref, tols["state"])
                assert_close(ssm, ssm_ref, tols["state"])
    assert [t.data_ptr() for pair in lean for t in pair] == addresses  # stepped in place


def test_flat_ids_and_logits_only():
    model = make_model()
    step = Mamba2Step(model)
    (lean, ref), ids_B = prefilled(model, 3), torch.tensor([5, 0, 39])
    with torch.inference_mode():
        logits_BV = step(ids_B, lean)
        torch.testing.assert_close(logits_BV, mamba2_step_ref(model, ids_B[:, None], ref), rtol=1e-5, atol=1e-5)


def test_tied_head_is_not_copied():
    model = make_model(tie_word_embeddings=True)
    step = Mamba2Step(model)
    assert step.head_VD.data_ptr() == step.embed_VD.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_lean_step_is_chosen_for_a_mamba2_off_cuda_only():
    from unittest import mock

    from transformers import MambaConfig, MambaForCausalLM

    from draftforge.decode.drafters.cuda_graphs import lean_step_for

    model = make_model()
    assert isinstance(lean_step_for(model), Mamba2Step)
    with mock.patch.object(Mamba2ForCausalLM, "device", new_callable=mock.PropertyMock) as device:
        device.return_value = torch.device("cuda")
        assert lean_step_for(model) is None  # CUDA keeps transformers' kernels and the graphs
    mamba1 = MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, state_size=4))
    assert lean_step_for(mamba1) is None


def test_unsupported_activation_is_a_clear_error():
    with pytest.raises(DraftforgeError, match="hidden_act"):
        Mamba2Step(make_model(hidden_act="gelu"))


def test_dt_is_clamped_to_time_step_limit_like_the_chunked_forward():
    """transformers' chunked forward clamps dt to time_step_limit, its single-token step does not; we clamp."""
    model = make_model(torch.float64, time_step_limit=(0.0, 0.05))
    with torch.no_grad():
        for block in model.backbone.layers:
            block.mixer.dt_bias.fill_(2.0)  # softplus(dt) ~ 2 >> 0.05: the clamp is active on every head
    step = Mamba2Step(model)
    ids_1T = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8, 9, 7]])
    full_TV = model(input_ids=ids_1T).logits[0]  # chunked scan over the whole sequence, no cache
    lean, ref = prefilled(model, ids_BT=ids_1T[:, :6])
    with torch.inference_mode():
        for t in range(6, ids_1T.shape[1]):
            logits_V = step(ids_1T[:, t : t + 1], lean)[0]
            unclamped_V = mamba2_step_ref(model, ids_1T[:, t : t + 1], ref)[0]
            torch.testing.assert_close(logits_V, full_TV[t], rtol=1e-5, atol=1e-5)
            assert (unclamped_V - full_TV[t]).abs().max() > 1e-3  # the limit matters in this model


def test_mamba_drafter_on_cpu_steps_with_it_and_drafts_what_transformers_drafts():
    from draftforge.decode.drafters.mamba import MambaDrafter
    from draftforge.decode.sampling import SamplingParams

    model = make_model()
    lean, hf = MambaDrafter(model, VOCAB, cuda_graphs="off"), MambaDrafter(model, VOCAB, cuda_graphs="off")
    assert isinstance(lean.runner.lean, Mamba2Step)
    hf.runner.lean = None  # before any step exists: every step of this drafter runs transformers' forward
    params, seq = SamplingParams(temperature=1.0), [3, 1, 4, 1, 5]
    for widths, path in [((2, 2, 1), [1, 4]), ((1, 1, 1), [0, 1, 2]), ((3, 2), [])]:
        trees = [d.draft(seq, widths, params, torch.Generator().manual_seed(7)) for d in (lean, hf)]
        assert trees[0].tokens == trees[1].tokens and trees[0].parents == trees[1].parents
        torch.testing.assert_close(trees[0].q_probs, trees[1].q_probs, rtol=1e-5, atol=1e-6)
        for d in (lean, hf):
            d.accept(path)
        seq = seq + [trees[0].tokens[j] for j in path] + [7]
    assert all(step.lean is lean.runner.lean for step in lean.runner.steps)
    assert all(step.lean is None for step in hf.runner.steps)
