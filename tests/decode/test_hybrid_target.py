"""SSM and hybrid targets (HybridTarget): greedy output equals the target's own generate(), tree logits
equal per-path runs, and states after commit equal a re-encoding of the accepted prefix."""

from __future__ import annotations

import pytest
import torch

from draftforge.decode import build_decoder, load_drafter, load_target, parse_tree
from draftforge.decode.targets.hybrid import HybridTarget
from draftforge.decode.tree import DraftTree, root_path
from draftforge.errors import CompatibilityError
from tests.fixtures.decode import (assert_stops_at_eos, feature_mamba_head, greedy_reference, tiny_llama, tiny_mamba,
                                   tiny_mamba2)
from tests.fixtures.hybrid import HYBRIDS, ScriptedDrafter, tiny_bamba, tiny_jamba

VOCAB = 48
PROMPTS = [[4], [3, 5, 7, 9, 11, 2, 8], [(7 * i + 3) % VOCAB for i in range(21)]]


@pytest.fixture(scope="module")
def targets():
    return {name: load_target(make(vocab=VOCAB)) for name, make in HYBRIDS.items()}


_REF: dict = {}


def reference(target, prompt, max_new, eos=None):
    key = (id(target), tuple(prompt), max_new, eos)
    if key not in _REF:
        _REF[key] = greedy_reference(target, prompt, max_new, eos=eos)
    return _REF[key]


def test_load_target_picks_the_hybrid_target(targets):
    assert all(isinstance(t, HybridTarget) for t in targets.values())


# STree's 13-token config A (Fig. 4a): parent lists, nodes at one depth have 2, 1 or 0 children
STREE13 = parse_tree("stree13")
# chain, 13 tokens as widths (depth 4, width 3), a wide-then-deep tree, a bushy one, and the paper's tree
SHAPES = [("chain", {"chain_length": 4}), ("tree", {"tree": (3, 1, 1, 1)}), ("tree", {"tree": (2, 2, 2, 1)}),
          ("tree", {"tree": (4, 3)}), ("tree", {"tree": STREE13})]


@pytest.mark.parametrize("name", list(HYBRIDS))
@pytest.mark.parametrize("method,options", SHAPES, ids=["chain4", "tree3111", "tree2221", "tree43", "stree13"])
def test_greedy_equals_generate_with_accepting_drafts(targets, name, method, options):
    target = targets[name]
    dec = build_decoder(method, target, ScriptedDrafter(target, seed=len(name)), **options)
    accepted = 0
    for prompt in PROMPTS:
        for max_new in (1, 14):  # 14 ends mid-draft for these shapes
            res = dec.generate(prompt, max_new_tokens=max_new)
            assert res.tokens == reference(target, prompt, max_new), (name, prompt, max_new)
            assert res.stats.new_tokens == max_new
            accepted += sum(res.stats.accepted_per_round)
    assert accepted > 10  # deep paths were accepted, so replay along multi-node paths was exercised


@pytest.mark.parametrize("name", ["bamba", "nemotron_h", "granitemoehybrid", "mamba2"])
@pytest.mark.parametrize("kind", ["transformer", "mamba", "mamba2", "feature_mamba2"])
def test_greedy_equals_generate_for_every_drafter_kind(targets, name, kind):
    """feature_mamba2 reads the hybrid target's own layer states (HybridTarget.want_features)."""
    target = targets[name]
    make = {"transformer": tiny_llama, "mamba": tiny_mamba, "mamba2": tiny_mamba2,
            "feature_mamba2": lambda vocab: feature_mamba_head(target.model)}[kind]
    drafter = load_drafter(make(vocab=VOCAB), target)
    for method, options in [("chain", {"chain_length": 3}), ("tree", {"tree": (VOCAB, 2, 1)}), ("ar", {})]:
        dec = build_decoder(method, target, drafter, **options)
        for prompt in PROMPTS[:2]:
            res = dec.generate(prompt, max_new_tokens=9)
            assert res.tokens == reference(target, prompt, 9), (method, prompt)
            if method == "tree":  # a full first level always accepts depth 1
                assert sum(res.stats.accepted_per_round) > 0


