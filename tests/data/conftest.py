"""Fixtures of the data tests (the tokenizers `tok` and `make_tokenizer` are in tests/conftest.py)."""

from __future__ import annotations

import pytest

# a minimal chat template: <role>content lines, then <assistant> when a generation prompt is asked for
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture
def chat_tok(make_tokenizer):
    """The 400-token data tokenizer with TEMPLATE as its chat template."""
    return make_tokenizer(TEMPLATE)
