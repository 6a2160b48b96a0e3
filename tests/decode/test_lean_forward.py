"""The lean decoding forward (decode/lean_forward.py) changes speed, never a number.

Oracles: the same model loaded with its own forward (lean_forward="off") and transformers' `generate()`. Logits
of decoding steps, verified chains and trees, the final state and the feature layers' states (which
tests/decode/test_target_features.py ties to hidden_states[i]) are bitwise equal in bf16 (packed, projections
fused) and fp32; a forward whose arithmetic was changed is caught by the probe and the model keeps its own;
other architectures and copies keep their own.
"""

from __future__ import annotations

import copy

import pytest
import torch

from draftforge.decode import build_decoder, load_drafter, load_target
from draftforge.decode import lean_forward as lean_module
from draftforge.decode.lean_forward import FAST_ROWS, lean_forward
from draftforge.decode.tree import DraftTree
from draftforge.errors import RecipeError
from tests.fixtures.decode import save_target_and_drafter, tiny_llama

VOCAB = 96


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_target_and_drafter(tmp_path_factory.mktemp("lean"), VOCAB, layers=3)


def _pair(saved, dtype):
    lean = load_target(saved / "target", dtype=dtype)
    own = load_target(saved / "target", dtype=dtype, lean_forward="off")
    assert own.model.draftforge_lean is None and "lean_forward off" in own.model.draftforge_forward
    assert lean.model.draftforge_lean is not None, lean.model.draftforge_forward
    return lean, own


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_steps_chains_and_trees_give_the_same_logits_states_and_features_bitwise(saved, dtype):
    lean, own = _pair(saved, dtype)
    if dtype == torch.bfloat16 and lean.model.draftforge_packing.packed:
        assert lean.model.draftforge_lean.fused == 2 * 3, lean.model.draftforge_forward  # q/k/v and gate/up
    prompt = [(7 * i + 3) % VOCAB for i in range(23)]
    chain = DraftTree([5, 9, 11], [-1, 0, 1], [1, 2, 3])
    tree = DraftTree([5, 6, 9, 11, 12], [-1, -1, 0, 0, 2], [1, 1, 2, 2, 3])
    layers = [0, 2]
    for t in (lean, own):
        t.want_hidden = True
        t.want_features(layers)
        t.prefill(prompt)
    assert torch.equal(lean.take_features(), own.take_features())  # the prefill (the model's own forward in both)
    last = prompt[-1]
    for round_, (draft, path) in enumerate([(DraftTree([], [], []), []), (chain, [0, 1]), (tree, [0, 2]),
                                            (tree, []), (chain, [0, 1, 2])]):
        got, want = lean.verify(last, draft), own.verify(last, draft)
        assert torch.equal(got, want), f"round {round_}"
        assert torch.equal(lean.last.hidden_ND, own.last.hidden_ND), f"round {round_}"
        assert torch.equal(lean.last.features_NA, own.last.features_NA), f"round {round_}"
        for t in (lean, own):
            t.commit(path)
        last = (draft.tokens[path[-1]] if path else 17 + round_)
    assert torch.equal(lean.take_features(), own.take_features())


def test_ar_equals_generate_in_fp32(saved):
    lean, _ = _pair(saved, torch.float32)
    prompt = [4, 8, 15, 16, 23, 42]
    ids = torch.tensor([prompt])
    want = lean.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()
    assert build_decoder("ar", lean).generate(prompt, max_new_tokens=40, eos_token_id=[]).tokens == want


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_drafted_decoding_gives_the_same_tokens_with_a_lean_drafter_too(saved, method):
    tokens = []
    for setting in ("auto", "off"):
        target = load_target(saved / "target", dtype=torch.bfloat16, lean_forward=setting)
        drafter = load_drafter(saved / "drafter", target, dtype=torch.bfloat16, lean_forward=setting)
        assert (drafter.model.draftforge_lean is not None) == (setting == "auto")
        dec = build_decoder(method, target, drafter)
        tokens.append([dec.generate([1, 2, 3, 4], max_new_tokens=40, eos_token_id=[]).tokens,
                       dec.generate([9, 8, 7], max_new_tokens=25, temperature=1.0, seed=3, eos_token_id=[]).tokens])
    assert tokens[0] == tokens[1]


def test_a_forward_that_computes_differently_is_refused_by_the_probe(monkeypatch):
    model = tiny_llama(vocab=VOCAB, layers=2, hidden=64)
    lean, words = lean_forward(model)
    assert lean is not None, words
    rotate = lean_module.rotate
    monkeypatch.setattr(lean_module, "rotate", lambda x, cos, sin: rotate(x, cos, sin) * 1.0001)
    lean, words = lean_forward(model)
    assert lean is None and "not bitwise equal" in words and "logits differ" in words


def test_other_architectures_and_training_mode_keep_their_own_forward():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()
    lean, words = lean_forward(qwen)
    assert lean is None and "Qwen2ForCausalLM" in words and "LlamaForCausalLM" in words
    llama = tiny_llama(vocab=VOCAB).train()
    lean, words = lean_forward(llama)
    assert lean is None and "training mode" in words


def test_copies_and_converted_models_run_their_own_forward(saved):
    lean, _ = _pair(saved, torch.bfloat16)
    model = lean.model
    assert model.draftforge_lean.applies(model, FAST_ROWS) and not model.draftforge_lean.applies(model, FAST_ROWS + 1)
    clone = copy.deepcopy(model)  # the self-check's fp32 copy starts as one
    assert clone.draftforge_lean is None
    assert not model.draftforge_lean.applies(clone, 1)
    model.float()  # converted in place: the fused bf16 products no longer apply
    assert not model.draftforge_lean.applies(model, 1)
    other = load_target(saved / "target", dtype=torch.bfloat16).model
    assert other.draftforge_lean.applies(other, 1)
    other.train()
    assert not other.draftforge_lean.applies(other, 1)
    other.eval()
    other.draftforge_lean.device = torch.device("meta")  # as if the model had moved since it was built
    assert not other.draftforge_lean.applies(other, 1)


def test_a_model_with_forward_hooks_runs_its_own_forward_so_the_hooks_are_called(saved):
    target = load_target(saved / "target", dtype=torch.bfloat16)
    lean = target.model.draftforge_lean
    assert lean.applies(target.model, 1)
    calls = []
    handle = target.model.model.layers[1].register_forward_hook(lambda *args: calls.append(1))
    assert not lean.applies(target.model, 1)
    target.prefill([1, 2, 3, 4])
    target.verify(4, DraftTree([5, 6], [-1, 0], [1, 2]))
    assert len(calls) == 2  # the prefill and the verification both went through the model's forward
    handle.remove()
    assert lean.applies(target.model, 1)


def test_a_bad_setting_is_refused_before_loading(saved):
    with pytest.raises(RecipeError, match="lean_forward must be one of auto, on, off"):
        load_target(saved / "target", lean_forward="yes")


def test_eager_attention_is_covered_too():
    model = tiny_llama(vocab=VOCAB, layers=2, hidden=64)
    model.config._attn_implementation = "eager"
    lean, words = lean_forward(model)  # the probe compared it with the model's own eager forward
    assert lean is not None, words
