"""format=tokens: ids are trained on exactly as written, the loss mask is the rows' own (but never a row's first token,
which nothing in the row predicts), bad rows fail clearly."""

import numpy as np
import pytest

from draftforge.data import IGNORE_INDEX, build_block_data
from draftforge.errors import DataError, RecipeError
from tests.data.common import data_cfg, write_jsonl


def _rows():
    # Row 0 holds "\n" "\n" and " " " " as separate ids, which re-tokenizing their text would merge:
    # the data must keep the ids as written, not as the tokenizer would write them.
    return [
        {"input_ids": [10, 11, 12, 5, 5, 3, 3, 40], "prompt_len": 3},
        {"input_ids": [7, 8, 9, 100, 101], "loss_mask": [0, 1, 0, 1, 1]},
        {"input_ids": [50, 51, 52]},  # no mask: every token has loss
    ]


def _expected_labels(row):
    """The row's own mask, but never its first token: nothing in the row predicts it (packed after another row,
    that row's last position would)."""
    ids = row["input_ids"]
    if "prompt_len" in row:
        mask = [i >= row["prompt_len"] for i in range(len(ids))]
    else:
        mask = row.get("loss_mask", [1] * len(ids))
    return [t if m and i > 0 else IGNORE_INDEX for i, (t, m) in enumerate(zip(ids, mask))]


def _unpack(ds, pad_id):
    """Blocks back to (ids, labels) per block with trailing padding removed."""
    out = []
    for block in ds:
        ids, labels = np.array(block["input_ids"]), np.array(block["labels"])
        keep = len(ids)
        while keep and ids[keep - 1] == pad_id and labels[keep - 1] == IGNORE_INDEX:
            keep -= 1
        out.append((ids[:keep].tolist(), labels[:keep].tolist()))
    return out


def test_ids_and_loss_mask_round_trip_exactly(tmp_path, tok):
    src = write_jsonl(tmp_path / "d.jsonl", _rows())
    bd = build_block_data(data_cfg([src], format="tokens"), tok, 16, seed=0)
    blocks = _unpack(bd.train, tok.pad_token_id)
    # greedy packing: rows 0 (8) + 1 (5) fit 16; row 2 (3) fits too -> one block, in order
    want_ids = sum((r["input_ids"] for r in _rows()), [])
    want_labels = sum((_expected_labels(r) for r in _rows()), [])
    assert blocks == [(want_ids, want_labels)]
    assert bd.stats["loss_tokens"] == sum(lab != IGNORE_INDEX for lab in want_labels) == 5 + 3 + 2
    assert bd.stats["format"] == "tokens" and bd.stats["documents"] == 3


def test_rows_are_packed_whole_and_truncated_to_the_block(tmp_path, tok):
    src = write_jsonl(tmp_path / "d.jsonl", _rows())
    blocks = _unpack(build_block_data(data_cfg([src], format="tokens"), tok, 6, seed=0).train, tok.pad_token_id)
    r0, r1, r2 = _rows()
    assert blocks == [(r0["input_ids"][:6], _expected_labels(r0)[:6]),
                      (r1["input_ids"], _expected_labels(r1)),
                      (r2["input_ids"], _expected_labels(r2))]


def test_streaming_gives_the_same_blocks(tmp_path, tok):
    src = write_jsonl(tmp_path / "d.jsonl", _rows())
    plain = build_block_data(data_cfg([src], format="tokens"), tok, 16, seed=0).train
    streamed = build_block_data(data_cfg([src], format="tokens", streaming=True), tok, 16, seed=0).train
    assert [dict(b) for b in streamed] == [dict(b) for b in plain]


def test_row_without_loss_tokens_is_skipped_and_counted(tmp_path, tok):
    rows = _rows() + [{"input_ids": [1, 2], "prompt_len": 2}]
    bd = build_block_data(data_cfg([write_jsonl(tmp_path / "d.jsonl", rows)], format="tokens"), tok, 16, seed=0)
    assert bd.stats["rows_skipped"] == 1 and bd.stats["skip_reasons"] == {"no loss tokens": 1}


