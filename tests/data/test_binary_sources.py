"""Issue 35 item 3: binary data is refused in one line naming the file, a folder or glob skips its non-text
files with one notice, and text cut at the 8 KiB look is still text (data/textcheck.py has the rule)."""

import gzip
import json
import os
import random
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from draftforge.data import build_block_data
from draftforge.data.sources import load_sources
from draftforge.data.textcheck import SNIFF_BYTES, non_text_reason
from draftforge.errors import DataError
from tests.data.common import data_cfg, write_jsonl

PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x02\x00\x00\x00\x90wS\xde"
CODE = "def add(a, b):\n    return a + b\n"


def random_bytes(n=4096, seed=0) -> bytes:
    return random.Random(seed).randbytes(n)


def texts(cfg) -> list[str]:
    return load_sources(cfg)["text"]


def refused(cfg, name) -> str:
    """load_sources raises one DataError, one line, naming `name`; returns the message."""
    with pytest.raises(DataError) as e:
        load_sources(cfg)
    msg = str(e.value)
    assert name in msg and "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("name", ["noise.txt", "noise.bin"])
def test_random_bytes_as_a_file_source_are_refused_naming_the_file(tmp_path, name):
    (tmp_path / name).write_bytes(random_bytes())
    assert "not a text file" in refused(data_cfg([tmp_path / name]), name)


@pytest.mark.parametrize("content", [random_bytes(), PNG, b"\x00" * 100], ids=["random", "png", "nul"])
def test_a_binary_jsonl_is_refused_without_a_unicode_traceback(tmp_path, content):
    (tmp_path / "rows.jsonl").write_bytes(content)
    assert "not a text file" in refused(data_cfg([tmp_path / "rows.jsonl"]), "rows.jsonl")


@pytest.mark.parametrize("content, why", [
    (b"%PDF-1.7\n% plain ascii after the magic\n", "a PDF document"),
    (b"PK\x03\x04plain ascii", "a ZIP archive"),
    (gzip.compress(b"hello world\n"), "gzip data"),
    (b"PAR1plain ascii", "Parquet data"),
    (b"GIF89a plain", "a GIF image"),
    ("caf\u00e9 au lait".encode("utf-16"), "UTF-16"),
    ("caf\u00e9 au lait\n".encode("latin-1"), "not UTF-8: byte 0xe9 at byte 3"),
], ids=["pdf", "zip", "gzip", "parquet", "gif", "utf16", "latin1"])
def test_the_rule_signatures_then_nul_then_utf8(tmp_path, content, why):
    f = tmp_path / "doc.txt"
    f.write_bytes(content)
    assert why in non_text_reason(f)
    assert why in refused(data_cfg([f]), "doc.txt")


def test_a_character_cut_by_the_8kib_look_is_text_and_one_cut_by_the_end_is_not(tmp_path):
    for lead in (SNIFF_BYTES - 1, SNIFF_BYTES - 2, SNIFF_BYTES - 3):  # 3- and 4-byte characters across the cut
        text = "a" * lead + "\u20ac\U0001F600 caf\u00e9\n" * 3
        f = tmp_path / f"cut{lead}.py"
        f.write_text(text, encoding="utf-8")
        assert non_text_reason(f) is None
        assert texts(data_cfg([f])) == [text]
    torn = tmp_path / "torn.txt"  # shorter than the look: an unfinished character at the end is not UTF-8
    torn.write_bytes(b"a" * 100 + "\u20ac".encode()[:2])
    assert "not UTF-8: byte 0xe2 at byte 100" in non_text_reason(torn)


