"""The θ predictor (models/cali_ts.py), `draftforge harvest theta` and task `theta`: shapes, a tiny overfit,
harvested rows against a direct forward, resume, training through the one loop, export -> load, bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path
import shutil

import pytest
import torch

from draftforge.cli import main as cli_main
from draftforge.harvest.cali_ts import harvest_theta, load_harvest
from draftforge.decode import build_decoder, load_drafter, load_target
from draftforge.errors import CheckpointError, CompatibilityError, DataError, DraftforgeError
from draftforge.models.cali_ts import ThetaPredictor, load_predictor
from tests.fixtures.decode import tiny_llama, tiny_mamba2

VOCAB = 16


def test_shapes_and_the_decode_path_agree_with_forward():
    torch.manual_seed(0)
    pred = ThetaPredictor(8, 6, max_offset=10)
    h_t, h_d = torch.randn(5, 8), torch.randn(5, 6)
    offsets = torch.tensor([1, 2, 10, 11, 16])
    with torch.no_grad():
        for p in pred.parameters():
            p.add_(0.1 * torch.randn_like(p))
        logits = pred(h_t, h_d, offsets)
    assert logits.shape == (5, 2)
    assert sum(p.numel() for p in pred.parameters()) == 10 * 8 * 8 + 2 * (8 + 6)  # no biases
    with torch.no_grad():  # offsets past 10 share W^10
        same = pred(h_t[:1].repeat(3, 1), h_d[:1].repeat(3, 1), torch.tensor([10, 11, 16]))
    torch.testing.assert_close(same[0], same[1])
    torch.testing.assert_close(same[0], same[2])
    theta = logits.softmax(-1)[:, 1]
    for b in range(5):  # the per-round folding W_p,T W^i h_T gives the same θ as the forward
        terms = pred.target_terms(h_t[b])
        assert pred.theta_from_terms(terms, h_d[b], int(offsets[b])) == pytest.approx(float(theta[b]), abs=1e-6)


def test_tiny_overfit():
    """64 rows whose label depends on the target state, the drafter state and the offset: learned exactly."""
    torch.manual_seed(1)
    h_t, h_d = torch.randn(64, 8), torch.randn(64, 4)
    offsets = torch.randint(1, 13, (64,))
    labels = ((h_t[:, 0] * torch.where(offsets > 5, -1.0, 1.0) + h_d[:, 1]) > 0).long()
    pred = ThetaPredictor(8, 4)
    opt = torch.optim.Adam(pred.parameters(), lr=0.03)
    first = None
    for _ in range(300):
        loss = torch.nn.functional.cross_entropy(pred(h_t, h_d, offsets), labels)
        first = first if first is not None else float(loss.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.05 < first
    assert (pred(h_t, h_d, offsets).argmax(-1) == labels).all()


# ---------------------------------------------------------------- harvest

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny Llama target and a Mamba2 drafter, saved as local checkpoints, plus token rows."""
    root = tmp_path_factory.mktemp("pair")
    target, drafter = tiny_llama(vocab=VOCAB), tiny_mamba2(vocab=VOCAB)
    target.save_pretrained(root / "target")
    drafter.save_pretrained(root / "drafter")
    other = tiny_mamba2(vocab=VOCAB, seed=5)
    other.save_pretrained(root / "other")
    rows = [{"input_ids": [(5 * i + j) % VOCAB for i in range(30)], "prompt_len": 4} for j in range(5)]
    rows.append({"input_ids": [3]})  # too short: skipped
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def harvest(pair, out, **kw):
    kw = {"max_offset": 4, "anchor_stride": 5, "shard_size": 2, "progress": False, "dtype": "float32", **kw}
    return harvest_theta(pair / "target", pair / "drafter", [str(pair / "rows.jsonl")], out, **kw)