@pytest.mark.parametrize("row,match", [
    ({"input_ids": [1, "2"]}, "non-empty list of ints"),
    ({"input_ids": []}, "non-empty list of ints"),
    ({"text": "hello"}, "non-empty list of ints"),
    ({"input_ids": [1, -2]}, "negative id"),
    ({"input_ids": [1, 2], "loss_mask": [1]}, "one per input id"),
    ({"input_ids": [1, 2], "loss_mask": [1, 2]}, "list of 0/1"),
    ({"input_ids": [1, 2], "prompt_len": 3}, r"prompt_len' must be an int in \[0, 2\]"),
    ({"input_ids": [1, 2], "prompt_len": 1, "loss_mask": [0, 1]}, "not both"),
])
def test_malformed_rows_name_file_and_line(tmp_path, tok, row, match):
    src = write_jsonl(tmp_path / "d.jsonl", _rows()[:2] + [row])
    with pytest.raises(DataError, match=rf"d\.jsonl:3: .*{match}"):
        build_block_data(data_cfg([src], format="tokens"), tok, 16, seed=0)


@pytest.mark.parametrize("streaming", [False, True])
def test_id_outside_the_vocabulary_names_file_and_line(tmp_path, tok, streaming):
    # a skipped row first, so the offending row's index differs between all rows and usable rows
    rows = [{"input_ids": [1, 2], "prompt_len": 2}] + _rows() + [{"input_ids": [1, 2, len(tok)], "prompt_len": 1}]
    src = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match=rf"d\.jsonl:5: token id {len(tok)} is outside the vocabulary"):
        bd = build_block_data(data_cfg([src], format="tokens", streaming=streaming), tok, 16, seed=0)
        list(bd.train)
    # a model with a larger (padded) embedding accepts it
    bd = build_block_data(data_cfg([src], format="tokens"), tok, 16, seed=0, vocab_size=len(tok) + 8)
    assert bd.stats["documents"] == 4 and bd.stats["rows_skipped"] == 1


def test_raw_text_files_are_not_token_rows(tmp_path, tok):
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(DataError, match="format=tokens reads .jsonl"):
        build_block_data(data_cfg([tmp_path / "a.txt"], format="tokens"), tok, 16, seed=0)


def test_recipe_accepts_tokens_for_sft_and_rejects_text(tmp_path):
    from draftforge.recipe import recipe_from_dict

    base = {"task": "sft", "model": {"init_from": "x"}, "data": {"sources": ["d.jsonl"], "format": "tokens"}}
    assert recipe_from_dict(base).data.format == "tokens"
    with pytest.raises(RecipeError, match="data.format.*chat or tokens"):
        recipe_from_dict(base, ["data.format=text"])
    with pytest.raises(RecipeError, match="data.format"):
        recipe_from_dict(base, ["data.format=ids"])


