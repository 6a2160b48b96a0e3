"""Shared helpers for the data tests (the tokenizer fixtures `tok` / `make_tokenizer` are in conftest.py)."""

import json

from draftforge.recipe import DataConfig


def data_cfg(sources, **overrides) -> DataConfig:
    """The real recipe DataConfig (an unknown field is a TypeError), with no held-out split unless asked.

    Not `.check()`ed: the data layer's own checks (e.g. an unknown format) are under test here.
    """
    return DataConfig(**{"sources": [str(s) for s in sources], "eval_fraction": 0.0, **overrides})


def write_jsonl(path, rows):
    """One line per row: a dict as JSON, a string as it is (a malformed line on purpose)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def token_stream(tok, docs):
    """Oracle: each document tokenized on its own, followed by EOS, all concatenated."""
    out = []
    for d in docs:
        out += tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return out
