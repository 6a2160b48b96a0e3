"""Tree verification vs plain sequences, SSM state rollback vs re-encoding, UCB by hand, bad input."""

from __future__ import annotations

import pytest
import torch

from draftforge.decode import TreeShape, UCBTree, build_decoder, load_drafter, parse_tree
from draftforge.decode.sampling import SamplingParams
from draftforge.decode.tree import DraftTree, root_path
from draftforge.errors import CompatibilityError, DraftforgeError
from tests.fixtures.decode import assert_states_are_reencoded, greedy_reference, tiny_mamba, tiny_mamba2

VOCAB = 16


# widths (3, 2, 2), and STree's 13-token tree whose nodes at one depth have 2, 1 or 0 children
@pytest.mark.parametrize("shape,commit_node", [(TreeShape.from_widths((3, 2, 2)), 13), (parse_tree("stree13"), 9)],
                         ids=["tree322", "stree13"])
def test_tree_logits_equal_root_path_sequences(target, shape, commit_node):
    prompt = [1, 4, 9, 2, 7]
    gen = torch.Generator().manual_seed(0)
    levels = [torch.randint(0, VOCAB, (len(layer),), generator=gen).tolist() for layer in shape.layers]
    tokens, parents, depths = shape.flatten(levels)
    target.prefill(prompt)
    logits_NV = target.verify(prompt[-1], DraftTree(tokens, parents, depths))
    with torch.no_grad():
        plain = target.model(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(logits_NV[0], plain)
        for j in range(len(tokens)):
            seq = prompt + [tokens[k] for k in root_path(parents, j)]
            plain = target.model(torch.tensor([seq])).logits[0, -1]
            torch.testing.assert_close(logits_NV[1 + j], plain, rtol=1e-9, atol=1e-9)
    # after committing a root path, the cache equals the plain prefix's cache
    path = root_path(parents, commit_node)
    target.commit(path)
    nxt = target.verify(5, DraftTree([], [], []))  # the bonus token 5 is fed next round
    seq = prompt + [tokens[k] for k in path] + [5]
    torch.testing.assert_close(nxt[0], target.model(torch.tensor([seq])).logits[0, -1], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("make", [tiny_mamba, tiny_mamba2], ids=["mamba", "mamba2"])
def test_ssm_rollback_equals_reencoding(target, make):
    drafter = load_drafter(make(vocab=VOCAB, dtype=torch.float64), target)
    seq = [3, 1, 4, 1, 5, 9, 2]
    params, gen = SamplingParams(), torch.Generator().manual_seed(0)
    for widths, pick in [((1, 1, 1), 3), ((1, 1, 1), 0), ((2, 2, 2), 2), ((3, 2), 1), ((2, 2, 2), 3), ((1, 1, 1, 1), 2)]:
        tree = drafter.draft(seq, widths, params, gen)
        leaf = [j for j, d in enumerate(tree.depths) if d == len(widths)][-1]  # the last branch, not row 0
        path = root_path(tree.parents, leaf)[:pick]
        drafter.accept(path)
        seq = seq + [tree.tokens[j] for j in path] + [int(torch.randint(0, VOCAB, (), generator=gen))]
        assert drafter.consumed == len(seq) - 1 - (pick == len(widths))  # the bonus (and a leaf) are fed lazily
        assert_states_are_reencoded(drafter, seq)


def test_ucb_choices_match_hand_computation():
    arms = [(1, 1), (2, 1), (2, 2, 2)]
    ucb = UCBTree(arms, ucb_lambda=0.5, lambda_gamma=0.2)
    emitted = {0: [2, 1, 3], 1: [3, 3, 3], 2: [1, 4, 1]}  # scripted N_accept per pull of each arm
    # Worked out by hand. Reward of a pull = -(1 + 0.2*gamma) / n: arms 0 and 1 (gamma 2) get -1.4/n,
    # arm 2 (gamma 3) gets -1.6/n. Score = mean reward + 0.5 * sqrt(2 ln t / pulls).
    # t=1..3: each arm once (untried first) -> 0, 1, 2; means -0.700, -0.467, -1.600.
    # t=4: bonus 0.5*sqrt(2 ln 4) = 0.833 for all -> 0.133, 0.366, -0.767 -> arm 1 (n=3, -0.467).
    # t=5: bonuses 0.897, 0.634, 0.897 -> 0.197, 0.168, -0.703 -> arm 0 (n=1, -1.400; mean -1.050).
    # t=6: bonuses 0.669, 0.669, 0.947 -> -0.381, 0.203, -0.653 -> arm 1 (n=3; mean still -0.467).
    # t=7: bonuses 0.697, 0.569, 0.986 -> -0.353, 0.103, -0.614 -> arm 1.
    expected = [0, 1, 2, 1, 0, 1, 1]
    got = []
    for _ in range(7):
        shape = ucb.next_plan().tree
        got.append([TreeShape.from_widths(a) for a in arms].index(shape))
        ucb.record(shape, emitted[got[-1]][ucb.counts[got[-1]] % 3])
    assert got == expected
    assert ucb.counts == [2, 4, 1]


def test_ucb_learns_from_the_rounds_the_engine_plays_by_hand(target):
    """A drafter equal to the target (float64) has every draft accepted, so a round of an arm of depth d emits
    N = d + 1. Arms (1,1,1,1,1) and (1,1), λ_γ 0.5, 13 new tokens: arm 0 (untried) emits 6, reward -(1 + 0.5·5)/6;
    arm 1 emits 3, reward -(1 + 0.5·2)/3; then arm 0 again (mean -0.583 against -0.667, equal bonuses), cut by the
    budget to 3 drafts: no reward, no pull. A second prompt adds to the same statistics (they restart with the
    decoder, not per prompt): 7 tokens, arm 0 whole (6), then 1 token left, a round that drafts nothing."""
    from tests.fixtures.decode import noisy_copy

    prompt = [(7 * i + 3) % VOCAB for i in range(23)]
    perfect = load_drafter(noisy_copy(target.model, noise=0.0), target)
    dec = build_decoder("ucb", target, perfect, ucb_trees=[(1, 1, 1, 1, 1), (1, 1)], ucb_lambda=0.1,
                        lambda_gamma=0.5)
    res = dec.generate(prompt, max_new_tokens=13)
    assert res.stats.drafted_per_round == [5, 2, 3] and res.tokens == greedy_reference(target, prompt, 13)
    # the first round's drafting (the drafter encodes the prompt there) is kept apart for the cost model
    assert res.stats.first_draft_depth == 5 and 0 < res.stats.first_draft_time_s < res.stats.draft_time_s
    ucb = dec.controller
    assert ucb.counts == [1, 1] and ucb.reward_sums == pytest.approx([-3.5 / 6, -2.0 / 3])
    res = dec.generate([3, 5, 7], max_new_tokens=7)
    assert res.stats.drafted_per_round == [5, 0]
    assert ucb.counts == [2, 1] and ucb.reward_sums == pytest.approx([-7.0 / 6, -2.0 / 3])
    dec.reset()
    assert ucb.counts == [0, 0] and ucb.reward_sums == [0.0, 0.0]


def test_ucb_measures_lambda_gamma_without_the_prompt_encoding(target, monkeypatch):
    """λ_γ measured online is one drafter step over one target forward. On a fake clock each drafter step takes
    1 s, each verification 4 s, and the drafter's first draft of a prompt also encodes the prompt (40 s, paid once
    per decode): λ_γ must be 1/4, and two identical arms must score alike. Counting the encoding as steps gave
    λ_γ = (40 + 3·R)/(3·R)/4 after R rounds and sank whichever arm was played first for the rest of the run."""
    from draftforge.decode import engine
    from tests.fixtures.decode import noisy_copy

    now = [0.0]
    monkeypatch.setattr(engine, "clock", lambda device: now[0])
    drafter = load_drafter(noisy_copy(target.model, noise=0.0), target)
    encoded = [False]
    reset, draft, verify = drafter.reset, drafter.draft, target.verify

    def fake_reset():
        encoded[0] = False
        reset()

    def fake_draft(seq, plan, params, generator):
        now[0] += 0.0 if encoded[0] else 40.0
        encoded[0] = True
        tree = draft(seq, plan, params, generator)
        now[0] += 1.0 * tree.depth
        return tree

    def fake_verify(last, tree):
        now[0] += 4.0
        return verify(last, tree)

    monkeypatch.setattr(drafter, "reset", fake_reset)
    monkeypatch.setattr(drafter, "draft", fake_draft)
    monkeypatch.setattr(target, "verify", fake_verify)
    dec = build_decoder("ucb", target, drafter, ucb_trees=[(1, 1, 1), (1, 1, 1)], ucb_lambda=0.1)
    ucb = dec.controller
    for prompt in ([(7 * i + 3) % VOCAB for i in range(23)], [3, 5, 7, 11]):
        res = dec.generate(prompt, max_new_tokens=17)  # every draft accepted: 4 rounds of 4 tokens, then 1 of 1
        assert res.tokens == greedy_reference(target, prompt, 17)
        assert res.stats.drafted_per_round == [3, 3, 3, 3, 0]
    assert ucb.lambda_gamma == 0.25
    # 8 whole rounds, each N = 4, γ = 3: r = -(1 + 0.25·3)/4 for both arms, which UCB then takes in turn
    assert ucb.counts == [4, 4]
    assert [s / n for s, n in zip(ucb.reward_sums, ucb.counts)] == pytest.approx([-1.75 / 4] * 2)


def test_bad_input_errors(target):
    mamba = load_drafter(tiny_mamba(vocab=VOCAB), target)
    with pytest.raises(DraftforgeError, match="positive integer"):
        build_decoder("tree", target, mamba, tree=(2, 0, 1)).generate([1], max_new_tokens=3)
    with pytest.raises(DraftforgeError, match="temperature"):
        build_decoder("ar", target).generate([1], max_new_tokens=3, temperature=-0.5)
    with pytest.raises(DraftforgeError, match="empty prompt"):
        build_decoder("ar", target).generate([], max_new_tokens=3)
    with pytest.raises(DraftforgeError, match="context"):
        build_decoder("ar", target).generate([1] * 300, max_new_tokens=3)
    with pytest.raises(DraftforgeError, match="batch size must be 1"):
        build_decoder("ar", target).generate([[1, 2], [3, 4]], max_new_tokens=3)
    with pytest.raises(DraftforgeError, match="hf_assisted needs a Hugging Face model as the drafter .*'lookup'"):
        build_decoder("hf_assisted", target, load_drafter("prompt-lookup", target))  # a Mamba: test_lossless.py
    with pytest.raises(DraftforgeError, match="unknown decoding method"):
        build_decoder("beam", target, mamba)
    with pytest.raises(CompatibilityError, match="target .* drafter"):
        load_drafter(tiny_mamba(vocab=VOCAB + 4), target)
    other = load_drafter(tiny_mamba(vocab=VOCAB + 4, dtype=torch.float64), target, allow_vocab_mismatch=True)
    res = build_decoder("chain", target, other, chain_length=2).generate([1, 2], max_new_tokens=5)
    assert res.tokens == greedy_reference(target, [1, 2], 5)


def test_sliding_window_models_are_refused_and_the_window_off_decodes_as_generate():
    """A sliding-window cache drops old keys: chain decoding raised in transformers' crop and trees built a mask
    of the wrong width. Such a target or drafter is refused at load in one line; with the window off (the advice,
    when prompt and answer fit in the window) every method decodes what generate() decodes with the window on."""
    from transformers import MistralConfig, MistralForCausalLM

    from draftforge.decode import load_target
    from tests.fixtures.decode import noisy_copy

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, sliding_window=40,
                        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = MistralForCausalLM(cfg).eval()
    plain = MistralForCausalLM(MistralConfig(**{**cfg.to_dict(), "sliding_window": None})).eval()
    plain.load_state_dict(model.state_dict())
    with pytest.raises(CompatibilityError, match=r"target 'mistral' has 2 sliding_attention layer\(s\) \(window "
                                                 r"40\).*sliding_window = None"):
        load_target(model)
    with pytest.raises(CompatibilityError, match=r"drafter 'mistral' has 2 sliding_attention"):
        load_drafter(model, load_target(plain))
    prompt = [(5 * i + 3) % 64 for i in range(20)]
    ids = torch.tensor([prompt])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)[0, 20:]
    target, drafter = load_target(plain), load_drafter(noisy_copy(plain, noise=0.05), load_target(plain))
    for method, opts in (("chain", {"chain_length": 3}), ("tree", {"tree": "2,2"})):
        got = build_decoder(method, target, drafter, **opts).generate(prompt, max_new_tokens=16).tokens
        assert got == ref.tolist(), method
