"""MambaInLlama-style conversion: with no layer replaced the hybrid reproduces the Llama exactly; a
replaced layer's Mamba2 mixer starts from the attention weights (V→x, K→B, Q→C, o→out), with finite
outputs of the replaced layer's shape, and the harness verifies the converted model losslessly."""

import pytest
import torch

from draftforge.decode import build_decoder, load_target
from draftforge.errors import CompatibilityError
from draftforge.models.hybrid_from_llama import every_other, llama_to_hybrid
from tests.fixtures.decode import greedy_reference, tiny_llama
from tests.fixtures.hybrid import ScriptedDrafter


def test_no_replacement_reproduces_the_llama():
    llama = tiny_llama(vocab=40, layers=3, hidden=32)
    hybrid = llama_to_hybrid(llama, [])
    ids = torch.tensor([[3, 9, 1, 22, 17, 5, 8]])
    with torch.no_grad():
        assert torch.allclose(hybrid(ids).logits, llama(ids).logits, atol=1e-5)


def test_replaced_layer_starts_from_attention_weights_with_matching_shapes():
    llama = tiny_llama(vocab=40, layers=4, hidden=32)
    hybrid = llama_to_hybrid(llama, [1, 3])
    assert hybrid.config.layers_block_type == ["full_attention", "linear_attention"] * 2
    mixer, attn = hybrid.model.layers[1].mamba, llama.model.layers[1].self_attn
    inner, gs = mixer.intermediate_size, mixer.n_groups * mixer.ssm_state_size
    w = mixer.in_proj.weight
    group = llama.config.num_attention_heads // llama.config.num_key_value_heads
    head_dim = 32 // llama.config.num_attention_heads
    assert torch.equal(w[inner + 2 * gs : inner + 3 * gs], attn.q_proj.weight)  # C ← Q
    assert torch.equal(w[inner + gs : inner + gs + head_dim], attn.k_proj.weight[:head_dim])  # B ← K (head 0)
    assert torch.equal(w[inner + gs + group * head_dim : inner + gs + (group + 1) * head_dim],
                       attn.k_proj.weight[head_dim : 2 * head_dim])  # the next query group reads K head 1
    assert torch.equal(w[inner : inner + head_dim], attn.v_proj.weight[:head_dim])  # x ← V
    assert torch.equal(mixer.out_proj.weight, attn.o_proj.weight)
    hidden = torch.randn(1, 6, 32)
    with torch.no_grad():
        out_mixer = mixer(hidden)
        out_attn = attn(hidden, position_embeddings=llama.model.rotary_emb(hidden, torch.arange(6)[None]),
                        attention_mask=None)[0]
    assert out_mixer.shape == out_attn.shape and torch.isfinite(out_mixer).all()
    with torch.no_grad():  # the other layers are copies
        ids = torch.tensor([[3, 9, 1]])
        assert torch.isfinite(hybrid(ids).logits).all()
    assert torch.equal(hybrid.model.layers[2].self_attn.q_proj.weight, llama.model.layers[2].self_attn.q_proj.weight)


def test_converted_hybrid_runs_losslessly_in_the_harness():
    hybrid = llama_to_hybrid(tiny_llama(vocab=40, layers=4, hidden=32), [1, 3])
    target = load_target(hybrid)
    dec = build_decoder("tree", target, ScriptedDrafter(target), tree=(3, 1, 1, 1))
    prompt = [5, 2, 33, 7]
    assert dec.generate(prompt, max_new_tokens=12).tokens == greedy_reference(target, prompt, 12)


def test_layer_choice_and_bad_input():
    assert every_other(30, 0.5) == list(range(1, 30, 2)) and every_other(4, 0.5) == [1, 3]
    assert len(every_other(30, 0.25)) == 8 and 0 not in every_other(30, 0.25)
    with pytest.raises(CompatibilityError, match="do not exist"):
        llama_to_hybrid(tiny_llama(vocab=40, layers=2), [5])


def test_an_explicit_head_dim_converts_and_what_bamba_cannot_express_is_refused():
    """A Llama whose heads x head_dim is twice its width failed with a size mismatch (head_dim was not passed on);
    qwen2 (biases on q/k/v, none on o) failed loading its state dict; a Mistral's sliding window was dropped, so the
    hybrid parted from the model past the window. Oracle: the source model's own logits."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    base = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128)
    ids = torch.tensor([[3, 9, 1, 22, 17, 5, 8]])
    torch.manual_seed(0)
    wide = LlamaForCausalLM(LlamaConfig(**base, head_dim=16)).eval()
    with torch.no_grad():
        assert torch.allclose(llama_to_hybrid(wide, []).eval()(ids).logits, wide(ids).logits, atol=1e-5)
        assert torch.isfinite(llama_to_hybrid(wide, [1]).eval()(ids).logits).all()
    with pytest.raises(CompatibilityError, match=r"\(llama, mistral\); got 'qwen2'"):
        llama_to_hybrid(Qwen2ForCausalLM(Qwen2Config(**base)), [])
    with pytest.raises(CompatibilityError, match="sliding_window=4 is below the context of 128.*sliding_window = None"):
        llama_to_hybrid(MistralForCausalLM(MistralConfig(**base, sliding_window=4)), [])
    mistral = MistralForCausalLM(MistralConfig(**base, sliding_window=None)).eval()
    with torch.no_grad():
        assert torch.allclose(llama_to_hybrid(mistral, []).eval()(ids).logits, mistral(ids).logits, atol=1e-5)
    assert 0 in every_other(4, 0.75)  # above 2/3 the first layer is replaced too, as the docstring now says
