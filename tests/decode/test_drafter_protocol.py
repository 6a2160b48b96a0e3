"""The Drafter contract: capabilities are declared on the class and match what the class implements, and the
target a drafter is verified by is the one it was bound to at load time."""

from __future__ import annotations

from types import SimpleNamespace

import re

import pytest
import torch

import draftforge.decode  # noqa: F401  (imports every drafter module)
from draftforge.decode import build_decoder, load_drafter, load_target
from draftforge.decode.drafters.base import Drafter
from draftforge.decode.dynamic import draft_dynamic
from draftforge.decode.sampling import SamplingParams
from draftforge.decode.methods.eesd import EarlyExitDrafter
from draftforge.errors import DraftforgeError
from tests.fixtures.decode import tiny_llama, tiny_mamba2

NODE_METHODS = ("begin", "feed", "accept_nodes")


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_declared_capabilities_match_what_each_drafter_implements():
    drafters = [c for c in _subclasses(Drafter) if c.__module__.startswith("draftforge.")]
    assert {c.__name__ for c in drafters} >= {"MambaDrafter", "TransformerDrafter", "PromptLookupDrafter",
                                              "EarlyExitDrafter"}
    for cls in drafters:
        implemented = [getattr(cls, m) is not getattr(Drafter, m) for m in NODE_METHODS]
        assert all(implemented) == cls.follows_dynamic_trees, cls.__name__
        assert any(implemented) == all(implemented), f"{cls.__name__} implements part of the node interface"


class Plain(Drafter):
    """Static trees and chains only: no capability declared."""

    kind = "plain"

    def reset(self):
        pass

    def draft_levels(self, seq, shape, params, generator, stop=None):
        raise NotImplementedError

    def accept_levels(self, path):
        pass


def test_a_drafter_without_node_feeding_is_refused_by_a_dynamic_tree_with_its_name():
    plan = SimpleNamespace(builder=SimpleNamespace(sampling_ok=True), max_depth=3)
    with pytest.raises(DraftforgeError, match="the plain drafter cannot follow a dynamic tree builder"):
        draft_dynamic(Plain(), [1, 2, 3], plan, SamplingParams(0.0), None)
    with pytest.raises(NotImplementedError, match="plain drafter does not follow dynamic trees"):
        Plain().feed([-1], [5], [0])


def test_a_drafter_is_verified_by_the_target_it_was_loaded_for():
    target = load_target(tiny_llama(seed=1))
    other = load_target(tiny_llama(seed=2))
    drafter = load_drafter(tiny_mamba2(seed=3), target)
    assert build_decoder("chain", target, drafter).target is target
    with pytest.raises(DraftforgeError, match="loaded for another target model"):
        build_decoder("chain", other, drafter)


def test_reading_the_targets_hidden_states_is_declared_and_bind_asks_for_them():
    class Reader(Plain):
        kind = "reader"
        reads_target_hidden = True

    target = load_target(tiny_llama(seed=1))
    assert not target.want_hidden
    Reader().bind(target)
    assert target.want_hidden
    assert not EarlyExitDrafter.reads_target_hidden  # shares the target's layers instead


@pytest.mark.parametrize("parents, depths, message", [
    ([1, -1], [2, 1], "draft tree node 0 has parent 1: a node's parent must come before it"),
    ([-1, 1], [1, 2], "draft tree node 1 has parent 1"),
    ([-1, -2], [1, 1], "draft tree node 1 has parent -2"),
    ([-1], [1, 2], "1 tokens, 1 parents, 2 depths"),
])
def test_a_draft_tree_out_of_order_is_refused_in_the_drafters_own_node_numbers(parents, depths, message):
    # a hybrid target's packing refused it naming the node one higher (its rows count the root)
    from draftforge.decode.tree import DraftTree
    from draftforge.errors import DraftforgeError

    with pytest.raises(DraftforgeError, match=re.escape(message)):
        DraftTree([5] * len(parents), parents, depths)


def test_a_drafter_shorter_than_the_decode_is_refused_or_named_and_a_capped_decode_says_so():
    """A GPT-2 drafter (learned positions) loaded against a longer target died mid-decode with torch's IndexError
    once the context passed its table; a RoPE drafter past its max_position_embeddings ran silently; a decode cut
    at the target's context returned fewer tokens with nothing said. Oracle: the target's own generate()."""
    import warnings

    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.fixtures.decode import greedy_reference, tiny_llama

    target = load_target(tiny_llama(vocab=64, ctx=256))
    prompt = [int(t) for t in torch.randint(1, 64, (60,), generator=torch.Generator().manual_seed(0))]
    torch.manual_seed(0)
    gpt2 = load_drafter(GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64)),
                        target)
    dec = build_decoder("chain", target, gpt2)
    assert dec.generate(prompt[:40], max_new_tokens=8).tokens == greedy_reference(target, prompt[:40], 8)  # fits
    with pytest.raises(DraftforgeError, match="learned position embeddings for 64 positions, and this decode may "
                                              r"reach 72 \(prompt \+ max_new_tokens\)"):
        dec.generate(prompt, max_new_tokens=12)
    from draftforge.decode.drafters.lookup import PromptLookupDrafter
    from draftforge.decode.drafters.lookup_first import LookupFirstDrafter

    wrapped = build_decoder("chain", target, LookupFirstDrafter(PromptLookupDrafter(64), gpt2))
    with pytest.raises(DraftforgeError, match="learned position embeddings for 64 positions"):  # its drafter's limit
        wrapped.generate(prompt, max_new_tokens=12)
    rope = load_drafter(tiny_llama(vocab=64, seed=3, ctx=32), target)
    dec = build_decoder("chain", target, rope)
    with pytest.warns(UserWarning, match="the drafter's context is 32 positions .* may reach 72"):
        got = dec.generate(prompt, max_new_tokens=12).tokens
    assert got == greedy_reference(target, prompt, 12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per drafter, not on every prompt of an eval
        dec.generate(prompt, max_new_tokens=12)
    with pytest.warns(UserWarning, match="stops at the target's context of 256 tokens: 6 new tokens instead of 20"):
        long = dec.generate(prompt * 4 + prompt[:10], max_new_tokens=20)
    assert long.tokens == greedy_reference(target, prompt * 4 + prompt[:10], 6)
