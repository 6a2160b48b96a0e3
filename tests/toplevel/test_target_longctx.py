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
