"""The early-exit drafter (EESD §3.1): lossless greedy with fixed K and with a stop rule, KV sharing with the
target (layers 1..N run once per token, on the target's own cache), chains only, bad pairings, a reduced
draft vocabulary (d2t map) drafting target ids and sampling exactly.

Oracle: the target's own greedy generate(). Exit heads are untrained copies of the target's last layer,
norm and head (EESD's init), which agree with the target often enough for drafts to be accepted.
"""

from __future__ import annotations

import pytest
import torch

from draftforge.decode import (
    SpeculativeDecoder,
    StoppableChain,
    StopRule,
    build_decoder,
    load_target,
)
from draftforge.decode.methods.eesd import EarlyExitDrafter, EarlyExitTarget
from draftforge.errors import CompatibilityError, DraftforgeError, RecipeError
from draftforge.models.eesd import ExitHead, Trunk, split_target
from tests.fixtures.decode import greedy_reference, late_eos, tiny_llama
from tests.fixtures.plans import PlanController
from draftforge.hfcompat import cache_param, passed_cache

VOCAB, LAYERS = 16, 4
PROMPTS = [[4], [3, 5, 7], [(7 * i + 3) % VOCAB for i in range(23)]]
MAX_NEWS = (1, 2, 7, 20)  # 7 and 20 end mid-draft for K = 3 and 5


@pytest.fixture(scope="module")
def target():
    return load_target(tiny_llama(vocab=VOCAB, layers=LAYERS, dtype=torch.float64))


_REFS: dict = {}


def reference(target, prompt, max_new, eos=None):
    """greedy_reference, computed once per (model, prompt, length, eos); the key holds the model itself, so a freed
    model's id reused by another cannot serve it the first one's answers."""
    key = (target.model, tuple(prompt), max_new, eos)
    if key not in _REFS:
        _REFS[key] = greedy_reference(target, prompt, max_new, eos=eos)
    return _REFS[key]


def drafter_for(target, n, with_layer=True, draft_vocab=None):
    head = ExitHead.from_target(split_target(target.model), n, with_layer, draft_vocab=draft_vocab)
    return EarlyExitDrafter(head, n, target.vocab_size)


def check_lossless(target, drafter, plan=None, k=None, eos=None):
    if plan is not None:
        dec = SpeculativeDecoder("eesd-test", drafter.paired_target(target), drafter, PlanController(plan))
    else:
        dec = build_decoder("eesd", target, drafter, chain_length=k)
    accepted, rounds = 0, 0
    for prompt in PROMPTS:
        for max_new in MAX_NEWS:
            res = dec.generate(prompt, max_new_tokens=max_new, eos_token_id=eos)
            assert res.tokens == reference(target, prompt, max_new, eos), (prompt, max_new)
            if eos is None:  # (a round cut at EOS emits fewer tokens than it accepted)
                assert res.stats.new_tokens == sum(res.stats.accepted_per_round) + res.stats.target_forwards
            accepted += sum(res.stats.accepted_per_round)
            rounds += res.stats.target_forwards
    return accepted, rounds


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_fixed_chains_are_lossless(target, n, k):
    accepted, rounds = check_lossless(target, drafter_for(target, n), k=k)
    if n == 3 and k > 1:
        assert accepted > rounds  # the exit really drafts: more than one accepted draft per round


def test_eos_inside_a_draft_ends_the_output_there(target):
    drafter = drafter_for(target, 3)
    dec = build_decoder("eesd", target, drafter, chain_length=5)
    prompt = PROMPTS[2]
    eos = late_eos(greedy_reference(target, prompt, 20))  # first emitted mid-way
    res = dec.generate(prompt, max_new_tokens=20, eos_token_id=eos)
    assert res.tokens == greedy_reference(target, prompt, 20, eos=eos) and res.tokens[-1] == eos
    # the EOS came out of a draft: its round emitted its accepted drafts and no token of the target's after them
    stats = res.stats
    assert len(res.tokens) >= 4 and len(res.tokens) == sum(stats.accepted_per_round) + stats.target_forwards - 1
    check_lossless(target, drafter, k=5, eos=eos)


def test_head_only_exit_is_lossless(target):
    check_lossless(target, drafter_for(target, 2, with_layer=False), k=3)