def test_a_folder_trains_on_its_text_and_names_the_skipped_files(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text(CODE)
    (tmp_path / "src" / "logo.png").write_bytes(PNG)
    (tmp_path / "src" / "blob.bin").write_bytes(random_bytes())
    (tmp_path / "src" / "notes.txt.gz").write_bytes(gzip.compress(b"text, but only .jsonl.gz is decompressed"))
    assert texts(data_cfg([tmp_path / "src"])) == [CODE]
    err = capsys.readouterr().err
    assert (f"[draftforge] notice: skipped 3 non-text files in {tmp_path / 'src'}: blob.bin, logo.png, "
            "notes.txt.gz") in err
    assert texts(data_cfg([str(tmp_path / "src" / "*")])) == [CODE]  # a glob too
    assert "skipped 3 non-text files" in capsys.readouterr().err


def test_a_long_skip_list_is_cut_and_a_tokens_folder_notices_once(tmp_path, tok, capsys):
    for i in range(7):
        (tmp_path / f"img{i}.png").write_bytes(PNG)
    write_jsonl(tmp_path / "rows.jsonl", [{"input_ids": [5, 6, 7, 8], "prompt_len": 1}] * 4)
    build_block_data(data_cfg([tmp_path], format="tokens"), tok, 8, seed=0)  # sidecar check + load: one notice
    notices = [ln for ln in capsys.readouterr().err.splitlines() if "non-text" in ln]
    assert notices == [f"[draftforge] notice: skipped 7 non-text files in {tmp_path}: "
                       "img0.png, img1.png, img2.png, img3.png, img4.png and 2 more"]


def test_a_folder_or_glob_with_only_binaries_is_refused(tmp_path):
    (tmp_path / "logo.png").write_bytes(PNG)
    (tmp_path / "blob.bin").write_bytes(random_bytes())
    msg = refused(data_cfg([tmp_path]), "blob.bin, logo.png")
    assert "has no text file: 2 non-text files" in msg
    refused(data_cfg([str(tmp_path / "*.png")]), "logo.png")


def test_a_bad_line_past_the_first_8kib_is_named_by_file_and_line(tmp_path):
    good = [json.dumps({"text": f"row {i} " + "x" * 40}).encode() for i in range(300)]  # > 8 KiB
    (tmp_path / "rows.jsonl").write_bytes(b"\n".join(good + [b'{"text": "caf\xe9"}', good[0]]) + b"\n")
    assert non_text_reason(tmp_path / "rows.jsonl") is None  # the look passes: the reader finds the line
    assert "rows.jsonl:301: not UTF-8 text" in refused(data_cfg([tmp_path / "rows.jsonl"]), "rows.jsonl:301")
    with gzip.open(tmp_path / "rows.jsonl.gz", "wb") as f:
        f.write((tmp_path / "rows.jsonl").read_bytes())
    refused(data_cfg([tmp_path / "rows.jsonl.gz"]), "rows.jsonl.gz:301: not UTF-8 text")
    rows = b"[\n" + b",\n".join(good + [b'{"text": "caf\xe9"}']) + b"\n]\n"
    (tmp_path / "rows.json").write_bytes(rows)
    refused(data_cfg([tmp_path / "rows.json"]), "rows.json:302: not UTF-8 text")


def test_parquet_and_jsonl_gz_still_load_alone_and_in_a_folder(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    pq.write_table(pa.table({"text": ["from parquet"]}), tmp_path / "d" / "a.parquet")
    with gzip.open(tmp_path / "d" / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"text": "from gzip \u20ac"}) + "\n")
    (tmp_path / "d" / "c.py").write_text(CODE)
    assert texts(data_cfg([tmp_path / "d" / "a.parquet"])) == ["from parquet"]
    assert texts(data_cfg([tmp_path / "d" / "b.jsonl.gz"])) == ["from gzip \u20ac"]
    assert texts(data_cfg([tmp_path / "d"])) == ["from parquet", "from gzip \u20ac", CODE]
    assert "non-text" not in capsys.readouterr().err


def test_the_cli_refuses_a_binary_source_in_one_line_before_any_model_or_write(tmp_path, tiny_tokenizer_dir):
    import yaml

    from tests.train.test_loop import tiny_recipe

    (tmp_path / "noise.bin").write_bytes(random_bytes())
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(tmp_path, tmp_path / "noise.bin", tiny_tokenizer_dir)))
    cache = tmp_path / "hf-datasets-cache"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-m", "draftforge", "train", str(recipe)], capture_output=True,
                          text=True, env=env, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-2000:]
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and str(tmp_path / "noise.bin") in errors[0] and "not a text file" in errors[0], out
    assert "Traceback" not in out and "UnicodeDecodeError" not in out
    assert "process(es) x micro-batch" not in out  # the trainer's first line, after the model is built
    assert not (tmp_path / "run").exists()
    assert not [p for p in cache.rglob("*") if p.is_file()]  # the datasets cache got nothing either


def test_a_leading_utf8_bom_is_dropped_in_jsonl_json_and_text(tmp_path):
    """Windows tools (Notepad, PowerShell's Out-File) start UTF-8 files with a BOM: the JSONL reader refused line 1
    and a .txt document trained U+FEFF as its first character."""
    bom = b"\xef\xbb\xbf"
    (tmp_path / "rows.jsonl").write_bytes(bom + b'{"text": "first"}\n{"text": "second"}\n')
    (tmp_path / "rows.json").write_bytes(bom + b'[{"text": "third"}]')
    (tmp_path / "doc.txt").write_bytes(bom + b"fourth")
    with gzip.open(tmp_path / "rows.jsonl.gz", "wb") as f:
        f.write(bom + b'{"text": "fifth"}\n')
    names = ["rows.jsonl", "rows.json", "doc.txt", "rows.jsonl.gz"]
    assert texts(data_cfg([tmp_path / n for n in names])) == ["first", "second", "third", "fourth", "fifth"]
