"""The EAGLE-3 export read by `speculators` itself (the library whose checkpoint format vLLM serves): its loader
takes our directory, its config names what ours does, its vocabulary maps are ours, and its forward (the
training-time-test unroll speculators trains with) gives our head's logits at steps 0, 1 and 2, both through our
`ttt_forward` and through the `step` path the drafter decodes with.

speculators 0.9.0 pins transformers <= 5.19, below draftforge's own environment, so this runs where speculators
is installed (the vLLM venv: `WITH_SPECULATORS=1 bash benchmarks/serving/setup_vllm.sh`) and is skipped, with
that reason, everywhere else:

    PYTHONPATH=. VLLM_VENV/bin/python -m pytest tests/models/test_eagle3_speculators.py
"""

from __future__ import annotations

import json

import pytest
import torch

speculators_eagle3 = pytest.importorskip(
    "speculators.models.eagle3",
    reason="speculators is not installed here (it needs transformers <= 5.19: install it in the vLLM venv)")

from draftforge.models.eagle3 import Eagle3Config, Eagle3Head  # noqa: E402
from draftforge.models.eagle3_export import save_head  # noqa: E402

VOCAB, HIDDEN, LAYERS = 128, 64, 4
T = 128  # speculators' flex-attention masks come in blocks of 128 positions
STEPS = 3


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("eagle3_speculators")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    target = LlamaForCausalLM(config).eval()
    target.save_pretrained(root / "target")
    draft_vocab = sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:48].tolist())
    head = Eagle3Head(Eagle3Config.from_target(config, draft_vocab=draft_vocab))
    with torch.no_grad():  # weights large enough that attention is peaked and logits are O(1-10)
        for name, p in head.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 2.0 / p.shape[1] ** 0.5)
    head.use_embedding(target.get_input_embeddings())
    head.eval()
    save_head(head, config, None, root / "export", {"target": str(root / "target")}, steps=STEPS)
    loaded = speculators_eagle3.Eagle3DraftModel.from_pretrained(str(root / "export")).eval()
    # speculators loads the verifier's embedding only where its own is still NaN (its "never loaded" sentinel),
    # but with transformers 5.19 `from_pretrained` leaves that weight as uninitialised memory, so whether it is
    # loaded depends on what the memory held. The export stores no embedding (vLLM shares the target's), so the
    # verifier's is loaded here through speculators' own loader, unconditionally.
    loaded._load_verifier_weights(overwrite_embed_tokens=True)
    return {"root": root, "config": config, "target": target, "head": head, "theirs": loaded}


def test_speculators_reads_the_config(exported):
    theirs, head, root = exported["theirs"], exported["head"], exported["root"]
    c = theirs.config
    assert c.speculators_model_type == "eagle3"
    assert c.eagle_aux_hidden_state_layer_ids == head.config.aux_layers
    assert c.draft_vocab_size == len(head.config.draft_vocab) == theirs.draft_vocab_size
    assert c.transformer_layer_config.hidden_size == HIDDEN == theirs.hidden_size
    assert c.transformer_layer_config.num_hidden_layers == 1 and len(theirs.layers) == 1
    assert c.transformer_layer_config.vocab_size == VOCAB
    assert c.norm_before_residual is False and not c.norm_before_fc and not c.fc_norm and not c.norm_output
    assert c.speculators_config.verifier.name_or_path == str(root / "target")
    assert json.loads((root / "export" / "config.json").read_text())["architectures"] == ["Eagle3Speculator"]


def test_speculators_reads_our_vocabulary_maps_and_weights(exported):
    theirs, head, target = exported["theirs"], exported["head"], exported["target"]
    ids = torch.tensor(head.config.draft_vocab)
    assert theirs.d2t.dtype == torch.long and torch.equal(theirs.d2t, ids - torch.arange(len(ids)))
    assert torch.equal(theirs.d2t + torch.arange(len(ids)), head.draft_to_target())  # offsets -> target ids
    assert theirs.t2d.dtype == torch.bool and torch.equal(theirs.t2d.nonzero().flatten(), ids)
    # the embedding it took from the verifier is the target's, every stored weight is ours
    assert torch.equal(theirs.embed_tokens.weight, target.get_input_embeddings().weight)
    mine = head.state_dict()
    for name, value in mine.items():
        assert torch.equal(theirs.state_dict()[name], value), name


def _speculators_logits(model, aux_1TA, ids_1T, steps):
    """speculators' TTT forward returns argmax tokens only: its per-step logits are read off lm_head."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))
    try:
        with torch.no_grad():
            model(hidden_states=aux_1TA, input_ids=ids_1T, document_ids=torch.zeros_like(ids_1T), ttt_steps=steps)
    finally:
        hook.remove()
    assert len(seen) == steps
    return seen


@pytest.fixture(scope="module")
def inputs(exported):
    g = torch.Generator().manual_seed(2)
    aux = torch.randn(1, T, len(exported["head"].config.aux_layers) * HIDDEN, generator=g)
    ids = torch.randint(0, VOCAB, (1, T), generator=g)
    return aux, ids, _speculators_logits(exported["theirs"], aux, ids, STEPS)


def test_speculators_forward_equals_our_training_unroll(exported, inputs):
    """Step k at index t: token ids[t + k] (0 past the end), the step k-1 output as feature, position t + 1 + k,
    attending to the step-0 entries of indices <= t and its own entries of steps 1..k."""
    aux, ids, theirs = inputs
    head = exported["head"]
    with torch.no_grad():
        ours = [head.logits(out) for out in head.ttt_forward(ids, aux, STEPS)]
    for k in range(STEPS):
        assert theirs[k].abs().max() > 1.0  # a real signal, not near-zero logits
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-4, atol=1e-4, msg=lambda m: f"step {k}: {m}")


@pytest.mark.parametrize("anchor", [0, 7, 60, T - STEPS])
def test_speculators_forward_equals_our_decoding_steps(exported, inputs, anchor):
    """The drafter's path (`Eagle3Head.step` with a KV cache): the anchors' step-0 entries in one causal forward,
    then a chain from `anchor`, each step one query over the anchors <= `anchor` and the chain so far."""
    aux, ids, theirs = inputs
    head = exported["head"]
    with torch.no_grad():
        cache = head.new_cache()
        out0 = head.step(ids[0], head.fuse(aux[0]), torch.arange(1, T + 1), cache, None)
        torch.testing.assert_close(head.logits(out0), theirs[0][0], rtol=1e-4, atol=1e-4)
        cache.truncate(anchor + 1)  # the anchors <= `anchor`; the chain's entries follow them
        feature = out0[anchor]
        for k in range(1, STEPS):
            out = head.step(ids[0, anchor + k : anchor + k + 1], feature[None], torch.tensor([anchor + 1 + k]),
                            cache, None)
            torch.testing.assert_close(head.logits(out)[0], theirs[k][0, anchor], rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"anchor {anchor} step {k}: {m}")
            feature = out[0]