def test_harvested_rows_are_the_teacher_forced_states_and_labels(pair, tmp_path):
    manifest = harvest(pair, tmp_path / "h")
    # 5 sequences of 30 tokens, anchors c = 4, 9, ..., 29 (stride 5 from prompt_len 4), offsets i <= 4 with
    # p = c+i-1 <= 29: 5 anchors x 4 + the last anchor's 1 = 21 rows each
    assert manifest["rows"] == 5 * 21 and len(manifest["shards"]) == 3
    rows, _ = load_harvest(tmp_path / "h")
    ids = [(5 * i + 0) % VOCAB for i in range(30)]
    target = load_target(str(pair / "target")).model
    drafter = load_drafter(str(pair / "drafter"), load_target(str(pair / "target"))).model
    with torch.no_grad():
        t_out = target(torch.tensor([ids]), output_hidden_states=True)
        d_out = drafter(torch.tensor([ids]), output_hidden_states=True)
    row = rows[6]  # sequence 0, anchor c = 9, offset i = 3 -> p = 11
    assert row["offset"] == 3
    torch.testing.assert_close(torch.tensor(row["h_target"]), t_out.hidden_states[-1][0, 8], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(row["h_draft"]), d_out.hidden_states[-1][0, 11], rtol=1e-5, atol=1e-5)
    assert row["label"] == int(d_out.logits[0, 11].argmax() == t_out.logits[0, 11].argmax())


def test_held_out_rows_are_whole_sequences(pair, tmp_path, capsys):
    """Rows of one sequence share anchors (h_target repeats over offsets 1..N) and text: a split by row put 206
    of 206 held-out anchors in training too. Each row now names its sequence and the theta task holds out whole
    ones; a harvest from before the column still trains, split by row, with a notice saying so."""
    import datasets

    from draftforge.train.cali_ts import _split

    harvest(pair, tmp_path / "h")
    rows, _ = load_harvest(tmp_path / "h")
    assert rows["sequence"] == [s for s in range(5) for _ in range(21)]  # 5 sequences of 21 rows (test above)
    train, held = _split(rows, 0.4, seed=0)
    assert len(set(held["sequence"])) == 2 and not set(held["sequence"]) & set(train["sequence"])
    assert len(train) + len(held) == len(rows) and len(held) == 2 * 21
    shard = tmp_path / "h" / "shards" / "shard-00001"
    datasets.load_from_disk(str(shard)).remove_columns(["sequence"]).save_to_disk(str(tmp_path / "old"))
    import shutil

    shutil.rmtree(shard)
    shutil.move(str(tmp_path / "old"), str(shard))  # one shard as an older draftforge wrote it
    rows, _ = load_harvest(tmp_path / "h")
    assert "sequence" not in rows.column_names and len(rows) == 5 * 21
    train, held = _split(rows, 0.4, seed=0)
    assert len(held) == int(0.4 * len(rows)) and "held out one by one" in capsys.readouterr().err


def test_harvest_resumes_and_refuses_to_mix(pair, tmp_path, capsys):
    out = tmp_path / "h"
    full = harvest(pair, out)
    manifest = json.loads((out / "harvest.json").read_text())
    del manifest["shards"]["1"]  # as if killed before shard 1 was written
    (out / "harvest.json").write_text(json.dumps(manifest))
    kept = (out / "shards" / "shard-00000").stat().st_mtime_ns
    with pytest.raises(DraftforgeError, match="--resume"):
        harvest(pair, out)
    with pytest.raises(DraftforgeError, match="other settings.*anchor_stride"):
        harvest(pair, out, resume=True, anchor_stride=3)
    capsys.readouterr()
    again = harvest(pair, out, resume=True)
    assert "3 of 5 sequences are in shards an earlier run wrote: kept" in capsys.readouterr().err  # shards 0, 2
    assert again["rows"] == full["rows"] and (out / "shards" / "shard-00000").stat().st_mtime_ns == kept
    # what a resume silently mixed before: another precision, another sequence cap, other rows in the same file
    for kw, said in (({"dtype": "bfloat16"}, "dtype float32 -> bfloat16"),
                     ({"max_sequences": 4}, "max_sequences None -> 4")):
        with pytest.raises(DraftforgeError, match=f"other settings \\({said}\\)"):
            harvest(pair, out, resume=True, **kw)
    rows = pair / "rows.jsonl"
    text = rows.read_text()
    try:
        rows.write_text(text.replace("1", "2", 1))
        with pytest.raises(DraftforgeError, match="other settings \\(sources_sha256"):
            harvest(pair, out, resume=True)
    finally:
        rows.write_text(text)
    # the same file spelled another way resumes; a kept shard damaged since is harvested again, the same rows
    import os

    cwd = os.getcwd()
    try:
        os.chdir(pair)
        for f in (out / "shards" / "shard-00002").glob("*.arrow"):
            f.write_bytes(f.read_bytes()[:100])
        capsys.readouterr()
        again = harvest_theta("target", "drafter", ["rows.jsonl"], out, resume=True, max_offset=4, anchor_stride=5,
                              shard_size=2, progress=False, dtype="float32")
    finally:
        os.chdir(cwd)
    assert "1 kept shard(s) could not be read (shard-00002): harvested again" in capsys.readouterr().err
    assert again["rows"] == full["rows"] and load_harvest(out)[0].num_rows == full["rows"]


