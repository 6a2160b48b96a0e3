"""Packed linear weights (decode/packing.py) change speed, never a number.

Oracle: the same model loaded without packing. Logits of a prompt, of a verified chain and of a verified tree,
and the tokens of AR and of a drafted chain, are bitwise equal; layers whose packed product would differ are left
as plain nn.Linear; a packed model moved to fp32 (the self-check's copy) computes what an unpacked fp32 copy does.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from draftforge.decode import build_decoder, load_drafter, load_target
from draftforge.decode import packing
from draftforge.decode.packing import PackedLinear, pack_linears, packing_unavailable
from draftforge.decode.tree import DraftTree
from draftforge.errors import RecipeError
from tests.fixtures.decode import save_target_and_drafter, tiny_llama

VOCAB = 96


def _linears(model):
    return [m for m in model.modules() if type(m) in (nn.Linear, PackedLinear)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_target_and_drafter(tmp_path_factory.mktemp("packing"), VOCAB, layers=2)


def _pair(saved, **kw):
    packed = load_target(saved / "target", dtype=torch.bfloat16, **kw)
    plain = load_target(saved / "target", dtype=torch.bfloat16, pack_weights="off")
    why = packing_unavailable(packed.model)
    if why is not None:
        pytest.skip(f"packing unavailable here: {why}")
    return packed, plain


def test_packed_target_computes_the_same_logits_bitwise(saved):
    packed, plain = _pair(saved)
    report = packed.model.draftforge_packing
    assert report.packed + report.unequal == len(_linears(packed.model)) == 2 * 7 + 1
    assert report.packed > 0, report.describe()
    assert all(type(m) is nn.Linear for m in plain.model.modules() if isinstance(m, (nn.Linear, PackedLinear)))
    prompt = [(7 * i + 3) % VOCAB for i in range(23)]
    chain = DraftTree([5, 9, 11], [-1, 0, 1], [1, 2, 3])
    tree = DraftTree([5, 6, 9, 11, 12], [-1, -1, 0, 0, 2], [1, 1, 2, 2, 3])
    for t in (packed, plain):
        t.prefill(prompt)
    for draft in (chain, tree):
        got, want = packed.verify(prompt[-1], draft), plain.verify(prompt[-1], draft)
        assert torch.equal(got, want)
        path = [0, 2] if draft is tree else [0, 1]
        packed.commit(path)
        plain.commit(path)
    # a long prefill (many rows per product) too
    for t in (packed, plain):
        t.prefill(list(range(VOCAB)) * 2)
    assert torch.equal(packed.verify(3, chain), plain.verify(3, chain))


@pytest.mark.parametrize("method", ["ar", "chain", "tree"])
def test_packed_decodes_the_same_tokens(saved, method):
    packed, plain = _pair(saved)
    tokens = []
    for target in (packed, plain):
        drafter = None if method == "ar" else load_drafter(saved / "drafter", target, dtype=torch.bfloat16)
        dec = build_decoder(method, target, drafter)
        tokens.append([dec.generate([1, 2, 3, 4], max_new_tokens=40, eos_token_id=[]).tokens,
                       dec.generate([9, 8, 7], max_new_tokens=25, temperature=1.0, seed=3, eos_token_id=[]).tokens])
    assert tokens[0] == tokens[1]


def test_a_layer_whose_packed_product_differs_stays_plain(saved, monkeypatch):
    real = packing._reorder

    def skewed(weight):  # the packed copy of a slightly different weight: its product differs
        return real(weight + torch.full_like(weight, 2.0**-4))

    monkeypatch.setattr(packing, "_reorder", skewed)
    target = load_target(saved / "target", dtype=torch.bfloat16)
    if packing_unavailable(target.model) is not None:
        pytest.skip(packing_unavailable(target.model))
    report = target.model.draftforge_packing
    assert (report.packed, report.unequal) == (0, 15)
    assert "15 left unpacked" in report.describe()
    assert all(type(m) is nn.Linear for m in _linears(target.model))


def test_the_callers_model_is_left_as_given_unless_asked(saved):
    model = tiny_llama(vocab=VOCAB, layers=2, hidden=64, dtype=torch.bfloat16)
    load_target(model)
    assert all(type(m) is nn.Linear for m in _linears(model)) and not hasattr(model, "draftforge_packing")
    if packing_unavailable(model) is not None:
        pytest.skip(packing_unavailable(model))
    load_target(model, pack_weights="on")
    assert model.draftforge_packing.packed > 0


def test_fp32_and_bad_values(saved):
    target = load_target(saved / "target", dtype=torch.float32)
    assert "bf16" in target.model.draftforge_packing.describe()
    assert all(type(m) is nn.Linear for m in _linears(target.model))
    with pytest.raises(RecipeError, match="pack_weights must be one of auto, on, off"):
        load_target(saved / "target", pack_weights="yes")
    with pytest.raises(RecipeError, match="pack_weights must be one of auto, on, off, got 'yes'"):
        load_drafter("prompt-lookup", target, pack_weights="yes")  # refused for every drafter kind, not ignored


@pytest.mark.parametrize("tied", [False, True])
def test_a_packed_model_moved_to_fp32_is_the_plain_fp32_model(saved, tmp_path, tied):
    if tied:  # the LM head shares the embedding's weight (SmolLM2): .float() converts it through the embedding
        model = tiny_llama(vocab=VOCAB, layers=2, hidden=64)
        model.config.tie_word_embeddings = True
        model.tie_weights()
        assert model.lm_head.weight is model.model.embed_tokens.weight
        model.save_pretrained(tmp_path / "tied")
        saved = tmp_path / "tied"
        (saved / "target").mkdir()
        for f in saved.iterdir():
            if f.is_file():
                f.rename(saved / "target" / f.name)
    packed, plain = _pair(saved)
    if tied:
        assert packed.model.lm_head.weight is packed.model.model.embed_tokens.weight
    fp32_packed = copy.deepcopy(packed.model).float()  # what the bf16 self-check does to classify a mismatch
    fp32_plain = copy.deepcopy(plain.model).float()
    ids = torch.tensor([[4, 5, 6, 7, 8]])
    with torch.inference_mode():
        assert torch.equal(fp32_packed(ids).logits, fp32_plain(ids).logits)
    assert all(m.packed is None for m in fp32_packed.modules() if isinstance(m, PackedLinear))
    assert pack_linears(fp32_packed).skipped is not None  # and it is not packed again in fp32
