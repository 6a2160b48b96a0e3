"""Offline testbed: deterministic disjoint split, tokenizer training and caching, reproducible prompts."""

import ast
import json
import platform
import textwrap
from pathlib import Path

import pytest

from draftforge import testbed
from draftforge.export import tokenizer_fingerprint


@pytest.fixture(scope="module")
def splits():
    return {split: testbed.corpus_files(split) for split in ("train", "heldout", "all")}


def test_split_is_a_fixed_function_of_the_relative_path():
    # Pinned values: sha256 of the POSIX relative path, so any machine agrees on them.
    assert [testbed.split_of(p) for p in ("_py_abc.py", "collections/abc.py", "os.py", "json/__init__.py")] == [
        "heldout", "heldout", "train", "train"]


def test_split_deterministic_and_disjoint(splits):
    root = testbed.stdlib_root()
    train = [p.relative_to(root).as_posix() for p in splits["train"]]
    heldout = [p.relative_to(root).as_posix() for p in splits["heldout"]]
    assert train == sorted(train) and heldout == sorted(heldout)
    assert not set(train) & set(heldout)
    assert set(train) | set(heldout) == {p.relative_to(root).as_posix() for p in splits["all"]}
    assert 0.05 < len(heldout) / len(splits["all"]) < 0.15
    assert testbed.corpus_files("heldout") == splits["heldout"]
    assert testbed.corpus_files("train", max_files=3) == splits["train"][:3]


def test_corpus_skips_tests_site_packages_and_big_files(splits):
    root = testbed.stdlib_root()
    for path in splits["all"]:
        parts = path.relative_to(root).parts[:-1]
        assert not {"site-packages", "test", "tests", "idle_test"} & set(parts), path
        assert path.suffix == ".py" and path.stat().st_size <= testbed.MAX_FILE_BYTES
    with pytest.raises(testbed.DataError, match="split"):
        testbed.corpus_files("validation")


def test_tokenizer_trains_on_subset_and_is_cached(tmp_path):
    tok = testbed.train_tokenizer(tmp_path / "tok", vocab_size=320, max_files=5)
    assert len(tok) == 320
    assert [tok.pad_token, tok.bos_token, tok.eos_token] == ["<|pad|>", "<|bos|>", "<|eos|>"]
    assert tok.convert_tokens_to_ids(["<|pad|>", "<|bos|>", "<|eos|>"]) == [0, 1, 2]
    text = "def héllo(x):\n\t return x  # ünïcode ✓\n"
    assert tok.decode(tok(text).input_ids) == text  # byte-level: lossless on any text
    assert tok(text).input_ids[0] != tok.bos_token_id  # no specials added; packing adds EOS itself

    stamp = (tmp_path / "tok" / "tokenizer.json").stat().st_mtime_ns
    again = testbed.train_tokenizer(tmp_path / "tok", vocab_size=320, max_files=5)
    assert (tmp_path / "tok" / "tokenizer.json").stat().st_mtime_ns == stamp  # reused, not retrained
    assert tokenizer_fingerprint(again) == tokenizer_fingerprint(tok)
    fresh = testbed.train_tokenizer(tmp_path / "fresh", vocab_size=320, max_files=5)
    assert tokenizer_fingerprint(fresh) == tokenizer_fingerprint(tok)  # training is deterministic
    bigger = testbed.train_tokenizer(tmp_path / "tok", vocab_size=330, max_files=5)
    assert len(bigger) == 330  # different settings: retrained in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "tok"]  # no temp dirs left behind
    with pytest.raises(testbed.RecipeError, match="vocab_size"):
        testbed.train_tokenizer(tmp_path / "tiny", vocab_size=200, max_files=2)


def test_chat_template_is_plain_concatenation(tmp_path):
    tok = testbed.train_tokenizer(tmp_path / "tok", vocab_size=300, max_files=3)
    messages = [{"role": "user", "content": "def add(a, b):\n    "}, {"role": "assistant", "content": "return a + b"}]
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert tok.decode(out["input_ids"]) == "def add(a, b):\n    return a + b"
    masked = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert masked and tok.decode(masked).endswith("return a + b")
    assert out["assistant_masks"][0] == 0


