"""`draftforge target longctx` never replaces a file: an existing --out is refused before any model loads."""

from __future__ import annotations

import pytest

from draftforge.cli_target import LongctxJob, run_longctx
from draftforge.errors import DataError, RecipeError


def test_an_existing_out_file_is_refused_and_kept(tmp_path):
    taken = tmp_path / "q.jsonl"
    taken.write_text("mine\n")
    with pytest.raises(DataError, match="exists; this command writes a new file and never replaces one"):
        run_longctx(LongctxJob(target=str(tmp_path / "no-model"), out=str(taken)))
    assert taken.read_text() == "mine\n"


def test_bad_settings_name_their_flag():
    with pytest.raises(RecipeError, match="--per-bucket must be >= 1"):
        LongctxJob(target="t", out="o", per_bucket=0)


def test_a_bad_target_a_length_too_short_to_ask_and_a_users_tmp_file(tmp_path):
    """A missing or tokenizer-less --target was a transformers traceback, a length whose cut documents keep no
    function to ask about was `ValueError: Sample larger than population`, and the write went through OUT.tmp, so a
    user's file of that name was replaced and then renamed away."""
    from tests.fixtures.decode import tiny_llama
    from tests.conftest import _data_tokenizer

    with pytest.raises(RecipeError, match="--target: directory .*no-model does not exist"):
        run_longctx(LongctxJob(target=str(tmp_path / "no-model"), out=str(tmp_path / "q.jsonl")))
    bare = tmp_path / "bare"
    tiny_llama(vocab=64, ctx=256).save_pretrained(bare)
    with pytest.raises(DataError, match="--target .*bare: cannot read its tokenizer and config"):
        run_longctx(LongctxJob(target=str(bare), out=str(tmp_path / "q.jsonl")))
    small = tmp_path / "small"
    tok = _data_tokenizer()
    tiny_llama(vocab=len(tok), ctx=256).save_pretrained(small)
    tok.save_pretrained(small)
    with pytest.raises(DataError, match="cannot fit the asked documents and the question under"):
        run_longctx(LongctxJob(target=str(small), out=str(tmp_path / "q.jsonl"), lengths="256", max_new_tokens=16))
    assert not (tmp_path / "q.jsonl").exists()
    from draftforge.data.longctx import write_longctx

    mine = tmp_path / "r.jsonl.tmp"
    mine.write_text("notes\n")
    write_longctx(tmp_path / "r.jsonl", [])
    assert mine.read_text() == "notes\n" and (tmp_path / "r.jsonl").read_text() == ""
