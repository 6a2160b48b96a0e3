"""The target's features for a drafter that reads its hidden states: the states entering the asked layers, kept by
forward pre-hooks (targets.LayerInputs) instead of transformers' output_hidden_states. Oracle: the model's own
forward with output_hidden_states=True, hidden_states[i]."""

from __future__ import annotations

import torch

from draftforge.decode import load_target
from draftforge.eval.selfcheck import chain_tree
from tests.fixtures.decode import tiny_llama

LAYERS = [0, 2, 3]


def test_features_are_the_models_own_hidden_states_and_only_the_asked_layers_are_gathered():
    model = tiny_llama(vocab=64, layers=4)
    target = load_target(model)
    target.want_features(LAYERS)
    asked = []
    model.register_forward_pre_hook(lambda m, args, kwargs: asked.append(kwargs.get("output_hidden_states")),
                                    with_kwargs=True)
    seq = [(7 * i + 3) % 64 for i in range(30)]
    target.prefill(seq)
    target.verify(seq[-1], chain_tree([5, 9, 11]))
    target.commit([0, 1])  # two drafts accepted: rows 0 (the last token), 1 and 2 committed
    got = target.take_features()
    assert asked == [False, False]  # prefill and verify: output_hidden_states never asked for
    with torch.no_grad():
        out = model(input_ids=torch.tensor([seq + [5, 9]]), output_hidden_states=True)
    want = torch.cat([out.hidden_states[i][0] for i in LAYERS], -1)
    assert got.shape == want.shape == (len(seq) + 2, 3 * 32)  # the prompt, then the last token and two drafts
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # a cached forward sums in another order
    assert not any(layer._forward_pre_hooks for layer in model.model.layers)  # the hooks are removed after each