def test_committed_prompts_come_from_heldout_defs():
    rows = [json.loads(line) for line in testbed.PROMPTS_FILE.read_text().splitlines()]
    assert len(rows) == 100 and len({r["prompt"] for r in rows}) == 100
    root = testbed.stdlib_root()
    verbatim = 0
    for row in rows:
        assert testbed.split_of(row["source"]) == "heldout"
        assert testbed.PROMPT_MIN_CHARS <= len(row["prompt"]) <= testbed.PROMPT_MAX_CHARS
        # A def/class header plus its docstring, cut where the body's next statement starts.
        node = ast.parse(textwrap.dedent(row["prompt"] + "pass")).body[0]
        assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        assert ast.get_docstring(node) and isinstance(node.body[-1], ast.Pass)
        source = root / row["source"]
        if source.is_file():  # the prompt is verbatim file text, not a rewrite
            assert row["prompt"] in source.read_text(encoding="utf-8", errors="replace")
            verbatim += 1
    if platform.python_version() == testbed.PROMPTS_PYTHON_VERSION:  # the stdlib they were cut from: every file
        assert verbatim == len(rows)


@pytest.mark.skipif(platform.python_version() != testbed.PROMPTS_PYTHON_VERSION,
                    reason="the committed prompts were cut from another Python's stdlib")
def test_prompts_file_reproduces_exactly(tmp_path):
    path = testbed.write_heldout_prompts(tmp_path / "prompts.jsonl", n=100)
    assert path.read_bytes() == testbed.PROMPTS_FILE.read_bytes()


def test_paths_and_ensure_testbed(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTFORGE_TESTBED", str(tmp_path / "tb"))
    assert testbed.testbed_dir() == tmp_path / "tb"
    monkeypatch.delenv("DRAFTFORGE_TESTBED")
    assert testbed.testbed_dir() == Path.home() / ".cache" / "draftforge" / "testbed"

    paths = testbed.ensure_testbed(tmp_path / "tb", vocab_size=300, max_files=3)
    assert paths.tokenizer.joinpath("tokenizer.json").is_file() and paths.prompts == testbed.PROMPTS_FILE
    rows = [json.loads(line) for line in paths.corpus_train.read_text().splitlines()]
    root = testbed.stdlib_root()
    assert [r["source"] for r in rows] == [p.relative_to(root).as_posix() for p in testbed.corpus_files("train")[:3]]
    assert rows[0]["text"] == (root / rows[0]["source"]).read_text(encoding="utf-8", errors="replace")
    assert len(paths.corpus_heldout.read_text().splitlines()) == 3
    testbed.ensure_testbed(tmp_path / "tb", vocab_size=300, max_files=4)  # other settings: corpus rewritten
    assert len(paths.corpus_train.read_text().splitlines()) == 4


def test_a_testbed_directory_holding_a_users_files_is_refused_and_left_as_it_was(tmp_path):
    # `demo --testbed DIR` replaced a user's corpus_train.jsonl there with the stdlib corpus, silently
    from draftforge.errors import DataError

    root = tmp_path / "mine"
    root.mkdir()
    (root / "corpus_train.jsonl").write_text("mine\n")
    with pytest.raises(DataError, match="holds corpus_train.jsonl, which no draftforge testbed wrote"):
        testbed.ensure_testbed(root, max_files=2)
    assert sorted(p.name for p in root.iterdir()) == ["corpus_train.jsonl"]
    assert (root / "corpus_train.jsonl").read_text() == "mine\n"
    ours = tmp_path / "ours"  # a testbed killed half-built: its marker says it is a testbed's, so it is rebuilt
    ours.mkdir()
    (ours / testbed.TESTBED_MARKER).write_text("")
    (ours / "corpus_train.jsonl").write_text("half\n")
    testbed._claim(ours)
