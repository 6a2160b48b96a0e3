"""`draftforge harvest hidden`: the states read back from the cache are, bit for bit, the ones task eagle3's online
loss computes on the same rows (the target on the packed blocks, in the same dtype); its top-k entries are the
logits harvest's; a killed harvest resumes to the same bytes; bad layer ids, a resume with other layers, a cache
of another kind and a truncated shard are refused, each by one error naming both sides, with nothing written;
and the CLI prints the storage it will need before it starts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from draftforge.cli import main as cli_main
from draftforge.data.hidden_cache import HiddenCache
from draftforge.data.logits_cache import LogitsCache, open_cache, read_token_rows
from draftforge.errors import CompatibilityError, DataError
from draftforge.harvest.hidden import harvest_hidden
from draftforge.harvest.logits import harvest_logits
from tests.data.test_logits_cache import (_shard_bytes, assert_split_is_the_single_process_harvest,
                                          estimate_comes_first, harvest_as_two_processes, launch_two_processes,
                                          record_writes, write_rows)
from tests.train.test_eesd import LAYERS, save_target

MAX_LEN = 64  # = the block size the online comparison packs the rows into (each row of 40-60 ids: one per block)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tiny_tokenizer_dir):
    return save_target(tmp_path_factory.mktemp("target"), tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
    return write_rows(tmp_path_factory.mktemp("rows") / "rows.jsonl")


SETTINGS = {"top_k": 8, "max_len": MAX_LEN, "batch_size": 2, "shard_rows": 5, "dtype": "float32", "progress": False}


def harvest(target, rows, out, **kw):
    return harvest_hidden(str(target), str(rows), str(out), **{**SETTINGS, **kw})


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, target_dir, rows_file):
    out = tmp_path_factory.mktemp("hidden") / "fp32"
    harvest(target_dir, rows_file, out)
    return out


def row_states(cache: HiddenCache, row: int) -> torch.Tensor:
    s, a, b = cache.row_span(row, "token_ptr")
    return cache.states(np.arange(a, b) + cache.token_starts[s])


def online_states(target_dir, rows_file, tokenizer_dir, dtype, layers):
    """What ttt_loss computes: the target (loaded as load_frozen_target loads it) on the blocks task eagle3 trains on,
    the concat of hidden_states[i] for i in the layers; one row per block here, so block b holds row b."""
    from transformers import AutoTokenizer

    from draftforge.data import build_block_data
    from draftforge.loading import load_causal_lm
    from draftforge.recipe import DataConfig

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = DataConfig(sources=[str(rows_file)], format="tokens", eval_fraction=0.0)
    blocks = torch.tensor(build_block_data(cfg, tok, MAX_LEN, 0, len(tok)).train["input_ids"])
    target = load_causal_lm(str(target_dir), what="target", dtype=dtype).eval()
    with torch.no_grad():
        out = target(input_ids=blocks[:4], output_hidden_states=True)  # a micro-batch of 4 blocks, then the rest
        rest = target(input_ids=blocks[4:], output_hidden_states=True)
    return blocks, torch.cat([torch.cat([o.hidden_states[i] for i in layers], -1) for o in (out, rest)])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_states_read_back_equal_the_online_states_bitwise(tmp_path, target_dir, rows_file, cache_dir,
                                                           tiny_tokenizer_dir, dtype):
    cache_path = cache_dir if dtype == "float32" else tmp_path / "bf16"
    if dtype != "float32":
        harvest(target_dir, rows_file, cache_path, dtype=dtype, batch_size=3)  # other batches: no difference
    cache = open_cache(cache_path, HiddenCache)
    m = cache.manifest
    assert m["kind"] == "hidden-cache" and cache.layers == [1, 2, 3] == m["layers"]  # EAGLE-3's choice for L = 4
    assert m["store"]["states"] == dtype and m["pad_to"] == MAX_LEN and m["num_layers"] == LAYERS
    torch_dtype = getattr(torch, dtype)
    blocks, online_BTA = online_states(target_dir, rows_file, tiny_tokenizer_dir, torch_dtype, cache.layers)
    rows = read_token_rows(rows_file)
    assert len(blocks) == len(rows) == cache.num_rows
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        assert blocks[i, :n].tolist() == row["input_ids"]  # block i is row i, then padding
        got = row_states(cache, i)
        assert got.dtype == torch_dtype and got.shape == (n, 3 * 32)
        assert torch.equal(got, online_BTA[i, :n]), f"row {i}"
    assert m["rows"]["tokens"] == sum(len(r["input_ids"]) for r in rows)
    size = sum(e["bytes"] for e in m["shards"])
    assert 0.97 < size / m["storage"]["bytes"] < 1.03  # the estimate printed before the harvest


def test_top_k_entries_are_the_logits_harvests(tmp_path, target_dir, rows_file, cache_dir):
    """The same positions, ids and top-1; log-probs equal within float32 rounding (the harvest reads every batch
    64 tokens long, the logits harvest only up to its last loss position)."""
    harvest_logits(str(target_dir), str(rows_file), str(tmp_path / "logits"), **SETTINGS)
    hidden, logits = open_cache(cache_dir, HiddenCache), LogitsCache(tmp_path / "logits")
    assert hidden.positions == logits.positions
    index = np.arange(hidden.positions)
    a, b = hidden.gather(index), logits.gather(index)
    assert (a["ids"] == b["ids"]).all() and (a["top1"] == b["top1"]).all()
    assert np.allclose(a["logp"], b["logp"], atol=1e-5) and np.allclose(a["rest_logp"], b["rest_logp"], atol=1e-5)
    with pytest.raises(DataError, match="is not a hidden-state cache manifest: its kind is 'logits-cache' .made by "
                                        "`draftforge harvest logits`."):
        open_cache(tmp_path / "logits", HiddenCache)
    with pytest.raises(DataError, match="is not a logits cache manifest: its kind is 'hidden-cache'"):
        LogitsCache(cache_dir)


def test_padding_to_the_longest_row_changes_at_most_the_last_bits(tmp_path, target_dir, rows_file, cache_dir):
    m = harvest(target_dir, rows_file, tmp_path / "short", pad_to_longest=True)
    assert m["pad_to"] is None
    padded, short = open_cache(cache_dir, HiddenCache), open_cache(tmp_path / "short", HiddenCache)
    for i in range(padded.num_rows):
        torch.testing.assert_close(row_states(short, i), row_states(padded, i), rtol=1e-5, atol=1e-5)


def test_a_killed_harvest_resumes_to_the_same_bytes_and_redoes_a_truncated_shard(tmp_path, target_dir, rows_file,
                                                                                 cache_dir, monkeypatch):
    out, want = tmp_path / "killed", _shard_bytes(cache_dir)
    with pytest.raises(KeyboardInterrupt):
        harvest(target_dir, rows_file, out, stop_after=1)
    # killed mid-harvest: one whole shard written, the uninterrupted one's bytes, and nothing else
    assert _shard_bytes(out) == {"shard-00000.safetensors": want["shard-00000.safetensors"]}
    with pytest.raises(DataError, match="hidden-state cache in .* is incomplete .1 of 3 shards written.: rerun `draftforge "
                                        "harvest hidden` with the same arguments and --resume"):
        open_cache(out, HiddenCache)
    writes = record_writes(monkeypatch)
    harvest(target_dir, rows_file, out, resume=True)
    assert [e[2] for e in writes if e[0] == "shard"] == [1, 2]  # the finished shard is kept, not harvested again
    assert _shard_bytes(out) == want
    writes.clear()
    shard = out / "shard-00001.safetensors"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(DataError, match=f"shard-00001.safetensors is truncated .{size - 100:,} of {size:,} bytes.; "
                                        "rerun `draftforge harvest hidden`"):
        open_cache(out, HiddenCache)
    harvest(target_dir, rows_file, out, resume=True)
    assert [e[2] for e in writes if e[0] == "shard"] == [1] and _shard_bytes(out) == want


def test_bad_layers_and_a_resume_with_other_layers_are_refused_with_nothing_written(tmp_path, target_dir, rows_file,
                                                                                   cache_dir):
    out = tmp_path / "bad"
    with pytest.raises(CompatibilityError, match=rf"--layers: ids \[4\] outside 0..3 for a target of {LAYERS} layers"):
        harvest(target_dir, rows_file, out, layers=[1, 4])
    with pytest.raises(CompatibilityError, match="--layers: an empty or repeated list for a target of 4 layers"):
        harvest(target_dir, rows_file, out, layers=[2, 2])
    assert not out.exists()
    before = _shard_bytes(cache_dir), (cache_dir / "harvest.json").read_bytes()
    with pytest.raises(CompatibilityError, match=r"made with other settings \(layers \[\d+(, \d+)*\] -> \[0, 3\]\)"):
        harvest(target_dir, rows_file, cache_dir, resume=True, layers=[0, 3])
    with pytest.raises(DataError, match="is not a logits cache manifest: its kind is 'hidden-cache'"):
        harvest_logits(str(target_dir), str(rows_file), str(cache_dir), top_k=8, max_len=MAX_LEN, resume=True)
    assert (_shard_bytes(cache_dir), (cache_dir / "harvest.json").read_bytes()) == before


def test_cli_prints_the_storage_first_and_one_error_line(tmp_path, target_dir, rows_file, capsys, monkeypatch):
    out = tmp_path / "cli"
    argv = ["harvest", "hidden", "--target", str(target_dir), "--data", str(rows_file), "--out", str(out),
            "--max-len", str(MAX_LEN), "--top-k", "4", "--layers", "0,3", "--dtype", "float32"]
    events = record_writes(monkeypatch, capsys=capsys)
    assert cli_main(argv) == 0
    said = estimate_comes_first(events, "harvest hidden")  # in what stderr got before harvest.json or any shard
    err = "".join(e[1] for e in events if e[0] == "said")
    assert "tokens x 256 B (64 float32 values)" in err, err
    assert [e[2] for e in events if e[0] == "shard"] == [0]  # 12 rows: one shard of the command's 32 rows
    manifest = json.loads((out / "harvest.json").read_text())
    assert manifest["layers"] == [0, 3] and manifest["complete"] and manifest["storage"]["per_token"] == 256
    assert abs(said - manifest["storage"]["bytes"]) <= 0.001 * manifest["storage"]["bytes"]
    monkeypatch.undo()
    assert cli_main([*argv[:-4], "--layers", "1,9", "--out", str(tmp_path / "x")]) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "ids [9] outside 0..3 for a target of 4 layers" in errors[0]
    assert not (tmp_path / "x").exists()
    assert cli_main([*argv[:-4], "--layers", "1,,3", "--out", str(tmp_path / "x")]) == 2  # was read as 1,3
    assert "--layers" in capsys.readouterr().err and not (tmp_path / "x").exists()
    # a list that starts with a negative id was argparse's "expected one argument"; now the range is named
    assert cli_main([*argv[:-4], "--layers", "-1,2", "--out", str(tmp_path / "x")]) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "ids [-1] outside 0..3 for a target of 4 layers" in errors[0], errors
    assert not (tmp_path / "x").exists()
    with pytest.raises(SystemExit):
        cli_main(["harvest", "hidden", "--help"])
    text = capsys.readouterr().out
    assert "--layers I,J,K" in text and "--pad-to-longest" in text and "eagle3.hidden_cache" in text


@pytest.mark.slow  # an accelerate launch of two CPU processes
def test_two_processes_write_the_same_cache_as_one(tmp_path, target_dir, rows_file, cache_dir):
    out = tmp_path / "two"
    events = launch_two_processes(tmp_path, "hidden", "--target", str(target_dir), "--data", str(rows_file), "--out",
                                  str(out), "--top-k", "8", "--max-len", str(MAX_LEN), "--batch-size", "2",
                                  "--shard-rows", "5", "--dtype", "float32")
    assert_split_is_the_single_process_harvest(events, out, cache_dir)
    assert open_cache(out, HiddenCache).manifest["complete"]


def test_two_processes_split_the_rows_once_and_write_the_single_process_cache(tmp_path, target_dir, rows_file,
                                                                              cache_dir, monkeypatch):
    """In-process (threads for the processes): which process wrote which shard is seen, not only the result."""
    out = tmp_path / "two"
    events = harvest_as_two_processes(monkeypatch, lambda: harvest(target_dir, rows_file, out))
    assert_split_is_the_single_process_harvest(events, out, cache_dir)


def test_a_second_harvest_into_the_same_new_out_is_refused_while_the_first_runs(tmp_path, target_dir, rows_file,
                                                                               monkeypatch):
    """Two harvests started into one --out whose parent did not exist yet took no lock: the second, run to the end
    while the first loaded its target, left shards the first then kept as its own and marked complete under its
    own settings (another target's states served as this one's). Now the first holds the lock from the start."""
    import draftforge.harvest.logits as logits_harvest
    from draftforge.errors import DraftforgeError

    out, real, refusals = tmp_path / "runs" / "new" / "cache", logits_harvest._load_target, []

    def load_while_another_starts(target, plan):
        try:
            harvest(target_dir, rows_file, out, top_k=4)
        except DraftforgeError as e:
            refusals.append(str(e))
        return real(target, plan)

    monkeypatch.setattr(logits_harvest, "_load_target", load_while_another_starts)
    manifest = harvest(target_dir, rows_file, out)
    assert len(refusals) == 1 and f"{out} is being written by another draftforge harvest" in refusals[0]
    assert manifest["complete"] and manifest["top_k"] == SETTINGS["top_k"]


def test_shards_stored_in_another_dtype_than_the_manifest_says_are_refused(tmp_path, cache_dir):
    # what the unlocked race above produced: a bfloat16 manifest over float32 shards; training then died on a
    # shape mismatch deep in the collate (each fp32 row read as two bf16 rows' bits)
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(cache_dir, copy)
    manifest = json.loads((copy / "harvest.json").read_text())
    manifest["store"]["states"] = "bfloat16"
    (copy / "harvest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"shard-00000.safetensors stores its states as f4, but its manifest says "
                                        r"bfloat16 \(u2\): the shard is not this harvest's; rerun"):
        open_cache(copy, HiddenCache)