class ScriptedStop(StopRule):
    """Ends round r's chain after lengths[r % len(lengths)] drafts; keeps what it was told."""

    def __init__(self, lengths):
        self.lengths, self.round, self.steps = lengths, -1, []

    def start_round(self):
        self.round += 1

    def should_stop(self, step):
        self.steps.append((step.depth, step.token, step.hidden_D.clone()))
        return step.depth >= self.lengths[self.round % len(self.lengths)]


def test_a_stop_rule_ends_chains_losslessly_and_sees_the_exit_state(target):
    rule = ScriptedStop([1, 4, 2, 6, 3])
    drafter = drafter_for(target, 3)
    accepted, _ = check_lossless(target, drafter, plan=StoppableChain(6, rule))
    assert accepted > 0
    depths = [d for d, _, _ in rule.steps]
    assert max(depths) == 5 and 1 in depths  # chains of many lengths (6 = the cap, never asked)
    assert all(h.shape == (target.model.config.hidden_size,) for _, _, h in rule.steps)
    # hidden_D = the post-norm exit output after consuming the drafted token: recompute it without caches
    rule.steps.clear()
    seq = PROMPTS[2]
    paired = drafter.paired_target(target)
    paired.prefill(seq)
    drafter.reset()
    tree = drafter.draft(seq, StoppableChain(6, rule), _greedy(), torch.Generator().manual_seed(0))
    parts = split_target(target.model)
    with torch.no_grad():
        hidden, pos, rope, mask = Trunk(parts, 3)(torch.tensor([seq + tree.tokens]))
        _, normed = drafter.exit_head(hidden, pos, rope, mask)
    for depth, token, h in rule.steps:
        assert token == tree.tokens[depth - 1]
        torch.testing.assert_close(h, normed[0, len(seq) - 1 + depth], rtol=1e-9, atol=1e-9)


def _greedy():
    from draftforge.decode.sampling import SamplingParams

    return SamplingParams()