@pytest.mark.parametrize("kind", ["transformer", "mamba", "mamba2"])
def test_stree13_with_real_drafters_equals_generate(targets, kind):
    """The drafters' own stree13 drafts (fed nodes only, ranked children) on a Bamba target, T=0 and T=1."""
    target = targets["bamba"]
    make = {"transformer": tiny_llama, "mamba": tiny_mamba, "mamba2": tiny_mamba2}[kind]
    dec = build_decoder("tree", target, load_drafter(make(vocab=VOCAB), target), tree=STREE13)
    for prompt in PROMPTS[:2]:
        res = dec.generate(prompt, max_new_tokens=11)
        assert res.tokens == reference(target, prompt, 11), prompt
        assert res.stats.drafted_per_round[0] == 12  # rounds near max_new_tokens are cut to a shallower tree
        sampled = dec.generate(prompt, max_new_tokens=11, temperature=1.0, seed=3)
        assert len(sampled.tokens) == 11 and max(sampled.stats.drafted_per_round) == 12


@pytest.mark.parametrize("name", ["bamba", "mamba2"])
def test_eos_inside_draft_stops_like_generate(targets, name):
    target, prompt = targets[name], PROMPTS[1]
    eos = reference(target, prompt, 20)[6]
    dec = build_decoder("tree", target, ScriptedDrafter(target, miss=0.0, second=0.0), tree=(3, 1, 1, 1))
    assert_stops_at_eos(dec, target, prompt, eos)


def _tree(tokens, parents):
    depths = [len(root_path(parents, j)) for j in range(len(parents))]
    return DraftTree(list(tokens), list(parents), depths)


@pytest.mark.parametrize("name", list(HYBRIDS))
@pytest.mark.parametrize("parents", [[-1, -1, 0, 0, 1, 2, 2, 4, -1], STREE13.parents], ids=["mixed", "stree13"])
def test_tree_logits_equal_each_root_path_run_as_a_sequence(targets, name, parents):
    target, prefix = targets[name], [5, 9, 13, 2, 7, 30]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (len(parents),), generator=gen).tolist()
    target.prefill(prefix + [11])
    logits_NV = target.verify(11, _tree(tokens, parents))
    model = target.model
    with torch.no_grad():
        for j in range(len(parents)):
            seq = prefix + [11] + [tokens[i] for i in root_path(parents, j)]
            want_V = model(torch.tensor([seq]), position_ids=torch.arange(len(seq))[None]).logits[0, -1]
            assert torch.allclose(logits_NV[1 + j], want_V, atol=2e-5, rtol=1e-4), (name, j)
        want_root = model(torch.tensor([prefix + [11]])).logits[0, -1]
        assert torch.allclose(logits_NV[0], want_root, atol=2e-5, rtol=1e-4)


def _states(target):
    """Every layer's (conv, ssm) state, plus attention K/V, of a target's cache."""
    out = []
    for layer in target.cache.layers:
        conv = getattr(layer, "conv_states", {}).get(0)
        ssm = getattr(layer, "recurrent_states", {}).get(0)
        keys = getattr(layer, "keys", None)
        out.append((conv, ssm, keys, getattr(layer, "values", None)))
    return out


@pytest.mark.parametrize("name", list(HYBRIDS))
@pytest.mark.parametrize("accepted", [-1, 0, 5, 7])
def test_states_after_commit_equal_reencoding_the_accepted_prefix(targets, name, accepted):
    target, prefix = targets[name], [5, 9, 13, 2, 7, 30, 11]
    parents = [-1, -1, 0, 0, 1, 2, 2, 4, 7]
    tokens = [(3 * j + 1) % VOCAB for j in range(len(parents))]
    path = root_path(parents, accepted) if accepted >= 0 else []
    target.prefill(prefix)
    target.verify(prefix[-1], _tree(tokens, parents))
    target.commit(path)
    got = _states(target)
    fresh = HybridTarget(target.model)
    fresh.prefill(prefix + [tokens[j] for j in path] + [0])  # encodes everything but the last (dummy) token
    want = _states(fresh)
    assert target.length == fresh.length == len(prefix) + len(path)
    for layer, (g, w) in enumerate(zip(got, want)):
        for what, a, b in zip(("conv", "ssm", "keys", "values"), g, w):
            assert (a is None) == (b is None), (name, layer, what)
            if a is not None:
                assert torch.allclose(a.float(), b.float(), atol=1e-5, rtol=1e-4), (name, layer, what)
    # and decoding goes on exactly from there
    tail = target.verify(0, _tree([], []))
    assert torch.allclose(tail[0], fresh.verify(0, _tree([], []))[0], atol=2e-5)


