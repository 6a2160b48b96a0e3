"""Sources (folder, glob, jsonl, json, parquet, HF routing), seeded held-out split, streaming."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import draftforge.data.sources as sources
from draftforge.data import IGNORE_INDEX, build_block_data
from draftforge.errors import DataError
from tests.data.common import data_cfg, token_stream, write_jsonl


def packed_tokens(ds):
    """All non-padding tokens of a block dataset, in order (padding = label -100 at the tail)."""
    ids, labels = np.array(ds["input_ids"]).reshape(-1), np.array(ds["labels"]).reshape(-1)
    real = np.flatnonzero(labels != IGNORE_INDEX)
    return ids[: real[-1] + 1].tolist() if len(real) else []


def test_folder_of_py_files_sorted_and_filtered_by_glob(tmp_path, tok):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    files = {"b.py": "import os\n", "a.py": "def add(a, b):\n    return a + b\n",
             "pkg/sub/c.py": "print(sys.argv)\n", "notes.txt": "not python", "pkg/data.json": "[]"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    bd = build_block_data(data_cfg([tmp_path], file_glob="**/*.py"), tok, 16, seed=0)
    expected_order = [files["a.py"], files["b.py"], files["pkg/sub/c.py"]]  # sorted paths
    assert packed_tokens(bd.train) == token_stream(tok, expected_order)
    assert bd.stats["documents"] == 3


def test_glob_source_and_txt_file_is_one_document(tmp_path, tok):
    for i in range(3):
        (tmp_path / f"doc{i}.txt").write_text(f"Hello world {i}\n\nsecond paragraph {i}\n")
    (tmp_path / "skip.md").write_text("nope")
    bd = build_block_data(data_cfg([str(tmp_path / "doc*.txt")]), tok, 8, seed=0)
    assert bd.stats["documents"] == 3
    texts = [(tmp_path / f"doc{i}.txt").read_text() for i in range(3)]
    assert packed_tokens(bd.train) == token_stream(tok, texts)


def test_jsonl_json_parquet_and_text_field(tmp_path, tok):
    docs = [f"The user asks question {i}." for i in range(6)]
    write_jsonl(tmp_path / "a.jsonl", [{"body": d} for d in docs[:2]])
    (tmp_path / "b.json").write_text(json.dumps([{"body": d, "extra": 1} for d in docs[2:4]]))
    pq.write_table(pa.table({"body": docs[4:]}), tmp_path / "c.parquet")
    cfg = data_cfg([tmp_path / "a.jsonl", tmp_path / "b.json", tmp_path / "c.parquet"], text_field="body")
    bd = build_block_data(cfg, tok, 8, seed=0)
    assert packed_tokens(bd.train) == token_stream(tok, docs)
    assert bd.stats["rows_read"] == 6 and bd.stats["rows_skipped"] == 0


def test_max_documents(tmp_path, tok):
    docs = [f"doc {i}" for i in range(10)]
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in docs])
    bd = build_block_data(data_cfg([src], max_documents=4), tok, 8, seed=0)
    assert packed_tokens(bd.train) == token_stream(tok, docs[:4])


def test_eval_split_is_disjoint_seeded_and_deterministic(tmp_path, tok):
    docs = [f"unique document number {i} " * 3 for i in range(50)]
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in docs])

    def split(seed):
        bd = build_block_data(data_cfg([src], eval_fraction=0.2), tok, 4096, seed=seed)
        return bd, tok.decode(packed_tokens(bd.train)), tok.decode(packed_tokens(bd.eval))

    bd, train_text, eval_text = split(0)
    train_docs = {d for d in docs if d in train_text}
    eval_docs = {d for d in docs if d in eval_text}
    assert len(eval_docs) == 10 and bd.stats["eval_documents"] == 10 and bd.stats["documents"] == 40
    assert train_docs.isdisjoint(eval_docs) and train_docs | eval_docs == set(docs)
    assert split(0)[2] == eval_text  # same seed, same held-out documents
    assert split(1)[2] != eval_text  # another seed, another choice


def test_eval_fraction_zero_disables_eval(tmp_path, tok):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": f"d{i}"} for i in range(5)])
    assert build_block_data(data_cfg([src], eval_fraction=0.0), tok, 8, seed=0).eval is None


def test_hf_names_are_routed_to_load_dataset(monkeypatch, tmp_path, tok):
    import datasets

    calls = []

    def fake_load_dataset(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        return datasets.Dataset.from_dict({"content": ["hello world", "tiny corpus"], "id": [1, 2]})

    monkeypatch.setattr(sources.datasets, "load_dataset", fake_load_dataset)
    cfg = data_cfg(["hf:org/corpus", "plain-name"], text_field="content", hf_config="sample-10BT", split="train")
    bd = build_block_data(cfg, tok, 8, seed=0)
    assert calls == [("org/corpus", "sample-10BT", "train", False), ("plain-name", "sample-10BT", "train", False)]
    assert packed_tokens(bd.train) == token_stream(tok, ["hello world", "tiny corpus"] * 2)
    assert sources.is_hf_name("HuggingFaceFW/fineweb-edu") and not sources.is_hf_name(str(tmp_path))
    assert not sources.is_hf_name("data/*.jsonl") and not sources.is_hf_name("missing.jsonl")


def test_org_slash_name_under_a_local_folder_is_a_missing_local_source(tmp_path, monkeypatch):
    # runs/corpus beside runs/ went to the Hub: half a minute of retries, then an error about the network
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert not sources.is_hf_name("runs/corpus") and sources.is_hf_name("HuggingFaceFW/fineweb-edu")
    with pytest.raises(DataError, match="data source 'runs/corpus' does not exist"):
        sources.resolve_local_files("runs/corpus", "**/*")


def test_a_folder_source_reads_nothing_under_a_hidden_folder(tmp_path):
    # a checked-out repository: its .git/HEAD, config and hooks were trained on as documents
    repo = tmp_path / "repo"
    for rel in ("main.py", "pkg/util.py", ".git/HEAD", ".git/hooks/pre-commit.sample", ".venv/lib/x.py",
                "pkg/.ipynb_checkpoints/util-checkpoint.py", ".env"):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text("x = 1\n")
    found = sources.resolve_local_files(str(repo), "**/*", quiet=True)
    assert [f.relative_to(repo).as_posix() for f in found] == ["main.py", "pkg/util.py"]


def test_hf_prefix_loads_a_local_dataset_folder_for_real(tmp_path, tok):
    (tmp_path / "ds").mkdir()
    write_jsonl(tmp_path / "ds" / "train.jsonl", [{"text": "hello world"}, {"text": "tiny corpus"}])
    bd = build_block_data(data_cfg([f"hf:{tmp_path / 'ds'}"]), tok, 8, seed=0)
    assert packed_tokens(bd.train) == token_stream(tok, ["hello world", "tiny corpus"])


def test_streaming_packs_the_same_tokens(tmp_path, tok):
    docs = [f"streamed document {i} " * (1 + i % 3) for i in range(30)]
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in docs] + [{"other": 1}])
    bd = build_block_data(data_cfg([src], streaming=True, eval_fraction=0.2), tok, 16, seed=3)
    train_rows, eval_rows = list(bd.train), list(bd.eval)
    assert all(len(r["input_ids"]) == 16 == len(r["labels"]) for r in train_rows + eval_rows)
    as_ds = {"input_ids": [r["input_ids"] for r in train_rows], "labels": [r["labels"] for r in train_rows]}
    train_text = tok.decode(packed_tokens(as_ds))
    eval_text = tok.decode(packed_tokens({k: [r[k] for r in eval_rows] for k in ("input_ids", "labels")}))
    held = [d for d in docs if d in eval_text]
    assert held and all(d not in train_text for d in held)
    assert packed_tokens(as_ds) == token_stream(tok, [d for d in docs if d not in held])


def test_recipe_data_config_is_accepted_and_stats_are_json(tmp_path, tok):
    from draftforge import recipe
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": f"document {i}"} for i in range(20)] + [{"x": 1}])
    cfg = recipe.DataConfig(sources=[str(src)], eval_fraction=0.1)
    bd = build_block_data(cfg, tok, 8, seed=0)
    assert bd.eval is not None and bd.stats["eval_documents"] == 2
    assert json.loads(json.dumps(bd.stats)) == bd.stats


def test_a_file_read_twice_or_both_trained_on_and_held_out_is_refused(tmp_path, tok):
    # sources: [data] with eval_sources: [data/heldout.jsonl] trained on every eval row (5 of 5 eval blocks were
    # train blocks too); a folder and a file in it read the file's rows twice, nothing said
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "train.jsonl", [{"text": f"train row {i}"} for i in range(6)])
    write_jsonl(data / "heldout.jsonl", [{"text": f"held-out row {i}"} for i in range(3)])
    with pytest.raises(DataError, match=r"heldout.jsonl is both a training source \(through '.*data'\) and an eval"):
        build_block_data(data_cfg([str(data)], eval_sources=[str(data / "heldout.jsonl")]), tok, 8, seed=0)
    with pytest.raises(DataError, match=r"data.sources reach .*train.jsonl twice"):
        build_block_data(data_cfg([str(data), str(data / "train.jsonl")]), tok, 8, seed=0)
    bd = build_block_data(data_cfg([str(data / "train.jsonl")], eval_sources=[str(data / "heldout.jsonl")]), tok, 8,
                          seed=0)
    assert bd.stats["eval_documents"] == 3


def test_rows_cut_at_the_block_size_are_counted_with_the_loss_tokens_they_lose(tmp_path, tok):
    # a row longer than the block kept its first block_size tokens and lost the answer at its end, with nothing
    # said (59% of the demo's SFT loss tokens at block 64): by hand, block 6
    from draftforge.data import describe

    rows = [{"input_ids": list(range(3, 13)), "prompt_len": 2},  # 10 tokens, labels 2..9: 6..9 cut, 4 lost
            {"input_ids": list(range(3, 8)), "prompt_len": 1},  # 5 tokens: whole
            {"input_ids": list(range(3, 11)), "prompt_len": 7}]  # 8 tokens, labels 7: all cut, row skipped
    src = write_jsonl(tmp_path / "t.jsonl", rows)
    bd = build_block_data(data_cfg([src], format="tokens"), tok, 6, seed=0)
    assert (bd.stats["rows_cut"], bd.stats["loss_tokens_cut"], bd.stats["rows_skipped"]) == (2, 5, 1)
    assert "2 rows cut at the block size (5 loss tokens lost)" in describe(bd)


def test_a_broken_parquet_file_or_an_lfs_pointer_is_named(tmp_path, tok):
    # pyarrow's "Parquet magic bytes not found in footer" named no file: in a folder of shards, which one?
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": ["hello world", "tiny corpus"]}), good)
    (tmp_path / "cut.parquet").write_bytes(good.read_bytes()[:40])
    with pytest.raises(DataError, match=r"cut.parquet: not a readable Parquet file \("):
        build_block_data(data_cfg([str(tmp_path / "cut.parquet")]), tok, 8, seed=0)
    (tmp_path / "lfs.parquet").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 9\n")
    with pytest.raises(DataError, match="lfs.parquet: not a readable Parquet file \\(a git-lfs pointer"):
        build_block_data(data_cfg([str(tmp_path / "lfs.parquet")]), tok, 8, seed=0)


def test_a_same_size_rewrite_given_back_its_mtime_is_read_again(tmp_path, tok):
    # cp -p / rsync -t of a same-length file: size and mtime (the cache key) unchanged, the old rows were served
    import os

    src = tmp_path / "d.jsonl"
    write_jsonl(src, [{"text": "alpha beta"}])
    first = packed_tokens(build_block_data(data_cfg([str(src)]), tok, 8, seed=0).train)
    stat = os.stat(src)
    write_jsonl(src, [{"text": "gamma zeta"}])
    os.utime(src, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.path.getsize(src) == stat.st_size
    again = packed_tokens(build_block_data(data_cfg([str(src)]), tok, 8, seed=0).train)
    assert again == token_stream(tok, ["gamma zeta"]) != first


def test_the_data_line_counts_eval_sources_apart_and_rows_past_max_documents(tmp_path, tok):
    # an eval_sources row cut away was counted as a skipped training row ("5/20 rows skipped" when all 20 trained),
    # and rows past max_documents went unsaid
    from draftforge.data import describe

    train = write_jsonl(tmp_path / "train.jsonl", [{"input_ids": [3, 4, 5, 6], "prompt_len": 1}] * 6)
    held = write_jsonl(tmp_path / "held.jsonl", [{"input_ids": [3, 4, 5, 6], "prompt_len": 1},
                                                 {"input_ids": list(range(3, 20)), "prompt_len": 12}])
    bd = build_block_data(data_cfg([train], format="tokens", eval_sources=[str(held)], max_documents=4), tok, 8,
                          seed=0)
    line = describe(bd)
    assert "0/6 rows skipped; 2 rows past data.max_documents not used;" in line
    assert "eval: 1 blocks from 1 documents (1/2 eval rows skipped)" in line


def test_a_folder_laid_out_as_a_hub_dataset_asks_for_hf(tmp_path, tok):
    # read as files, its test split and its dataset card were trained on (4 of 4 test rows); hf: reads the split
    ds = tmp_path / "clone"
    (ds / "data").mkdir(parents=True)
    (ds / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: "
                                  "data/train-*\n  - split: test\n    path: data/test-*\n---\n# My dataset\n")
    pq.write_table(pa.table({"text": ["train row one", "train row two"]}), ds / "data" / "train-00000-of-00001.parquet")
    pq.write_table(pa.table({"text": ["test row"]}), ds / "data" / "test-00000-of-00001.parquet")
    with pytest.raises(DataError, match=r"laid out as a Hugging Face dataset \(README.md's header maps configs\).*"
                                        r"give it as 'hf:"):
        build_block_data(data_cfg([str(ds)]), tok, 8, seed=0)
    bd = build_block_data(data_cfg([f"hf:{ds}"]), tok, 8, seed=0)
    assert packed_tokens(bd.train) == token_stream(tok, ["train row one", "train row two"])
    (ds / "README.md").write_text("# notes\nconfigs: not a header\n")  # a plain README: a folder of files
    assert len(sources.resolve_local_files(str(ds), "**/*", quiet=True)) == 3