def _tree(path):
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_overwrite_deletes_only_the_harvests_own_shards(pair, tmp_path):
    """--overwrite removed OUT/shards whole, with files a user had put there."""
    out = tmp_path / "h"
    harvest(pair, out)
    (out / "shards" / "my_notes.txt").write_text("mine")
    (out / "shards" / "analysis").mkdir()
    (out / "shards" / "analysis" / "plot.txt").write_text("mine too")
    again = harvest(pair, out, overwrite=True, max_sequences=2)  # 1 shard now: shards 1 and 2 must go
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["analysis", "my_notes.txt", "shard-00000"]
    assert (out / "shards" / "my_notes.txt").read_text() == "mine" and len(again["shards"]) == 1


def test_a_harvest_killed_while_saving_its_first_shard_resumes_to_the_uninterrupted_bytes(pair, tmp_path,
                                                                                          monkeypatch):
    """The manifest was first written after shard 0: a run killed while saving it left shards/ and no harvest.json,
    and every later run refused the folder as someone else's. Killed inside datasets' save of shard 0 (half of its
    files written), --resume now harvests everything, removes the killed save's leftovers, and ends with the bytes
    of an uninterrupted harvest."""
    import datasets

    want = _tree(harvest(pair, tmp_path / "whole") and tmp_path / "whole" / "shards")
    real = datasets.Dataset.save_to_disk

    def killed(self, path, *args, **kwargs):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "data-00000-of-00001.arrow").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", killed)
    out = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        harvest(pair, out)
    assert json.loads((out / "harvest.json").read_text())["shards"] == {}
    monkeypatch.setattr(datasets.Dataset, "save_to_disk", real)
    harvest(pair, out, resume=True)
    assert _tree(out / "shards") == want


def test_each_shard_records_its_device_and_a_resume_on_another_says_so(pair, tmp_path, monkeypatch, capsys):
    out = tmp_path / "h"
    harvest(pair, out)
    manifest = json.loads((out / "harvest.json").read_text())
    first = manifest["shards"]["0"]["device"]
    assert first.startswith("cpu: ") and {e["device"] for e in manifest["shards"].values()} == {first}
    del manifest["shards"]["1"]  # as if killed before shard 1 was written
    (out / "harvest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr("draftforge.harvest.cali_ts.device_name", lambda device: "cuda: Imaginary GPU")
    capsys.readouterr()
    again = harvest(pair, out, resume=True)
    assert f"notice: continued on cuda: Imaginary GPU; the part already written was computed on {first}" in \
        capsys.readouterr().err
    assert again["shards"]["1"]["device"] == "cuda: Imaginary GPU" and again["shards"]["0"]["device"] == first
    harvest(pair, out, resume=True)  # nothing left to harvest: nothing to say
    assert "continued on" not in capsys.readouterr().err


def test_an_empty_harvest_is_one_clear_error(pair, tmp_path):
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"input_ids": [1]}) + "\n")
    with pytest.raises(DataError, match="no usable sequences"):
        harvest_theta(pair / "target", pair / "drafter", [str(short)], tmp_path / "a", progress=False)
    unlabeled = tmp_path / "unlabeled.jsonl"  # all prompt: no anchor in the labelled part
    unlabeled.write_text(json.dumps({"input_ids": [1, 2, 3], "prompt_len": 3}) + "\n")
    harvest_theta(pair / "target", pair / "drafter", [str(unlabeled)], tmp_path / "b", progress=False)
    with pytest.raises(DataError, match="empty"):
        load_harvest(tmp_path / "b")
    assert cli_main(["harvest", "theta", "--target", str(pair / "target"), "--drafter", str(pair / "drafter"),
                     "--data", str(short), "--out", str(tmp_path / "c")]) == 2  # one line, exit 2


