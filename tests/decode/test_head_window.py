"""The EAGLE-3 head's window (`head_window`): the head attends to the last W committed tokens only.

Oracles: the root a windowed drafter drafts from, recomputed by a fresh head step over exactly the last W anchors
of the whole feature history (what a sliding window means); greedy decoding against the target's `generate()`;
a window longer than the context against no window."""

from __future__ import annotations

import pytest
import torch

from draftforge.decode import build_decoder, load_drafter
from draftforge.errors import DraftforgeError, RecipeError
from tests.fixtures.decode import eagle3_head, feature_mamba_head, greedy_reference

VOCAB = 12
PROMPT = [(7 * i + 3) % VOCAB for i in range(30)]
# c2t is eagle2 with a classifier pruning its trees: the window acts on the same drafter calls
METHODS = [("chain", {"chain_length": 3}), ("tree", {"tree": (VOCAB, 2, 1)}), ("eagle2", {})]


def windowed(target, window):
    return load_drafter(eagle3_head(target.model, noise=0.05), target, head_window=window)


def record_roots(drafter, target):
    """Wrap the drafter so that every sync checks its root against a fresh head over the last W anchors; returns
    the list of (anchors, cache rows) seen at each sync."""
    history, seen = [], []
    take, sync = target.take_features, drafter._sync

    def take_features():
        rows = take()
        if rows is not None:
            history.append(rows.clone())
        return rows

    def checked_sync(seq):
        if drafter.anchors == 0:  # a new prompt (each generate() resets the drafter)
            history.clear()
        ok = sync(seq)
        if ok:
            head, w = drafter.model, drafter.window
            features = torch.cat(history)  # one row per anchor: anchor t reads position t and token t + 1
            tokens, positions = torch.tensor(seq[1:]), torch.arange(1, len(seq))
            assert len(features) == len(tokens)
            cache = head.new_cache()
            with torch.inference_mode():
                out = head.step(tokens[-w:], head.fuse(features[-w:]), positions[-w:], cache, None)[-1]
                want = head.logits(out)[None].float()
            torch.testing.assert_close(drafter.root_logits, want, rtol=0, atol=1e-9)
            seen.append((drafter.anchors, drafter.cache.length))
        return ok

    target.take_features, drafter._sync = take_features, checked_sync
    return seen


@pytest.mark.parametrize("window", [1, 5, 8])
def test_the_root_attends_to_exactly_the_last_w_anchors_and_the_cache_holds_w_rows(target, window):
    drafter = windowed(target, window)
    seen = record_roots(drafter, target)
    try:
        for method, options in METHODS[:2]:  # the tree's first level holds every token: it always accepts one
            res = build_decoder(method, target, drafter, **options).generate(PROMPT, max_new_tokens=16)
            assert res.tokens == greedy_reference(target, PROMPT, 16), method
        assert sum(res.stats.accepted_per_round) > 0  # so its rounds fed the drafter 2+ anchors at once
    finally:
        del target.take_features  # the instance attribute: back to the class's method
    assert seen and all(rows == min(anchors, window) for anchors, rows in seen)
    assert max(anchors for anchors, _ in seen) > 3 * window  # the window slid well past the prompt


@pytest.mark.parametrize("method,options", METHODS, ids=[m for m, _ in METHODS])
def test_a_windowed_head_decodes_what_generate_does(target, method, options):
    dec = build_decoder(method, target, windowed(target, 6), **options)
    for prompt in ([4], [3, 5, 7], PROMPT):
        for max_new in (1, 13):
            assert dec.generate(prompt, max_new_tokens=max_new).tokens == greedy_reference(target, prompt, max_new)


def test_a_window_longer_than_the_context_drafts_as_no_window(target):
    trees = {}
    for window in (None, 10_000):
        drafter = windowed(target, window)
        drafted = []
        draft = drafter.draft

        def logged(seq, plan, params, generator, draft=draft, drafted=drafted):
            tree = draft(seq, plan, params, generator)
            drafted.append((list(tree.tokens), drafter.root_logits.clone()))
            return tree

        drafter.draft = logged
        build_decoder("tree", target, drafter, tree=(3, 2, 1)).generate(PROMPT, max_new_tokens=12)
        trees[window] = drafted
    assert len(trees[None]) == len(trees[10_000]) > 1
    for (tokens_a, root_a), (tokens_b, root_b) in zip(trees[None], trees[10_000]):
        assert tokens_a == tokens_b
        assert torch.equal(root_a, root_b)


@pytest.mark.parametrize("window", [0, -3, True, 2.5, "8"])
def test_a_window_that_is_not_a_count_of_tokens_is_refused(target, window):
    with pytest.raises(DraftforgeError, match="window"):
        windowed(target, window)


def test_a_window_for_a_drafter_that_is_not_an_attention_head_is_refused(target):
    with pytest.raises(RecipeError, match="feature Mamba2 drafter.*same size at any context"):
        load_drafter(feature_mamba_head(target.model), target, head_window=8)
    with pytest.raises(RecipeError, match="EAGLE-3 head.*lookup drafter"):
        load_drafter("prompt-lookup", target, head_window=8)


def test_eval_refuses_a_window_without_a_head_before_loading_anything():
    from draftforge.eval.config import EvalConfig, validate

    for drafter, window, match in ((None, 8, "EAGLE-3 head, not to no drafter"),
                                   ("prompt-lookup", 8, "not to prompt-lookup"), ("d", 0, ">= 1")):
        cfg = EvalConfig(target="t", bench="humaneval", drafter=drafter, head_window=window, methods=("ar",))
        with pytest.raises(RecipeError, match=match):
            validate(cfg)


@pytest.mark.parametrize("meta, match", [({"task": "sft"}, "is a 'sft' export"),
                                         ({"task": "eagle3", "head": {"body": "mamba2"}}, "feature Mamba2 drafter")])
def test_eval_refuses_a_window_for_an_export_that_is_not_an_attention_head_before_loading(tmp_path, meta, match):
    import json

    from draftforge.eval.config import EvalConfig, check_paths, validate

    drafter = tmp_path / "export"
    drafter.mkdir()
    (drafter / "draftforge.json").write_text(json.dumps(meta))
    cfg = validate(EvalConfig(target=str(tmp_path), bench="humaneval", drafter=str(drafter), head_window=8,
                              methods=("ar",), out_dir=str(tmp_path / "out")))
    with pytest.raises(RecipeError, match=match):
        check_paths(cfg)
    (drafter / "draftforge.json").write_text(json.dumps({"task": "eagle3", "head": {"body": "attention"}}))
    check_paths(cfg)  # an attention head passes: the loader checks the rest


def test_a_windowed_head_fuses_and_encodes_only_the_last_w_anchors_of_a_long_prompt(target):
    drafter = windowed(target, 4)
    fused, stepped = [], []
    fuse, step = drafter.model.fuse, drafter.model.step
    drafter.model.fuse = lambda features: fused.append(len(features)) or fuse(features)
    drafter.model.step = lambda tokens, *rest: stepped.append(len(tokens)) or step(tokens, *rest)
    try:
        build_decoder("chain", target, drafter, chain_length=2).generate(PROMPT, max_new_tokens=6)
    finally:
        del drafter.model.fuse, drafter.model.step
    assert fused[0] == stepped[0] == 4  # the 29-anchor prompt: its last 4 rows only
    assert max(fused) <= 4 and max(stepped) <= 4
