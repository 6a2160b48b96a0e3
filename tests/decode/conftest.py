"""Fixtures of the decode tests: a float64 tiny Llama target and the three drafters bound to it, both at the
vocabulary size of the test module's `VOCAB`, built once per module."""

from __future__ import annotations

import pytest
import torch

from draftforge.decode import load_target
from tests.fixtures.decode import three_drafters, tiny_llama


@pytest.fixture(scope="module")
def target(request):
    return load_target(tiny_llama(vocab=request.module.VOCAB, dtype=torch.float64))


@pytest.fixture(scope="module")
def drafters(request, target):
    """A Transformer (noisy copy of the target), a Mamba and a Mamba2 drafter (tests.fixtures.decode.three_drafters)."""
    return three_drafters(target, request.module.VOCAB)