# ---------------------------------------------------------------- task theta through the one loop

def theta_recipe(out, target, harvest_dir, max_offset: int, eval_fraction: float, steps: int, batch: int) -> dict:
    """Task theta on a harvest: lr 3e-3, no warm-up or decay, one micro-batch a step, no checkpoints."""
    return {"task": "theta", "output_dir": str(out), "model": {"target": str(target)},
            "data": {"sources": [str(harvest_dir)], "eval_fraction": eval_fraction},
            "theta": {"max_offset": max_offset, "balance": True},
            "optim": {"lr": 3e-3, "warmup_steps": 0, "weight_decay": 0.0},
            "train": {"max_steps": steps, "global_batch_size": batch, "micro_batch_size": batch, "eval_every": 0,
                      "save_every": 0, "log_every": 5, "trackers": []}}


def test_task_trains_exports_and_the_harness_loads_only_for_its_pair(pair, tmp_path):
    from draftforge.recipe import recipe_from_dict
    from draftforge.train import run

    harvest(pair, tmp_path / "h", anchor_stride=2, max_offset=8)
    recipe = theta_recipe(tmp_path / "run", pair / "target", tmp_path / "h", max_offset=4, eval_fraction=0.1,
                          steps=30, batch=64)
    result = run(recipe_from_dict(recipe))
    assert result.losses[-1] < result.losses[0]
    meta = json.loads((result.export_dir / "draftforge.json").read_text())
    assert meta["task"] == "theta" and meta["max_offset"] == 4 and 0 < meta["mean_label"] <= 1
    target = load_target(str(pair / "target"))
    drafter = load_drafter(str(pair / "drafter"), target)
    pred = load_predictor(result.export_dir, target.model, drafter)
    assert pred.mean_label == meta["mean_label"]
    # the recipe balances the classes (w1 / w0 = (1 - m) / m), which moves the optimal logit by log((1 - m) / m):
    # the task must record that shift for the decoder to take back out
    m = meta["mean_label"]
    assert 0 < m < 1 and meta["logit_shift"] == pytest.approx(math.log((1 - m) / m), rel=1e-12)
    assert pred.logit_shift == meta["logit_shift"]
    assert meta["format_version"] == 1  # a newer layout is refused (the θ export had no version before)
    newer = tmp_path / "newer"
    shutil.copytree(result.export_dir, newer)
    (newer / "draftforge.json").write_text(json.dumps({**meta, "format_version": 2}))
    with pytest.raises(CheckpointError, match=r"format_version 2, newer than this draftforge \(1\) reads"):
        load_predictor(newer, target.model, drafter)
    # weights of another shape were a RuntimeError traceback; NaN weights or calibration loaded, and a NaN θ reads
    # as 0 at decode time (Cali-TS then stops after every draft)
    from safetensors.torch import load_file, save_file

    damaged = tmp_path / "damaged"
    def nan_weight(weights, record):
        name = next(iter(weights))
        return {**weights, name: weights[name] * float("nan")}, record

    for edit in (nan_weight, lambda w, m: (w, {**m, "logit_shift": float("nan")}),
                 lambda w, m: (w, {**m, "max_offset": m["max_offset"] + 3})):
        shutil.rmtree(damaged, ignore_errors=True)
        shutil.copytree(result.export_dir, damaged)
        weights, record = edit(load_file(str(damaged / "theta.safetensors")), dict(meta))
        save_file(weights, str(damaged / "theta.safetensors"))
        (damaged / "draftforge.json").write_text(json.dumps(record))
        with pytest.raises(CheckpointError, match="non-finite weights or calibration|does not match its draftforge"):
            load_predictor(damaged, target.model, drafter)
    dec = build_decoder("cali_ts", target, drafter, theta_predictor=str(result.export_dir))
    assert dec.generate([1, 2, 3], max_new_tokens=8).stats.new_tokens == 8
    other = load_drafter(str(pair / "other"), target)
    with pytest.raises(CompatibilityError, match="drafter weights differ"):
        build_decoder("cali_ts", target, other, theta_predictor=str(result.export_dir))