def test_sft_trains_on_token_rows(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    """A tiny pretrain export, then sft on token rows of one fixed continuation: the loss must fall."""
    from draftforge.recipe import recipe_from_dict
    from draftforge.train import run

    common = {"optim": {"lr": 1e-2, "warmup_steps": 1},
              "train": {"global_batch_size": 4, "micro_batch_size": 4, "block_size": 32, "eval_every": 0,
                        "save_every": 0, "log_every": 1, "trackers": []}}
    small = {"hidden_size": 32, "num_hidden_layers": 2, "head_dim": 16, "state_size": 8}
    pre = run(recipe_from_dict({
        "task": "pretrain", "output_dir": str(tmp_path / "pre"),
        "model": {"arch": "mamba2", "tokenizer": str(tiny_tokenizer_dir), "overrides": small},
        "data": {"sources": [str(tiny_corpus_dir)], "eval_fraction": 0.0}, **common}, ["train.max_steps=2"]))
    rng = np.random.default_rng(0)
    rows = [{"input_ids": rng.integers(3, 500, 6).tolist() + [40, 41, 42, 43, 44, 45], "prompt_len": 6}
            for _ in range(16)]
    src = write_jsonl(tmp_path / "sft.jsonl", rows)
    result = run(recipe_from_dict({
        "task": "sft", "output_dir": str(tmp_path / "sft"),
        "model": {"init_from": str(pre.export_dir), "tokenizer": str(tiny_tokenizer_dir)},
        "data": {"sources": [str(src)], "format": "tokens", "eval_fraction": 0.0}, **common},
        ["train.max_steps=20"]))
    assert sum(result.losses[-3:]) / 3 < result.losses[0] / 3


def test_demo_distill_rows_train_on_exactly_the_emitted_ids(tmp_path, tok):
    from draftforge.demo import distill_row

    eos, pad = tok.eos_token_id, tok.pad_token_id
    stopped = distill_row([10, 11, 12], [20, 21, eos, pad, pad], eos)  # generate pads after EOS
    assert stopped == {"input_ids": [10, 11, 12, 20, 21, eos], "loss_mask": [0, 0, 0, 1, 1, 1]}
    cut = distill_row([10, 11], [30, 31, 32], eos)  # cut by max_new_tokens: an EOS separator outside the loss
    assert cut == {"input_ids": [10, 11, 30, 31, 32, eos], "loss_mask": [0, 0, 1, 1, 1, 0]}
    src = write_jsonl(tmp_path / "d.jsonl", [stopped, cut])
    (ids, labels), = _unpack(build_block_data(data_cfg([src], format="tokens"), tok, 16, seed=0).train, pad)
    assert ids == stopped["input_ids"] + cut["input_ids"]
    assert [t for t in labels if t != IGNORE_INDEX] == [20, 21, eos, 30, 31, 32]


def test_eval_sources_hold_out_their_rows_and_every_source_row_trains(tmp_path, tok):
    train_rows, held = _rows(), [{"input_ids": [60, 61, 62, 63], "prompt_len": 1}]
    src = write_jsonl(tmp_path / "d.jsonl", train_rows)
    ev = write_jsonl(tmp_path / "heldout.jsonl", held)
    # eval_fraction would hold out 2 of the 3 rows; with eval_sources it is not used
    bd = build_block_data(data_cfg([src], format="tokens", eval_fraction=0.5, eval_sources=[str(ev)]), tok, 16, seed=0)
    assert _unpack(bd.train, tok.pad_token_id) == [(sum((r["input_ids"] for r in train_rows), []),
                                                     sum((_expected_labels(r) for r in train_rows), []))]
    assert _unpack(bd.eval, tok.pad_token_id) == [(held[0]["input_ids"], _expected_labels(held[0]))]
    assert bd.stats["documents"] == 3 and bd.stats["eval_documents"] == 1


def test_eval_sources_are_checked_like_sources(tmp_path, tok):
    src = write_jsonl(tmp_path / "d.jsonl", _rows())
    ev = write_jsonl(tmp_path / "heldout.jsonl", [{"input_ids": [1, len(tok) + 3]}])
    with pytest.raises(DataError, match="heldout.jsonl"):
        build_block_data(data_cfg([src], format="tokens", eval_sources=[str(ev)]), tok, 16, seed=0)


def test_eval_sources_refused_where_they_cannot_be_read(tmp_path, tok):
    from draftforge.data.logits_cache import cached_block_data
    from draftforge.recipe import DataConfig

    with pytest.raises(RecipeError, match="eval_sources"):
        DataConfig(sources=["a.jsonl"], eval_sources=["b.jsonl"], streaming=True).check("data")
    cfg = data_cfg([tmp_path / "d.jsonl"], format="tokens", eval_sources=[str(tmp_path / "b.jsonl")])
    with pytest.raises(DataError, match="eval_sources.*nothing cached"):
        cached_block_data(cfg, tok, 16, 0, len(tok), cache=None)