def count_rows(layers, log):
    """Hooks adding (layer, rows, cache object) per forward of each layer. The cache is read under the name the
    installed transformers' layer signature gives it (cache_param raises if it names none), and a call under
    another name fails (passed_cache), so a rename cannot turn this into a check of `None is None`."""
    name = cache_param(layers[0])

    def hook(idx):
        def fn(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            log.append((idx, hidden.shape[1], passed_cache(kwargs, name)))
        return fn
    return [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]


@pytest.mark.parametrize("plan", ["fixed", "stop"])
def test_layers_1_to_n_run_once_per_token_on_the_targets_own_cache(target, plan):
    n, prompt = 2, PROMPTS[2]
    drafter = drafter_for(target, n)
    paired = drafter.paired_target(target)
    log = []
    hooks = count_rows(target.model.model.layers, log)
    try:
        if plan == "fixed":
            res = build_decoder("eesd", target, drafter, chain_length=4).generate(prompt, max_new_tokens=20)
        else:
            dec = SpeculativeDecoder("t", paired, drafter, PlanController(StoppableChain(5, ScriptedStop([2, 5, 1]))))
            res = dec.generate(prompt, max_new_tokens=20)
    finally:
        for h in hooks:
            h.remove()
    rows = [sum(q for i, q, _ in log if i == layer) for layer in range(LAYERS)]
    # every row a layer saw: the prompt once, then per round y_t and each drafted token once
    expected = len(prompt) - 1 + res.stats.target_forwards + sum(res.stats.drafted_per_round)
    assert rows == [expected] * LAYERS  # layers 1..N saw exactly what layers N+1..L saw: nothing recomputed
    assert all(cache is paired.lm.cache for _, _, cache in log)  # every layer wrote the target's one cache
    assert drafter.cache is not paired.lm.cache and len(drafter.cache.layers) == 1  # the exit layer's own
    committed = len(prompt) + len(res.tokens) - 1
    assert [layer.get_seq_length() for layer in paired.lm.cache.layers] == [committed] * LAYERS


def test_the_cost_model_times_the_split_verification_alone(target, monkeypatch):
    """The eval priced an EESD round's verification as the whole target over its rows, counting layers 1..N again
    for rows drafting already ran through them. Timed on the split target, each verification of N rows runs
    layers N+1..L over N rows and layers 1..N over the last draft only (drafting never fed it), while what drafting
    leaves (layers 1..N over y_t and the other drafts) runs outside the clock."""
    from draftforge.eval import cost

    n, prompt = 2, PROMPTS[2]
    paired = drafter_for(target, n).paired_target(target)
    log, windows = [], []
    monkeypatch.setattr(cost, "_clock", lambda device: windows.append(len(log)) or float(len(windows)))
    hooks = count_rows(target.model.model.layers, log)
    try:
        curve = cost.verify_curve(paired, prompt, [1, 3, 6], repeats=2)
    finally:
        for h in hooks:
            h.remove()
    assert sorted(curve) == [1, 3, 6]
    timed = [log[a:b] for a, b in zip(windows[::2], windows[1::2])]  # what ran between each pair of clock reads
    assert len(timed) == 3 * (2 + 2)  # per row count 2 warm-up calls + 2 samples (one call each: 1 fake s a call)
    for rows in timed:
        deep = {q for i, q, _ in rows if i >= n}
        assert len(deep) == 1 and [q for i, q, _ in rows if i < n] == [1] * n  # one row through layers 1..N
        assert [i for i, _, _ in rows] == list(range(LAYERS))  # every layer once: nothing recomputed
    assert sorted({q for rows in timed for i, q, _ in rows if i >= n}) == [1, 3, 6]
    # and the plain target's curve still times the whole forward over its rows
    log.clear(), windows.clear()
    hooks = count_rows(target.model.model.layers, log)
    try:
        cost.verify_curve(target, prompt, [3], repeats=1)
    finally:
        for h in hooks:
            h.remove()
    timed = [log[a:b] for a, b in zip(windows[::2], windows[1::2])]
    assert all([q for _, q, _ in rows] == [3] * LAYERS for rows in timed)


def test_shared_cache_tensors_are_the_targets(target):
    drafter = drafter_for(target, 2)
    paired = drafter.paired_target(target)
    seq = PROMPTS[1]
    paired.prefill(seq)
    drafter.reset()
    before = [id(layer) for layer in paired.lm.cache.layers]
    drafter.draft(seq, (1, 1, 1), _greedy(), torch.Generator())
    shallow = paired.lm.cache.layers[:2]
    assert [id(layer) for layer in paired.lm.cache.layers] == before  # the same layer objects, written in place
    assert [layer.get_seq_length() for layer in shallow] == [len(seq) + 2] * 2  # y_t, x_1, x_2 appended there
    assert [layer.get_seq_length() for layer in paired.lm.cache.layers[2:]] == [len(seq) - 1] * 2  # not yet verified


def test_trees_are_refused_clearly(target):
    drafter = drafter_for(target, 2)
    dec = build_decoder("tree", target, drafter, tree=(2, 1))
    with pytest.raises(DraftforgeError, match="chains"):
        dec.generate(PROMPTS[1], max_new_tokens=5)


def test_other_methods_pair_the_target_and_sampling_runs(target):
    drafter = drafter_for(target, 3)
    res = build_decoder("chain", target, drafter, chain_length=3).generate(PROMPTS[1], max_new_tokens=9)
    assert res.tokens == greedy_reference(target, PROMPTS[1], 9)
    sampled = build_decoder("eesd", target, drafter, chain_length=3).generate(PROMPTS[1], max_new_tokens=9,
                                                                            temperature=1.0, seed=3)
    assert len(sampled.tokens) == 9


def test_bad_pairings_and_exits(target):
    with pytest.raises(RecipeError, match=r"\[1, 3\]"):
        EarlyExitTarget(target.model, LAYERS)
    with pytest.raises(RecipeError, match=r"\[1, 3\]"):
        EarlyExitTarget(target.model, 0)
    with pytest.raises(DraftforgeError, match="EESD exit head"):
        build_decoder("eesd", target, object())
    from tests.fixtures.decode import tiny_mamba

    with pytest.raises(CompatibilityError, match="llama, mistral, qwen2"):
        split_target(tiny_mamba(vocab=VOCAB))
    unbound = drafter_for(target, 2)
    unbound.bind(target)  # a plain target: the split verification would be skipped
    with pytest.raises(DraftforgeError, match="paired target"):
        SpeculativeDecoder("x", target, unbound, PlanController(StoppableChain(2, ScriptedStop([1])))).generate(
            [1, 2], max_new_tokens=4)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_other_llama_family_targets_are_lossless(family):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                  sliding_window=None, use_sliding_window=False)
    model = AutoModelForCausalLM.from_config(config).to(torch.float64).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    fam_target = load_target(model)
    check_lossless(fam_target, drafter_for(fam_target, 2), k=3)


