"""Instruction prompts built offline from the stdlib: disjoint by module, deterministic, all categories."""

import json
import sys
from collections import Counter

import pytest

from draftforge.data.instructions import (
    CATEGORIES, HELDOUT_FILE, build_instruction_prompts, is_heldout, stdlib_items, write_instruction_prompts,
)
from draftforge.errors import DataError
from draftforge.data.prompts import load_prompt_rows


def _tops(rows):
    return {r["module"].split(".")[0] for r in rows}


@pytest.fixture(scope="module")
def splits():
    return build_instruction_prompts("heldout"), build_instruction_prompts("train")


def test_heldout_and_train_share_no_module(splits):
    heldout, train = splits
    assert _tops(heldout) and _tops(train)
    assert not _tops(heldout) & _tops(train)
    assert all(is_heldout(r["module"]) for r in heldout) and not any(is_heldout(r["module"]) for r in train)
    texts = {r["messages"][0]["content"] for r in heldout}
    assert not texts & {r["messages"][0]["content"] for r in train}
    assert len(train) >= 2000  # "a few thousand" training prompts


def test_deterministic_and_balanced(splits):
    heldout, train = splits
    again = build_instruction_prompts("heldout", 80)
    assert again == build_instruction_prompts("heldout", 80)
    assert [r["prompt_id"] for r in again] == [f"heldout-{i:05d}" for i in range(80)]
    assert Counter(r["category"] for r in again) == {c: 20 for c in CATEGORIES}
    assert len(_tops(again)) >= 10  # spread over many modules, not one
    assert build_instruction_prompts("train", 50) == train[:50]
    assert build_instruction_prompts("train", 50, seed=1) != train[:50]
    assert set(Counter(r["category"] for r in train)) == set(CATEGORIES)


def test_prompts_read_like_instructions(splits):
    heldout, _ = splits
    for row in heldout:
        (message,) = row["messages"]
        assert message["role"] == "user" and "`" in message["content"] and len(message["content"]) < 400
    item = next(i for i in stdlib_items() if i.module == "textwrap" and i.name == "dedent")
    assert item.kind == "function" and item.args == "text"


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the committed file was cut from CPython 3.11's stdlib")
def test_committed_heldout_file_is_what_the_builder_makes():
    rows = [json.loads(line) for line in HELDOUT_FILE.read_text().splitlines()]
    assert rows == build_instruction_prompts("heldout", 80)


def test_instructions_bench_and_training_file(tmp_path):
    rows = load_prompt_rows("instructions")
    assert len(rows) == 80 and rows[0].messages and rows[0].prompt_id == "heldout-00000"
    assert {r.category for r in rows} == set(CATEGORIES)
    out = write_instruction_prompts(tmp_path / "train.jsonl", "train", 30)
    assert [r.prompt_id for r in load_prompt_rows(out)] == [f"train-{i:05d}" for i in range(30)]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    with pytest.raises(DataError, match="'heldout' or 'train'"):
        build_instruction_prompts("test")
    with pytest.raises(DataError, match="no heldout instruction prompts"):
        build_instruction_prompts("heldout", root=tmp_path)


def test_code_prompts_are_function_headers_split_by_module_and_not_humaneval(tmp_path):
    import ast

    from draftforge.data.instructions import build_code_prompts
    from draftforge.data.prompts import humaneval_entry_points

    heldout = build_code_prompts("heldout")
    train = build_code_prompts("train", exclude=humaneval_entry_points())
    assert len(train) >= 500 and heldout and not _tops(heldout) & _tops(train)
    # no prompt text in both splits: posixpath (train) and ntpath (held out) share 6 functions word for word
    assert not {r["prompt"] for r in heldout} & {r["prompt"] for r in build_code_prompts("train")}
    assert not {r["function"] for r in train} & humaneval_entry_points()
    assert "median" in {r["function"] for r in build_code_prompts("train")}  # statistics.median: what exclude drops
    for row in train[:50]:
        tree = ast.parse(row["prompt"] + "    pass\n")  # the header and docstring, ready for a body
        (fn,) = tree.body
        assert fn.name == row["function"] and ast.get_docstring(fn)
    assert build_code_prompts("train", 20, seed=1) == build_code_prompts("train", 20, seed=1)
    rows = load_prompt_rows(write_instruction_prompts(tmp_path / "c.jsonl", "train", 5, kind="code"))
    assert len(rows) == 5 and all(r.text and r.category == "code" for r in rows)  # raw text, no chat template
