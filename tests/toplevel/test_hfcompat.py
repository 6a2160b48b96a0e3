"""draftforge.hfcompat: the cache argument's name read from a forward's signature, as transformers releases
before and after 5.24 spell it, and refused loudly where a signature has none (a replaced forward would otherwise
run from an empty state)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from draftforge.errors import CompatibilityError
from draftforge.hfcompat import cache_kwargs, cache_param, output_cache, passed_cache


def _renamed(fn):
    """What transformers' deprecate_kwarg does: a wrapper whose signature is the wrapped function's."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


class New(torch.nn.Module):  # transformers >= 5.24
    @_renamed
    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        return cache


class OldMixer(torch.nn.Module):  # Mamba2Mixer before 5.24
    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        return cache_params


class OldLlama(torch.nn.Module):  # a Transformer's forward before 5.24
    def forward(self, input_ids, past_key_values=None, **kwargs):
        return past_key_values


class NoCache(torch.nn.Module):
    def forward(self, hidden_states, **kwargs):
        return None


@pytest.mark.parametrize("module, name", [(New(), "cache"), (OldMixer(), "cache_params"),
                                          (OldLlama(), "past_key_values")])
def test_the_name_comes_from_the_signature_and_the_call_reaches_the_cache(module, name):
    sentinel = object()
    assert cache_param(module) == name
    assert module(torch.zeros(1), **cache_kwargs(module, sentinel)) is sentinel


def test_an_instance_override_does_not_hide_the_class_signature():
    mixer = OldMixer()
    mixer.forward = lambda hidden_states, **kwargs: None  # what the tree forward does for one call
    assert cache_param(mixer) == "cache_params"


def test_a_signature_without_a_cache_is_refused_by_name():
    with pytest.raises(CompatibilityError, match=r"NoCache\.forward takes none of the cache arguments"):
        cache_param(NoCache())


def test_a_cache_passed_under_another_name_is_refused_not_read_as_none():
    assert passed_cache({"cache": 1}, "cache") == 1 and passed_cache({}, "cache") is None
    with pytest.raises(CompatibilityError, match="called with 'cache_params' where its signature names 'cache'"):
        passed_cache({"cache_params": 1}, "cache")


def test_output_cache_reads_either_field():
    assert output_cache(SimpleNamespace(cache=1)) == 1
    assert output_cache(SimpleNamespace(past_key_values=2)) == 2
    assert output_cache(SimpleNamespace(cache_params=3, cache=None)) == 3
    assert output_cache(SimpleNamespace(logits=0)) is None


def test_the_installed_transformers_mixers_name_a_cache():
    """The forwards draftforge replaces or calls with a cache: each names one in the installed version."""
    from transformers.models.bamba.modeling_bamba import BambaMixer
    from transformers.models.mamba2.modeling_mamba2 import Mamba2ForCausalLM, Mamba2Mixer

    for cls in (Mamba2Mixer, BambaMixer, Mamba2ForCausalLM):
        assert cache_param(cls.forward) in ("cache", "cache_params", "past_key_values")