def test_unknown_or_mamba1_hybrids_are_refused_with_the_supported_list():
    with pytest.raises(CompatibilityError, match="Mamba-1.*Supported SSM/hybrid targets: Mamba2ForCausalLM"):
        load_target(tiny_jamba(vocab=VOCAB))
    with pytest.raises(CompatibilityError, match="Mamba-1"):
        load_target(tiny_mamba(vocab=VOCAB))
    model = tiny_bamba(vocab=VOCAB)
    model.config.model_type = "my_hybrid"
    with pytest.raises(CompatibilityError, match="does not know.*BambaForCausalLM.*NemotronHForCausalLM"):
        load_target(model)


def test_drafter_with_another_vocabulary_or_a_hybrid_drafter_is_refused(targets):
    with pytest.raises(CompatibilityError, match="vocab sizes differ"):
        load_drafter(tiny_mamba2(vocab=VOCAB + 8), targets["bamba"])
    with pytest.raises(CompatibilityError, match="hybrid/recurrent.*task distill"):
        load_drafter(tiny_bamba(vocab=VOCAB), targets["mamba2"])


def test_tree_over_the_kernel_limit_uses_the_reference_with_a_note(targets, monkeypatch):
    import draftforge.decode.targets.hybrid as ht

    monkeypatch.setattr(ht, "MAX_KERNEL_NODES", 0)
    # impl="triton" on CPU tensors would raise: every tree (over 0 rows) must go to the reference instead
    target = HybridTarget(targets["bamba"].model, impl="triton")
    dec = build_decoder("tree", target, ScriptedDrafter(target), tree=(3, 2))
    assert dec.generate(PROMPTS[1], max_new_tokens=6).tokens == reference(targets["bamba"], PROMPTS[1], 6)
    assert target.costs[0].tokens == 10 and all(c.states == 1 and not c.kernel for c in target.costs)
    assert any("kernel limit" in note for note in target.notes)


@pytest.mark.slow  # ~30 s on a shared CPU
def test_sampling_on_a_hybrid_target_follows_its_distribution():
    from tests.decode.test_sampling import assert_two_tokens_follow_target

    target = load_target(tiny_bamba(vocab=8))
    prompt = [1, 2, 3]
    dec = build_decoder("tree", target, load_drafter(tiny_mamba2(vocab=8), target), tree=(3, 2))
    assert_two_tokens_follow_target(dec, target, prompt)  # min(1, p/q) really exercised


def test_a_float64_hybrid_a_mixer_called_without_its_cache_and_a_clamped_time_step(capsys):
    # float64 loaded, then failed at the first verification blaming "the mixer inputs"; a layer that handed its
    # mixer the cache positionally (or not at all) was scanned from an empty state, silently; a clamped time step
    # (which generate()'s one-token steps do not apply) parted from generate() without a word
    from tests.fixtures.hybrid import tiny_nemotron_h

    with pytest.raises(CompatibilityError, match="float32, bfloat16 or float16.*not torch.float64"):
        load_target(tiny_bamba(vocab=VOCAB, dtype=torch.float64))
    from draftforge.decode.targets.hybrid import tree_mixers

    target = load_target(tiny_bamba(vocab=VOCAB))
    mixer = next(iter(target.mixers.values()))
    hidden = torch.zeros(1, 2, target.model.config.hidden_size)
    with tree_mixers(target.mixers, None, "reference"):  # the forward a verification routes the mixers through
        with pytest.raises(CompatibilityError, match="called positionally"):
            mixer(hidden, target.cache)
        with pytest.raises(CompatibilityError, match="called without its cache"):
            mixer(hidden)
    capsys.readouterr()
    load_target(tiny_nemotron_h(vocab=VOCAB))  # its time step is clamped from below at time_step_min
    assert "clamps its SSM time step to (0.001, inf)" in capsys.readouterr().err


def test_hf_assisted_refuses_ssm_and_hybrid_targets_at_build(targets):
    """Before transformers 5.25 assisted generation with a stateful target raised a ValueError mid-decode (and
    mid-eval, which adds hf_assisted by default); 5.25 runs it but on a Mamba2 target emits other tokens than
    generate() once a round accepts part of its drafts. So hf_assisted is refused at build, in one line."""
    from draftforge.errors import DraftforgeError

    for name, target in targets.items():
        with pytest.raises(DraftforgeError, match=rf"needs a Transformer target with a KV cache, not '{name}'"):
            build_decoder("hf_assisted", target, load_drafter(tiny_llama(vocab=VOCAB), target))