def test_want_hidden_gives_the_targets_final_states(target):
    """A controller asking for the target's hidden states (Cali-TS's H^T) gets exact ones from the split forward."""
    drafter = drafter_for(target, 3)
    paired = drafter.paired_target(target)
    paired.want_hidden = True
    try:
        prompt = PROMPTS[2]
        res = build_decoder("eesd", target, drafter, chain_length=4).generate(prompt, max_new_tokens=9)
        last, start = paired.last, paired._verify_start
        with torch.no_grad():
            full = target.model(torch.tensor([prompt + res.tokens]), output_hidden_states=True).hidden_states[-1][0]
        rows = 1 + len(last.path)
        torch.testing.assert_close(last.hidden_ND[:rows], full[start:start + rows], rtol=1e-9, atol=1e-9)
    finally:
        paired.want_hidden = False


KEEP = [0, 1, 2, 4, 5, 7, 8, 10, 11, 13, 15]  # a reduced draft vocabulary: 11 of the 16 target ids


@pytest.mark.parametrize("plan", ["fixed", "stop"])
def test_reduced_vocabulary_drafts_target_ids_losslessly(target, plan):
    drafter = drafter_for(target, 3, draft_vocab=KEEP)
    assert drafter.d2t.tolist() == KEEP and drafter.exit_head.lm_head.weight.shape[0] == len(KEEP)
    # the head's rows start as the target head's rows at the draft ids (head_init: target)
    assert torch.equal(drafter.exit_head.lm_head.weight, target.model.lm_head.weight[KEEP])
    rule = ScriptedStop([1, 4, 2, 6, 3])
    accepted, rounds = check_lossless(target, drafter, plan=StoppableChain(6, rule) if plan == "stop" else None,
                                      k=None if plan == "stop" else 3)
    assert accepted > rounds // 2  # drafts are accepted: the mapped ids are the target's own ids
    if plan == "stop":
        assert {t for _, t, _ in rule.steps} <= set(KEEP) and rule.steps  # the rule is told target ids
        assert all(h.shape == (target.model.config.hidden_size,) for _, _, h in rule.steps)


def test_reduced_vocabulary_greedy_draft_is_the_mapped_argmax(target):
    drafter = drafter_for(target, 2, draft_vocab=KEEP)
    seq = PROMPTS[2]
    drafter.paired_target(target).prefill(seq)
    drafter.reset()
    tokens = drafter.draft(seq, (1, 1, 1, 1), _greedy(), torch.Generator()).tokens
    with torch.no_grad():  # the same chain without caches: argmax over the 11 head rows, mapped by KEEP
        expect = []
        for _ in range(4):
            hidden, pos, rope, mask = Trunk(split_target(target.model), 2)(torch.tensor([seq + expect]))
            logits_1TN, _ = drafter.exit_head(hidden, pos, rope, mask)
            expect.append(KEEP[int(logits_1TN[0, -1].argmax())])
    assert tokens == expect and set(tokens) <= set(KEEP)


def test_reduced_vocabulary_q_is_zero_outside_the_map_and_trees_are_still_refused(target):
    from draftforge.decode.sampling import SamplingParams

    drafter = drafter_for(target, 3, draft_vocab=KEEP)
    seq = PROMPTS[1]
    drafter.paired_target(target).prefill(seq)
    drafter.reset()
    tree = drafter.draft(seq, (1, 1, 1), SamplingParams(temperature=1.0), torch.Generator().manual_seed(1))
    assert tree.q_probs.shape == (4, VOCAB)  # rows over the target's vocabulary (the last, a leaf's, is zero)
    outside = [t for t in range(VOCAB) if t not in KEEP]
    assert (tree.q_probs[:, outside] == 0).all()
    torch.testing.assert_close(tree.q_probs[:3].sum(-1), torch.ones(3, dtype=tree.q_probs.dtype))
    assert set(tree.tokens) <= set(KEEP)
    with pytest.raises(DraftforgeError, match="chains"):
        build_decoder("tree", target, drafter, tree=(2, 1)).generate(PROMPTS[1], max_new_tokens=5)


