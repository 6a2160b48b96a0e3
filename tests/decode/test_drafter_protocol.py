"""The Drafter contract: capabilities are declared on the class and match what the class implements, and the
target a drafter is verified by is the one it was bound to at load time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

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
