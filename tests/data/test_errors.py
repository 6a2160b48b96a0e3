"""Bad input: each case gets one DataError that says what to fix (or a counted skip + warning)."""

import pytest

from draftforge.data import build_block_data
from draftforge.errors import DataError, DraftforgeError
from tests.data.common import data_cfg, write_jsonl

GOOD_CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
NO_ASSISTANT = {"conversations": [{"from": "human", "value": "hi"}, {"from": "human", "value": "anyone?"}]}


def build(tok, sources, block_size=16, **kw):
    return build_block_data(data_cfg(sources, **kw), tok, block_size, seed=0)


def test_data_error_is_a_draftforge_error():
    assert issubclass(DataError, DraftforgeError)


def test_missing_path(tmp_path, tok):
    with pytest.raises(DataError, match="does not exist"):
        build(tok, [tmp_path / "nope.jsonl"])


def test_glob_matching_nothing_and_empty_folder(tmp_path, tok):
    with pytest.raises(DataError, match="matches no files"):
        build(tok, [str(tmp_path / "*.jsonl")])
    with pytest.raises(DataError, match="no files matching"):
        build(tok, [tmp_path], file_glob="**/*.py")


def test_unknown_format(tmp_path, tok):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}])
    with pytest.raises(DataError, match="unknown data.format 'markdown'"):
        build(tok, [src], format="markdown")


def test_empty_dataset(tmp_path, tok):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no rows"):
        build(tok, [tmp_path / "empty.jsonl"])


def test_malformed_jsonl_names_file_and_line(tmp_path, tok):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "ok too"}\n{"text": broken\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:3: malformed JSON"):
        build(tok, [path])


def test_rows_missing_text_field_are_skipped_and_counted(tmp_path, tok, caplog):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "hello"}, {"body": "x"}, {"text": None}, {"text": "world"}])
    bd = build(tok, [src])
    assert bd.stats["rows_read"] == 4 and bd.stats["rows_skipped"] == 2 and bd.stats["documents"] == 2
    assert bd.stats["skip_reasons"] == {"missing text field 'text'": 2}
    assert "skipped 2 of 4 data rows" in caplog.text


def test_all_rows_missing_text_field_fails(tmp_path, tok):
    src = write_jsonl(tmp_path / "a.jsonl", [{"body": "x"}, {"body": "y"}])
    with pytest.raises(DataError, match=r"no usable rows.*all 2 rows skipped.*set data.text_field"):
        build(tok, [src])


def test_conversation_without_assistant_is_skipped_and_counted(tmp_path, tok, caplog):
    src = write_jsonl(tmp_path / "c.jsonl", [GOOD_CHAT, NO_ASSISTANT, {"text": "not a chat"}])
    bd = build(tok, [src], block_size=64, format="chat")
    assert bd.stats["rows_skipped"] == 2 and bd.stats["documents"] == 1
    assert bd.stats["skip_reasons"]["no assistant turn"] == 1
    assert "no assistant turn" in caplog.text


def test_all_conversations_without_assistant_fails(tmp_path, tok):
    src = write_jsonl(tmp_path / "c.jsonl", [NO_ASSISTANT, NO_ASSISTANT])
    with pytest.raises(DataError, match=r"no usable rows.*2 x no assistant turn"):
        build(tok, [src], format="chat")


def test_missing_split_of_hf_dataset(tmp_path, tok):
    (tmp_path / "ds").mkdir()
    write_jsonl(tmp_path / "ds" / "train.jsonl", [{"text": "hello"}])
    with pytest.raises(DataError, match="could not load Hugging Face dataset.*split 'validation'"):
        build(tok, [f"hf:{tmp_path / 'ds'}"], split="validation")


def test_tokenizer_without_eos_and_bad_block_size(tmp_path, make_tokenizer):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "hello"}])
    tok = make_tokenizer()
    with pytest.raises(DataError, match="block_size"):
        build_block_data(data_cfg([src]), tok, 1, seed=0)
    tok.eos_token = None
    with pytest.raises(DataError, match="no eos_token"):
        build_block_data(data_cfg([src]), tok, 16, seed=0)


def test_empty_hf_split(monkeypatch, tok):
    import datasets

    import draftforge.data.sources as sources

    empty = datasets.Dataset.from_dict({"text": []}, features=datasets.Features({"text": datasets.Value("string")}))
    monkeypatch.setattr(sources.datasets, "load_dataset", lambda *a, **k: empty)
    with pytest.raises(DataError, match=r"split 'test'\) have no rows"):
        build(tok, ["org/empty"], split="test")


def test_malformed_json_file(tmp_path, tok):
    (tmp_path / "rows.json").write_text('[{"text": "a"},\n {"text": }]')
    with pytest.raises(DataError, match=r"rows\.json:2: malformed JSON"):
        build(tok, [tmp_path / "rows.json"])
    (tmp_path / "obj.json").write_text('{"text": "a"}')
    with pytest.raises(DataError, match="must hold a list"):
        build(tok, [tmp_path / "obj.json"])


@pytest.mark.parametrize("content", ["", "  \n\n"], ids=["empty", "whitespace"])
def test_empty_txt_file_says_it_has_no_text_not_text_field(tmp_path, tok, content):
    (tmp_path / "empty.txt").write_text(content)
    with pytest.raises(DataError, match="empty text.*hold no text") as err:
        build(tok, [tmp_path / "empty.txt"])
    assert "text_field" not in str(err.value)