def test_cali_ts_with_a_theta_predictor_drives_a_reduced_exit_head(target, tmp_path):
    """Cali-TS's θ reads the exit state hidden_D (not the head): lossless, lengths vary, θ saw [D] states."""
    from tests.decode.test_length_control import predictor_for

    drafter = drafter_for(target, 3, draft_vocab=KEEP)
    dec = build_decoder("cali_ts", target, drafter, max_draft=6,
                        theta_predictor=predictor_for(target, drafter, tmp_path))
    ctl, seen = dec.controller, []
    original = ctl.theta_model
    ctl.theta_model = lambda step: seen.append(step.hidden_D) or original(step)
    lengths = set()
    for prompt in PROMPTS:
        res = dec.generate(prompt, max_new_tokens=20)
        assert res.tokens == reference(target, prompt, 20)
        lengths |= set(res.stats.drafted_per_round)
    assert len(lengths) > 1 and seen and all(h.shape == (target.model.config.hidden_size,) for h in seen)


@pytest.mark.slow
def test_reduced_vocabulary_sampling_follows_the_target():
    from tests.decode.test_sampling import VOCAB as V8
    from tests.decode.test_sampling import assert_two_tokens_follow_target

    small = load_target(tiny_llama(vocab=V8, hidden=16, layers=2, dtype=torch.float64))
    drafter = drafter_for(small, 1, draft_vocab=[0, 1, 3, 4, 6])
    assert_two_tokens_follow_target(build_decoder("eesd", small, drafter, chain_length=2), small, [1, 2, 3])


def test_a_map_outside_the_target_vocabulary_is_refused(target):
    head = ExitHead.from_target(split_target(target.model), 2, draft_vocab=[0, 3, 5])
    head.config.draft_vocab = [0, 3, VOCAB + 2]  # a map made for a larger target
    with pytest.raises(CompatibilityError, match="outside the target's vocabulary"):
        EarlyExitDrafter(head, 2, target.vocab_size)


def _cache_free_chain(target, drafter, seq, k):
    """Greedy drafts of the exit head recomputed with no cache at all: the trunk and exit layer over the whole text."""
    parts, out = split_target(target.model), []
    with torch.no_grad():
        for _ in range(k):
            h, pos, rope, mask = Trunk(parts, drafter.n)(torch.tensor([seq + out]))
            logits, _ = drafter.exit_head(h, pos, rope, mask)
            out.append(int(logits[0, -1].argmax()))
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("n", [1, LAYERS - 1])
def test_every_round_drafts_what_a_cache_free_recomputation_drafts(n, dtype, monkeypatch):
    """Greedy output stays lossless when the exit layer's cache keeps a rejected draft (it only costs acceptance),
    so every round's chain is checked against the exit head run over the whole text with no cache, across rounds
    that reject. The head's layer is perturbed, so that even at N = L - 1 (where an untrained copy of the last layer
    is the target itself) drafts get rejected; fp32 as well as fp64."""
    target = load_target(tiny_llama(vocab=VOCAB, layers=LAYERS, dtype=dtype))
    drafter = drafter_for(target, n)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in drafter.exit_head.parameters():
            p.add_(0.3 * p.std() * torch.randn_like(p))
    chains, draft = [], drafter.draft_levels

    def recorded(seq, shape, params, generator, stop=None):
        tree = draft(seq, shape, params, generator, stop)
        chains.append((list(seq), tree.tokens))
        return tree

    monkeypatch.setattr(drafter, "draft_levels", recorded)
    dec = build_decoder("eesd", target, drafter, chain_length=3)
    rejected = 0
    for prompt in PROMPTS:
        res = dec.generate(prompt, max_new_tokens=20)
        assert res.tokens == greedy_reference(target, prompt, 20)
        rejected += sum(a < d for a, d in zip(res.stats.accepted_per_round, res.stats.drafted_per_round))
    assert rejected >= 3 and len(chains) > 10
    for seq, tokens in chains:
        assert tokens == _cache_free_chain(target, drafter, seq, len(tokens)), len(seq)