def test_an_out_that_is_not_a_theta_harvest_is_refused_even_with_overwrite(pair, tmp_path):
    """--overwrite over a logits cache replaced its harvest.json (orphaning its shards); a directory of someone's
    files was harvested into. Both refused, every byte left."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "harvest.json").write_text(json.dumps({"kind": "logits-cache", "shards": []}))
    (cache / "shard-00000.safetensors").write_bytes(b"x" * 10)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    for out, said in ((cache, "holds a logits-cache, not a θ harvest"), (mine, "holds files that are not a θ harvest")):
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        for kw in ({}, {"overwrite": True}, {"resume": True}):
            with pytest.raises(DataError, match=said):
                harvest(pair, out, **kw)
            assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_an_existing_harvest_without_resume_is_refused_before_any_model_loads(pair, tmp_path):
    out = tmp_path / "h"
    harvest(pair, out)
    with pytest.raises(DraftforgeError, match="already holds a harvest; pass --resume"):
        harvest_theta(tmp_path / "no-such-target", pair / "drafter", [str(pair / "rows.jsonl")], out, progress=False)


def test_a_balanced_predictor_gives_calibrated_theta_at_decode_time():
    # class weights w1, w0 move the optimum logit by log(w1 / w0); θ_M is read as a probability (Cali-TS's blend,
    # SpecDec++'s product), so the shift must come back out. Oracle: acceptance with a known mean (≈ 0.22, from
    # one feature); the mean θ_M over the rows must sit near that mean, balanced or not (it was 0.46 balanced)
    from draftforge.train.cali_ts import make_loss

    torch.manual_seed(0)
    h_t, h_d = torch.randn(4000, 4), torch.randn(4000, 4)
    h_t[:, 0] = 1.0  # a constant feature: the bias is representable without a bias parameter
    offsets = torch.randint(1, 11, (4000,))
    label = torch.bernoulli(torch.sigmoid(-1.4 + 0.8 * h_d[:, 0])).long()
    mean = label.float().mean().item()
    for balance in (False, True):
        torch.manual_seed(1)
        weight = torch.tensor([0.5 / (1 - mean), 0.5 / mean]) if balance else None
        shift = math.log((1 - mean) / mean) if balance else 0.0
        pred = ThetaPredictor(4, 4, mean_label=mean, logit_shift=shift)
        loss, opt = make_loss(weight, shift), torch.optim.Adam(pred.parameters(), lr=3e-2)
        for _ in range(400):
            opt.zero_grad()
            total, n, metrics = loss(pred, {"h_target": h_t, "h_draft": h_d, "offset": offsets, "label": label})
            (total / n).backward()
            opt.step()
        pred.eval()
        theta = [pred.theta_from_terms(pred.target_terms(h_t[i]), h_d[i], int(offsets[i])) for i in range(400)]
        assert sum(theta) / len(theta) == pytest.approx(label[:400].float().mean().item(), abs=0.04), balance
        assert float(metrics["brier"].detach()) / n < 0.2  # scored on the θ the decoder reads


def test_a_theta_task_on_a_tree_harvest_or_a_row_that_is_no_object_is_one_clear_error(pair, tmp_path):
    trees = tmp_path / "trees"  # `harvest trees` writes a harvest.json too, with other keys (KeyError before)
    trees.mkdir()
    (trees / "harvest.json").write_text(json.dumps({"kind": "c2t-harvest", "settings": {}}))
    with pytest.raises(DataError, match="holds a c2t-harvest, not a θ harvest"):
        load_harvest(trees)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"input_ids": [1, 2, 3, 4]}) + "\n" + json.dumps([1, 2, 3]) + "\n")
    with pytest.raises(DataError, match=r"rows.jsonl:2: a harvest row is a JSON object"):
        harvest_theta(pair / "target", pair / "drafter", [str(rows)], tmp_path / "h", progress=False)


def test_a_harvest_whose_out_another_harvest_is_writing_is_refused(pair, tmp_path, tiny_tokenizer_dir):
    # two harvests into one --out rewrote each other's manifest (theta), wrote one shard's temp file together
    # (trees), and interleaved shards (logits, hidden); the second one is now refused in one line, nothing written
    import os
    import socket

    from draftforge.harvest.c2t import TreeHarvestJob, harvest_trees
    from draftforge.harvest.logits import harvest_logits

    def held(out):
        lock = out.with_name(f".{out.name}.lock")  # a first harvest still running: this process, by its record
        lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "what": "draftforge harvest",
                                    "started": "then"}))
        return lock

    calls = {
        "theta": lambda out: harvest(pair, out),
        "trees": lambda out: harvest_trees(TreeHarvestJob(target=str(pair / "target"), drafter=str(pair / "drafter"),
                                                          bench=str(pair / "rows.jsonl"), out=str(out))),
        "logits": lambda out: harvest_logits(str(pair / "target"), str(pair / "rows.jsonl"), str(out), top_k=4,
                                             max_len=32, progress=False),
    }
    for name, call in calls.items():
        out = tmp_path / name
        lock = held(out)
        with pytest.raises(DraftforgeError, match=rf"{name} is being written by another draftforge harvest \(pid "):
            call(out)
        assert not out.exists() and lock.exists(), name
        lock.unlink()


def test_sequences_past_the_targets_context_are_cut_at_it(pair, tmp_path, capsys):
    """--max-len (default 512) was never compared with the target's context: rows past it were labelled from
    positions the target does not define. They are cut at the context now, the same rows as --max-len equal to it."""
    short = tmp_path / "short"
    shutil.copytree(pair, short, ignore=shutil.ignore_patterns("target"))
    tiny_llama(vocab=VOCAB, ctx=24).save_pretrained(short / "target")
    manifest = harvest(short, tmp_path / "cut")
    assert "--max-len 512 is past the target's context of 24 tokens: sequences are cut at 24" in capsys.readouterr().err
    assert manifest["max_len"] == 24
    assert manifest["rows"] == harvest(short, tmp_path / "explicit", max_len=24)["rows"] < 5 * 21
    with pytest.raises(DraftforgeError, match="--generate 30 leaves no prompt within the target's context of 24"):
        harvest(short, tmp_path / "gen", generate=30)


def test_a_harvest_cut_short_another_target_or_mixed_flags_are_one_line_each(pair, tmp_path):
    """From an audit: training on a killed, unresumed θ harvest died with KeyError 'mean_label'; a recipe whose
    model.target is not the harvest's target trained and exported (eval refused it later); --resume with
    --overwrite replaced the harvest silently; a missing --data was found only after both models loaded."""
    from draftforge.harvest.cali_ts import load_harvest
    from draftforge.recipe import recipe_from_dict
    from draftforge.train import run

    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "harvest.json").write_text(json.dumps({"kind": "theta-harvest", "shards": {"0": {"rows": 4}}}))
    with pytest.raises(DataError, match=r"the θ harvest in .*cut is incomplete \(1 shards so far\).*--resume"):
        load_harvest(cut)
    harvest(pair, tmp_path / "h")
    other = tiny_llama(vocab=VOCAB, seed=9)
    other.save_pretrained(tmp_path / "other-target")
    recipe = theta_recipe(tmp_path / "run", tmp_path / "other-target", tmp_path / "h", max_offset=4,
                          eval_fraction=0.1, steps=2, batch=8)
    with pytest.raises(CompatibilityError, match=r"ran target .*target \(fingerprint [0-9a-f]+\), but model.target is "
                                                 r".*other-target \(fingerprint [0-9a-f]+\)"):
        run(recipe_from_dict(recipe))
    assert not (tmp_path / "run" / "export").exists()
    before = (tmp_path / "h" / "harvest.json").read_text()
    with pytest.raises(DraftforgeError, match="pass one of them"):
        harvest(pair, tmp_path / "h", resume=True, overwrite=True, max_offset=3)
    assert (tmp_path / "h" / "harvest.json").read_text() == before
    with pytest.raises(DataError, match="harvest source .*nope.jsonl does not exist"):  # before any model loads:
        harvest_theta(tmp_path / "no-target", tmp_path / "no-drafter", [str(tmp_path / "nope.jsonl")], tmp_path / "x")
