"""Packing: every token exactly once, in order, EOS after each document, padding counted right."""

import numpy as np
import pytest

from draftforge.data import IGNORE_INDEX, build_block_data, describe
from draftforge.data.packing import StreamPacker, pack_greedy, pack_stream
from tests.data.common import data_cfg, token_stream, write_jsonl

DOCS = [f"def f{i}(x):\n    return x * {i}  # document {i}\n" * (1 + i % 4) for i in range(23)]


@pytest.mark.parametrize("block_size", [7, 32, 4096])
def test_text_packing_keeps_every_token_once_in_order(tmp_path, tok, block_size):
    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in DOCS])
    bd = build_block_data(data_cfg([src]), tok, block_size, seed=0)
    stream = token_stream(tok, DOCS)
    ids_BS = np.array(bd.train["input_ids"])
    labels_BS = np.array(bd.train["labels"])
    n_blocks = -(-len(stream) // block_size)
    assert ids_BS.shape == (n_blocks, block_size)
    flat_ids, flat_labels = ids_BS.reshape(-1), labels_BS.reshape(-1)
    assert flat_ids[: len(stream)].tolist() == stream
    assert flat_labels[: len(stream)].tolist() == stream
    n_pad = n_blocks * block_size - len(stream)
    assert (flat_ids[len(stream):] == tok.pad_token_id).all() and len(flat_ids[len(stream):]) == n_pad
    assert (flat_labels[len(stream):] == IGNORE_INDEX).all()
    # EOS sits exactly at each document's end, nowhere else.
    eos_positions = np.flatnonzero(flat_ids == tok.eos_token_id).tolist()
    doc_ends = np.cumsum([len(tok(d, add_special_tokens=False)["input_ids"]) + 1 for d in DOCS]) - 1
    assert eos_positions == doc_ends.tolist()
    s = bd.stats
    assert s["tokens"] == len(stream) and s["loss_tokens"] == len(stream) and s["blocks"] == n_blocks
    assert s["padding_fraction"] == pytest.approx(n_pad / (n_blocks * block_size))
    assert s["documents"] == len(DOCS) and s["rows_read"] == len(DOCS) and s["rows_skipped"] == 0
    assert f"{n_blocks:,} blocks" in describe(bd)


def test_padding_uses_eos_when_tokenizer_has_no_pad(tmp_path, make_tokenizer):
    tok = make_tokenizer()
    tok.pad_token = None
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello world"}])
    bd = build_block_data(data_cfg([src]), tok, 64, seed=0)
    row = bd.train[0]
    n = len(tok("hello world")["input_ids"]) + 1
    assert row["input_ids"][n:] == [tok.eos_token_id] * (64 - n)
    assert row["labels"][n:] == [IGNORE_INDEX] * (64 - n)


def test_pack_stream_and_greedy_by_hand():
    ids_BS, labels_BS = pack_stream(np.arange(1, 6), np.arange(1, 6), 2, pad_id=0)
    assert ids_BS.tolist() == [[1, 2], [3, 4], [5, 0]]
    assert labels_BS.tolist() == [[1, 2], [3, 4], [5, -100]]
    seqs = [[1, 2], [3, 4, 5], [6], [7, 8, 9, 10]]
    labs = [[-100, 2], [-100, 4, 5], [6], [-100, -100, 9, 10]]
    ids_BS, labels_BS = pack_greedy(seqs, labs, 4, pad_id=0)
    assert ids_BS.tolist() == [[1, 2, 0, 0], [3, 4, 5, 6], [7, 8, 9, 10]]
    assert labels_BS.tolist() == [[-100, 2, -100, -100], [-100, 4, 5, 6], [-100, -100, 9, 10]]


def test_stream_packer_matches_pack_stream():
    docs = [list(range(i * 10, i * 10 + 1 + i % 5)) for i in range(9)]
    packer = StreamPacker(4, pad_id=-1)
    blocks = [b for d in docs for b in packer.add(d, d)] + list(packer.flush())
    flat = np.concatenate([np.array(d) for d in docs])
    ids_BS, labels_BS = pack_stream(flat, flat, 4, pad_id=-1)
    assert [b["input_ids"] for b in blocks] == ids_BS.tolist()
    assert [b["labels"] for b in blocks] == labels_BS.tolist()


def test_pretraining_sized_corpus_pads_under_one_percent(tmp_path, tok):
    # stdlib-like folder of .py files, as the testbed uses.
    for i in range(40):
        (tmp_path / f"m{i:02d}.py").write_text("".join(f"x{j} = {j} * {i}\n" for j in range(60)))
    bd = build_block_data(data_cfg([tmp_path], file_glob="**/*.py"), tok, 128, seed=0)
    assert bd.stats["padding_fraction"] < 0.01
    assert bd.stats["documents"] == 40


def test_tokenization_workers_give_the_same_blocks(tmp_path, tok):
    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in DOCS])
    one = build_block_data(data_cfg([src], eval_fraction=0.2), tok, 16, seed=5)
    two = build_block_data(data_cfg([src], eval_fraction=0.2, num_proc=2), tok, 16, seed=5)
    assert one.train["input_ids"] == two.train["input_ids"] and one.eval["labels"] == two.eval["labels"]
    assert one.stats == two.stats


def test_describe_warns_when_most_of_every_block_is_padding(tmp_path, tok):
    # a folder of a few tiny files, or a block size far above the data, trained on ~99% padding with nothing said
    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": "x = 1\n"}])
    n = len(token_stream(tok, ["x = 1\n"]))
    line = describe(build_block_data(data_cfg([src]), tok, 64, seed=0))
    assert f"warning: {1 - n / 64:.0%} of every training block is padding ({n} tokens in 1 blocks of 64)" in line
    assert "lower train.block_size or add data" in line
    full = write_jsonl(tmp_path / "full.jsonl", [{"text": d} for d in DOCS])
    assert "warning" not in describe(build_block_data(data_cfg([full]), tok, 32, seed=0))
