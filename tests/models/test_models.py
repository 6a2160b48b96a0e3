"""Model builders: presets, explicit dims, validation errors that name the field, vocab/tokenizer agreement."""
# Shapes: B batch, T tokens, V vocabulary.

import pytest
import torch
from transformers import (LlamaForCausalLM, Mamba2ForCausalLM, MambaForCausalLM, Qwen2ForCausalLM)

from draftforge.errors import CheckpointError, CompatibilityError, RecipeError
from draftforge.models import (MAMBA_PRESETS, build_causal_lm, build_mamba, build_model, check_vocab_fits,
                               count_parameters, load_pretrained)
from draftforge.testbed import train_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=300, max_files=4)


@pytest.mark.parametrize("arch, cls", [("mamba", MambaForCausalLM), ("mamba2", Mamba2ForCausalLM),
                                       ("llama", LlamaForCausalLM)])
def test_vocab_matches_tokenizer(tokenizer, arch, cls):
    size = "tiny-drafter" if arch == "llama" else "tiny"
    model = build_model(arch, len(tokenizer), size=size, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    assert isinstance(model, cls)
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer) == 300
    assert model.get_output_embeddings().weight.shape[0] == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id
    ids_BT = tokenizer(["def f(x):\n    return x"], return_tensors="pt").input_ids
    logits_BTV = model(ids_BT).logits
    assert logits_BTV.shape == (1, ids_BT.shape[1], len(tokenizer))
    check_vocab_fits(model, tokenizer)


def test_vocab_too_small_for_tokenizer(tokenizer):
    model = build_mamba("mamba", len(tokenizer) - 1)
    with pytest.raises(CompatibilityError, match="299 rows"):
        check_vocab_fits(model, tokenizer)


def test_tiny_presets_follow_table():
    model = build_mamba("mamba2", 256, size="tiny")
    cfg, preset = model.config, MAMBA_PRESETS["tiny"]
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (preset["hidden_size"], preset["num_hidden_layers"])
    assert cfg.num_heads * cfg.head_dim == cfg.expand * cfg.hidden_size
    assert build_mamba("mamba", 256).config.state_size == preset["mamba"]["state_size"]


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_130m_preset_matches_papers_size(arch):
    # state-spaces/mamba-130m has 129,135,360 parameters (GPT-NeoX vocab 50280, tied head).
    with torch.device("meta"):
        model = build_mamba(arch, 50280, size="130m")
    assert (model.config.num_hidden_layers, model.config.hidden_size) == (24, 768)
    assert abs(count_parameters(model) - 129_135_360) / 129_135_360 < 0.01


def test_overrides_win_over_preset():
    model = build_mamba("mamba2", 100, size="tiny", overrides={"hidden_size": 64, "head_dim": 16, "n_groups": 2})
    cfg = model.config
    assert (cfg.hidden_size, cfg.head_dim, cfg.n_groups, cfg.num_heads) == (64, 16, 2, 8)
    assert cfg.num_hidden_layers == MAMBA_PRESETS["tiny"]["num_hidden_layers"]
    llama = build_causal_lm("llama", 100, size="tiny-target", overrides={"num_hidden_layers": 1},
                            max_position_embeddings=128)
    assert (llama.config.num_hidden_layers, llama.config.max_position_embeddings) == (1, 128)
    assert build_model("llama", 100, size="tiny-drafter", max_position_embeddings=64).config.max_position_embeddings == 64
    assert build_model("mamba", 100, max_position_embeddings=64).config.hidden_size == 128  # ignored for SSMs
    assert llama.config.hidden_size == 256


@pytest.mark.parametrize("arch, overrides, field", [
    ("mamba2", {"head_dim": 48}, "head_dim"),  # 48 does not divide 2*128
    ("mamba2", {"n_groups": 3}, "n_groups"),  # 3 does not divide 8 heads
    ("mamba2", {"num_heads": 5}, "num_heads"),
    ("mamba", {"num_hidden_layers": 0}, "num_hidden_layers"),
    ("mamba", {"hidden_size": "big"}, "hidden_size"),
    ("mamba", {"head_dim": 32}, "head_dim"),  # a Mamba2-only field on Mamba-1
    ("mamba", {"vocab_size": 10}, "vocab_size"),
    ("mamba2", {"hiden_size": 10}, "hiden_size"),
])
def test_bad_mamba_dims_name_the_field(arch, overrides, field):
    with pytest.raises(RecipeError, match=f"model.{field}"):
        build_mamba(arch, 100, overrides=overrides)


@pytest.mark.parametrize("kwargs, field", [
    ({"size": "huge"}, "model.size"),
    ({"overrides": {"num_attention_heads": 3}}, "model.num_attention_heads"),
    ({"overrides": {"num_key_value_heads": 3}}, "model.num_key_value_heads"),
    ({"overrides": {"d_model": 3}}, "model.d_model"),
    ({"eos_token_id": 100}, "eos_token_id"),
])
def test_bad_llama_dims_name_the_field(kwargs, field):
    kwargs = {"size": "tiny-drafter", **kwargs}
    with pytest.raises(RecipeError, match=field):
        build_causal_lm("llama", 100, **kwargs)


def test_bad_arch_and_vocab():
    with pytest.raises(RecipeError, match="model.arch"):
        build_model("not-a-model", 100)
    with pytest.raises(RecipeError, match="vocab_size"):
        build_model("mamba", 0)
    with pytest.raises(RecipeError, match="model.size"):
        build_model("mamba", 100, size="tiny-target")


def test_other_hf_arch_and_drafter_sizes():
    qwen = build_model("qwen2", 128, size="tiny-drafter")
    assert isinstance(qwen, Qwen2ForCausalLM) and qwen.config.num_hidden_layers == 2
    # The Transformer baseline drafter is sized like the tiny Mamba drafter (within 1.5x) ...
    mamba_n = count_parameters(build_model("mamba", 2048))
    llama_n = count_parameters(build_model("llama", 2048, size="tiny-drafter"))
    assert 1 / 1.5 < llama_n / mamba_n < 1.5
    # ... and the testbed target is much larger than either drafter.
    assert count_parameters(build_model("llama", 2048, size="tiny-target")) > 5 * mamba_n


def test_count_parameters_counts_tied_once():
    model = build_mamba("mamba", 100)
    assert model.lm_head.weight is model.backbone.embeddings.weight
    expected = sum(t.numel() for name, t in model.state_dict().items() if name != "lm_head.weight")
    assert count_parameters(model) == expected
    model.backbone.embeddings.weight.requires_grad_(False)
    assert count_parameters(model, trainable_only=True) == expected - 100 * model.config.hidden_size


def test_load_pretrained_round_trip_and_refusals(tmp_path):
    torch.manual_seed(0)
    model = build_model("llama", 128, size="tiny-drafter").eval()
    model.save_pretrained(tmp_path / "ok")
    loaded = load_pretrained(tmp_path / "ok").eval()
    ids_BT = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids_BT).logits, model(ids_BT).logits, rtol=0, atol=0)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    model.config.save_pretrained(pickled)
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_pretrained(pickled)
    with pytest.raises(CheckpointError, match="safetensors"):
        load_pretrained(tmp_path / "ok", use_safetensors=False)
    with pytest.raises(CheckpointError, match="cannot load"):
        load_pretrained(tmp_path / "missing")
