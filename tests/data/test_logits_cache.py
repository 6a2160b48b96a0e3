"""`draftforge harvest logits` + `distill.logits_cache`: the losses on a 5-token vocabulary by hand (full, reduced,
top-K), the cached KL / TVD / α against the on-the-fly ones within the stated truncation bounds (a tiny Llama
teacher), a harvest resumed after a kill to the same bytes, one clear error per bad input with nothing written,
and a drafter distilled from the cache without the teacher ever loading."""

from __future__ import annotations

import json
import re
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftforge.harvest.logits import harvest_logits
from draftforge.data.logits_cache import LogitsCache, cached_block_data, open_cache
from draftforge.errors import CompatibilityError, DataError, RecipeError
from draftforge.recipe import DataConfig, recipe_from_dict
from draftforge.train import distill, run
from draftforge.train.divergences import (TopK, chain_sums, chain_tau, derive_acceptance, full_terms, topk_bounds,
                                          topk_terms)
from draftforge.train.loop import read_metrics
from draftforge.train.spec import tensor_collate
from tests.fixtures.decode import tiny_llama

P5 = [0.5, 0.2, 0.15, 0.1, 0.05]  # the teacher on a 5-token vocabulary
Q5 = [0.3, 0.3, 0.1, 0.2, 0.1]  # the student
D2T = [0, 2, 3]  # a reduced head's target ids
QS = [0.5, 0.25, 0.25]  # the reduced student over D2T


def _kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q) if a > 0)


def _logits(probs):
    return torch.tensor([probs]).log()


class Fixed(torch.nn.Module):
    """A 'model' that returns the same logits whatever it reads."""

    def __init__(self, logits_BTS):
        super().__init__()
        self.out = logits_BTS
        self.anchor = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, **_):
        return type("Out", (), {"logits": self.out})()


# ---------------------------------------------------------------- by hand, 5 tokens

def test_full_losses_by_hand_whole_and_reduced_vocabulary():
    got = full_terms(_logits(Q5), _logits(P5))
    assert float(got["kl"]) == pytest.approx(_kl(P5, Q5), rel=1e-5)
    assert float(got["tvd"]) == pytest.approx(0.25, abs=1e-6)  # 1 - (0.3 + 0.2 + 0.1 + 0.1 + 0.05)
    assert float(got["ce_target"]) == pytest.approx(-math.log(0.3), rel=1e-6)
    assert float(got["alpha"]) == pytest.approx(0.75, abs=1e-6)
    # reduced head: p restricted to D2T and renormalised (0.75 of the mass); α keeps the unrestricted p
    p_s = [P5[i] / 0.75 for i in D2T]
    t_PV = _logits(P5)
    red = full_terms(_logits(QS), t_PV[:, D2T], 1.0, t_PV.logsumexp(-1))
    assert float(red["kl"]) == pytest.approx(_kl(p_s, QS), rel=1e-5)
    assert float(red["tvd"]) == pytest.approx(1 - (0.5 + 0.2 + 2 / 15), abs=1e-6)
    assert float(red["ce_target"]) == pytest.approx(-math.log(0.5), rel=1e-6)
    assert float(red["alpha"]) == pytest.approx(0.5 + 0.15 + 0.1, abs=1e-6)


def _top(ids, probs, rest):
    return TopK(torch.tensor([ids]), torch.tensor([probs]).log(), torch.tensor([rest]).log())


def test_topk_losses_by_hand_and_their_bounds():
    # whole vocabulary, K=2: outcomes {0}, {1} and the tail {2, 3, 4} (teacher 0.3, student Q = 0.4)
    top, q = _top([0, 1], [0.5, 0.2], 0.3), _logits(Q5)
    got, bound = topk_terms(q, top), topk_bounds(q, top)
    assert float(got["kl"]) == pytest.approx(_kl([0.5, 0.2, 0.3], [0.3, 0.3, 0.4]), rel=1e-5)
    assert float(got["tvd"]) == pytest.approx(1 - (0.3 + 0.2 + 0.3), abs=1e-6)
    assert float(got["alpha"]) == pytest.approx(0.3 + 0.2 + 0.3, abs=1e-6)
    assert float(got["ce_target"]) == pytest.approx(-math.log(0.3), rel=1e-6)
    full = full_terms(q, _logits(P5))
    tail_kl = 0.3 * _kl([0.5, 1 / 3, 1 / 6], [0.25, 0.5, 0.25])  # m̃ · KL(p̄ ‖ q̄): what the bucket drops
    assert float(full["kl"] - got["kl"]) == pytest.approx(tail_kl, rel=1e-4)
    assert float(bound["kl"]) == pytest.approx(0.3 * (math.log(0.4 / 0.1) + math.log(0.2 / 0.3)), rel=1e-5)
    assert 0 <= float(full["kl"] - got["kl"]) <= float(bound["kl"])
    assert float(bound["tvd"]) == pytest.approx(0.3) and float(full["tvd"] - got["tvd"]) == pytest.approx(0.05)
    assert float(got["alpha"] - full["alpha"]) == pytest.approx(0.05) and float(bound["alpha"]) == pytest.approx(0.3)
    # reduced head, K=2 over D2T: ids are its columns, the tail {3} holds 0.1 of p, so the form is exact
    red = topk_terms(_logits(QS), _top([0, 1], [0.5, 0.15], 0.1))
    p_s = [0.5 / 0.75, 0.15 / 0.75, 0.1 / 0.75]
    assert float(red["kl"]) == pytest.approx(_kl(p_s, QS), rel=1e-5)
    assert float(red["tvd"]) == pytest.approx(1 - (0.5 + 0.2 + 2 / 15), abs=1e-6)
    assert float(red["alpha"]) == pytest.approx(0.75, abs=1e-6)
    # K = S: no tail at all, the top-K form is the full one
    whole = topk_terms(q, _top([0, 1, 2, 3, 4], P5, 0.0))
    assert all(float(whole[k]) == pytest.approx(float(full[k]), abs=1e-6) for k in ("kl", "tvd", "alpha", "ce_target"))


@pytest.mark.parametrize("loss", ["kl", "tvd", "mix", "ce"])
def test_each_loss_by_hand_through_the_cached_loss_of_a_reduced_head(loss):
    """make_cached_loss on one position (reduced head, K=1 over D2T), every recipe loss, CE on the data added."""
    batch = {"input_ids": torch.zeros(1, 2, dtype=torch.long), "labels": torch.tensor([[0, 1]]),
             "cache": torch.tensor([[0, -100]]), "t_ids": torch.tensor([[[0], [0]]]),
             "t_logp": torch.tensor([[[0.5], [0.0]]]).log(), "t_rest": torch.tensor([[0.25, 0.0]]).log(),
             "t_top1": torch.tensor([[0, -1]])}
    student = Fixed(torch.tensor([[QS, QS]]).log())
    options = distill.DistillConfig(loss=loss, kl_weight=0.7, tvd_weight=2.0, ce_weight=0.1)
    total, count, metrics = distill.make_cached_loss(options, torch.tensor(D2T))(student, batch)
    kl = (2 / 3) * math.log((2 / 3) / 0.5) + (1 / 3) * math.log((1 / 3) / 0.5)
    tvd, ce_target, ce_data = 1 - (0.5 + 1 / 3), -math.log(0.5), -math.log(0.25)  # data label 1 = draft id 1
    main = {"kl": 0.7 * kl, "tvd": 2.0 * tvd, "mix": 0.7 * kl + 2.0 * tvd, "ce": ce_target}[loss]
    assert int(count) == 1
    assert float(total) == pytest.approx(main + 0.1 * ce_data, rel=1e-5)
    assert float(metrics["kl"]) == pytest.approx(kl, rel=1e-5) and float(metrics["tvd"]) == pytest.approx(tvd, rel=1e-5)
    assert int(metrics["top1_agree"]) == 1


def test_chain_acceptance_by_hand():
    alpha = torch.tensor([[0.5, 0.8, 1.0, 0.5, 0.0, 0.0]])
    keep = torch.tensor([[True, True, True, True, False, False]])
    link = torch.tensor([[True, True, True, False, False, False]])
    sums = chain_sums(alpha, alpha, keep, link, gamma=2)  # anchors 0, 1, 2 (positions 3+4 are not both kept)
    assert float(sums["chain_anchors"]) == 3
    assert float(sums["chain_alpha_d1"]) == pytest.approx(0.5 + 0.8 + 1.0)
    assert float(sums["chain_alpha_d2"]) == pytest.approx(0.5 * 0.8 + 0.8 * 1.0 + 1.0 * 0.5)
    derived = derive_acceptance({k: float(v) for k, v in sums.items()} | {"alpha": 0.5}, gamma=2)
    assert derived["alpha_depth2"] == pytest.approx(1.7 / 2.3)
    assert derived["tau_chain_g2"] == pytest.approx(1 + 2.3 / 3 + 1.7 / 3)
    assert derived["tau_g2"] == pytest.approx(1 + 0.5 + 0.25) and chain_tau(0.5, 5) == pytest.approx(1.96875)
    # the cost model's round: γ = 2 drafter steps at 0.1 of a target token each + a verification of 3 rows at 1.2
    costed = derive_acceptance({k: float(v) for k, v in sums.items()} | {"alpha": 0.5}, gamma=2, cost=(0.1, 1.2))
    assert costed["predicted_speedup"] == pytest.approx((1 + 2.3 / 3 + 1.7 / 3) / (2 * 0.1 + 1.2))


# ---------------------------------------------------------------- a tiny target and its rows

def _save_target(path: Path, tokenizer_dir, seed: int, scale: float = 30.0) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = tiny_llama(vocab=len(tok), seed=seed)
    with torch.no_grad():  # a peaky teacher: its top-8 holds about half the mass, so the tails matter
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tiny_tokenizer_dir):
    return _save_target(tmp_path_factory.mktemp("target"), tiny_tokenizer_dir, seed=3)


def write_rows(path: Path, n: int = 12, seed: int = 0) -> Path:
    """Rows of 40-60 ids (one per 64-token block; about half of them among the 64 most frequent), a loss after a
    prompt, some rows with a loss_mask."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        ids = [3 + int(497 * rng.random() ** 3) for _ in range(rng.randrange(40, 61))]  # frequent small ids
        row = {"input_ids": ids, "prompt_len": rng.randrange(4, 10)}
        if i % 4 == 3:
            row = {"input_ids": ids, "loss_mask": [int(j % 7 != 0 and j > 2) for j in range(len(ids))]}
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
    return write_rows(tmp_path_factory.mktemp("rows") / "rows.jsonl")


def _harvest(target, rows, out, **kw):
    kw = {"top_k": 8, "max_len": 64, "batch_size": 2, "shard_rows": 5, "dtype": "float32", "progress": False, **kw}
    return harvest_logits(str(target), str(rows), str(out), **kw)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, target_dir, rows_file):
    out = tmp_path_factory.mktemp("caches") / "full"
    _harvest(target_dir, rows_file, out)
    return out


# ---------------------------------------------------------------- cached vs on the fly

def _blocks(cache, rows, tokenizer_dir, block_size=64):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = DataConfig(sources=[str(rows)], format="tokens", eval_fraction=0.0)
    return cached_block_data(cfg, tok, block_size, 0, len(tok), cache).train


@pytest.mark.parametrize("draft", [None, 64], ids=["whole-vocab", "reduced-head"])
def test_cached_kl_and_tvd_match_the_teacher_within_the_truncation_bound(tmp_path, target_dir, rows_file,
                                                                        cache_dir, tiny_tokenizer_dir, draft):
    """Per kept position: 0 <= full − cached <= bound for KL and TVD, 0 <= cached α − α <= bound; the cached loss
    and the on-the-fly loss see the same positions, and their summed KL differ by at most the summed bound."""
    from draftforge.loading import load_causal_lm
    from draftforge.models.draft_vocab import target_to_draft
    from draftforge.train.lm import labels_to_draft_ids

    cache_path = cache_dir if draft is None else tmp_path / "draft"
    if draft is not None:
        _harvest(target_dir, rows_file, cache_path, draft_vocab=str(draft))
    cache = open_cache(cache_path)
    d2t = None if draft is None else torch.tensor(cache.draft_vocab)
    t2d = None if draft is None else target_to_draft(cache.vocab_size, cache.draft_vocab)
    teacher = load_causal_lm(str(target_dir))
    data = _blocks(cache, rows_file, tiny_tokenizer_dir)
    base = tensor_collate if draft is None else labels_to_draft_ids(t2d)  # as build_lm_task's collate
    collate = distill.cached_collate(base, cache, t2d)
    torch.manual_seed(0)
    width = cache.vocab_size if draft is None else draft
    checked = measured = 0
    for i in range(0, len(data), 2):
        batch = collate(data[i: i + 2], "cpu")
        keep = distill.cached_keep(batch)
        student_BTS = 3 * torch.randn(*batch["input_ids"].shape, width)
        with torch.no_grad():
            t_PV = teacher(input_ids=batch["input_ids"]).logits[keep].float()
        s_PS = student_BTS[keep]
        full = (full_terms(s_PS, t_PV) if draft is None else full_terms(s_PS, t_PV[:, d2t], 1.0, t_PV.logsumexp(-1)))
        top = TopK(batch["t_ids"][keep], batch["t_logp"][keep], batch["t_rest"][keep])
        got, bound = topk_terms(s_PS, top), topk_bounds(s_PS, top)
        if draft is None:  # what the cached KL leaves out, exactly: m̃ · KL(p̄ ‖ q̄) over the ids the cache lacks
            p_PV, q_PV = t_PV.double().softmax(-1), s_PS.double().softmax(-1)
            tail = torch.ones_like(p_PV, dtype=torch.bool).scatter(1, top.ids_PK.long(), False)
            m_P = (p_PV * tail).sum(-1)
            p_bar, q_bar = p_PV * tail / m_P[:, None], q_PV * tail / (q_PV * tail).sum(-1, keepdim=True)
            kl_bar = torch.where(tail, p_bar * (p_bar.log() - q_bar.log()), 0.0).sum(-1)
            torch.testing.assert_close((full["kl"] - got["kl"]).double(), m_P * kl_bar, rtol=0, atol=1e-4)
        for name in ("kl", "tvd"):
            gap = full[name] - got[name]
            assert (gap >= -1e-4).all() and (gap <= bound[name] + 1e-4).all(), name
        gap = got["alpha"] - full["alpha"]
        assert (gap >= -1e-5).all() and (gap <= bound["alpha"] + 1e-5).all()
        assert torch.allclose(got["ce_target"], full["ce_target"], atol=1e-4)  # the top cached id is the argmax
        cached = distill.make_cached_loss(distill.DistillConfig(), d2t)(Fixed(student_BTS), batch)[2]
        fly_batch = {k: batch[k] for k in ("input_ids", "labels", "target_labels") if k in batch}
        _, count, fly = distill.make_loss(teacher, distill.DistillConfig(), d2t)(Fixed(student_BTS), fly_batch)
        assert int(count) == int(keep.sum())  # one row per block: the same kept positions
        assert 0 <= float(fly["kl"] - cached["kl"]) <= float(bound["kl"].sum()) + 1e-3
        # acceptance: both over the same positions (a reduced head's: every cached one), the same top-1 agreement
        assert int(cached["top1_agree"]) == int(fly["top1_agree"])
        assert int(cached.get("measured", count)) == int(fly.get("measured", count))
        measured += int(fly.get("measured", count))
        checked += int(keep.sum())
    total = cache.manifest["rows"]["positions"]
    # every cached position was compared (a reduced head skips those whose next token is no draft id) and every
    # one counted in acceptance
    assert checked == total if draft is None else total / 3 < checked < total
    assert measured == total


# ---------------------------------------------------------------- resume, damage

def _shard_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.glob("shard-*.safetensors"))}


class Events(list):
    """record_writes' events; flush() adds what stderr got since the last one."""

    flush = staticmethod(lambda: None)


def record_writes(monkeypatch, rank=lambda: 0, capsys=None) -> Events:
    """Every file a harvest writes from now on, in order: ("shard", rank, index, (a, b)) for the shard of rows
    a..b-1, ("file", rank, name) for harvest.json, a shard's record or draft_vocab.json; with capsys, before each
    write, ("said", text): what stderr got since the event before."""
    import draftforge.harvest.logits as hl

    events, real_shard, real_text = Events(), hl.write_shard, hl.atomic_write_text

    def said():
        text = capsys.readouterr().err if capsys is not None else ""
        if text:
            events.append(("said", text))

    def write_shard(path, tensors, meta):
        said()
        events.append(("shard", rank(), meta["shard"], tuple(int(x) for x in meta["rows"].split(":"))))
        return real_shard(path, tensors, meta)

    def atomic_write_text(path, text):
        said()
        events.append(("file", rank(), Path(path).name))
        return real_text(path, text)

    monkeypatch.setattr(hl, "write_shard", write_shard)
    monkeypatch.setattr(hl, "atomic_write_text", atomic_write_text)
    events.flush = said
    return events


def harvest_as_two_processes(monkeypatch, harvest) -> list[tuple]:
    """Run `harvest()` as processes 0 and 1 of a launch of two, as `accelerate launch --num_processes 2` does: two
    threads, each seeing its rank and world size 2, the gloo barriers and the lock's broadcast replaced by a
    threading.Barrier; returns record_writes' events, each with the rank that wrote it."""
    import threading

    import draftforge.harvest.logits as hl

    local, barrier, loading = threading.local(), threading.Barrier(2, timeout=120), threading.Lock()
    shared = {}

    def share(problem):  # process 0's verdict on the lock, to both
        if local.rank == 0:
            shared["problem"] = problem
        barrier.wait()
        return shared["problem"]

    real_load = hl._load_target

    def load(target, plan):  # from_pretrained flips process-wide defaults while it builds a model: one at a time
        with loading:
            return real_load(target, plan)

    monkeypatch.setattr(hl, "_process_group", lambda: (local.rank, 2, 0))
    monkeypatch.setattr(hl, "_barrier", lambda world: barrier.wait())
    monkeypatch.setattr(hl, "_share", share)
    monkeypatch.setattr(hl, "_load_target", load)
    events, errors = record_writes(monkeypatch, rank=lambda: local.rank), {}

    def process(rank):
        local.rank = rank
        try:
            harvest()
        except BaseException as e:  # the other process stops at its next barrier, as a launch stops
            errors[rank] = e
            barrier.abort()

    threads = [threading.Thread(target=process, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    return events


LAUNCHED = """\
import json, os, sys
from pathlib import Path

import draftforge.harvest.logits as hl

def logged(real, event):
    def write(path, *args):
        with open(LOG, "a") as f:
            f.write(json.dumps([*event(path, *args)]) + "\\n")
        return real(path, *args)
    return write

LOG, RANK = os.environ["HARVEST_WRITES"], int(os.environ["RANK"])
hl.write_shard = logged(hl.write_shard, lambda path, tensors, meta: ("shard", RANK, meta["shard"],
                                                                     [int(x) for x in meta["rows"].split(":")]))
hl.atomic_write_text = logged(hl.atomic_write_text, lambda path, text: ("file", RANK, Path(path).name))
from draftforge.cli import main
sys.exit(main(sys.argv[1:]))
"""


def launch_two_processes(tmp_path: Path, what: str, *flags: str) -> list[tuple]:
    """`draftforge harvest WHAT FLAGS` under `accelerate launch --num_processes 2` (two CPU processes, a gloo group),
    through a script that logs each file a process writes; record_writes' events, from both processes."""
    from tests import REPO
    from tests.train.test_distributed import _env, _free_port

    script, log = tmp_path / "launched.py", tmp_path / "writes.jsonl"
    script.write_text(LAUNCHED)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "launch" / "multi_cpu.yaml"),
           "--num_processes", "2", "--main_process_port", str(_free_port()), str(script), "harvest", what, *flags]
    proc = subprocess.run(cmd, cwd=REPO, env={**_env(), "HARVEST_WRITES": str(log)}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    return [(*e[:3], tuple(e[3])) if e[0] == "shard" else tuple(e) for e in logged]


def assert_split_is_the_single_process_harvest(events: list[tuple], out: Path, single: Path) -> None:
    """Each process harvested shards of its own (none twice, none by both), their rows together are every row once,
    only process 0 wrote harvest.json, and the shards and index equal one process's harvest (`single`), bitwise."""
    one, got = (json.loads((path / "harvest.json").read_text()) for path in (single, out))
    shards = [e for e in events if e[0] == "shard"]
    by_rank = {r: [e[2] for e in shards if e[1] == r] for r in (0, 1)}
    assert all(by_rank.values()), f"a process harvested nothing: {by_rank}"
    written = [i for r in (0, 1) for i in by_rank[r]]
    assert sorted(written) == list(range(one["num_shards"])), f"a shard skipped or harvested twice: {by_rank}"
    rows = sorted(row for e in shards for row in range(*e[3]))
    assert rows == list(range(one["rows"]["count"])), f"rows not covered exactly once: {[e[3] for e in shards]}"
    assert {e[1] for e in events if e[0] == "file" and e[2] == "harvest.json"} == {0}
    assert got["complete"] and _shard_bytes(out) == _shard_bytes(single)
    assert [(e["rows"], e["sha256"]) for e in got["shards"]] == [(e["rows"], e["sha256"]) for e in one["shards"]]


def test_harvest_resumes_after_a_kill_to_the_same_bytes_and_redoes_a_truncated_shard(tmp_path, target_dir,
                                                                                     rows_file, cache_dir, capsys):
    shards = open_cache(cache_dir).manifest["num_shards"]
    out = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        _harvest(target_dir, rows_file, out, stop_after=1)
    assert len(_shard_bytes(out)) == 1
    with pytest.raises(DataError, match="incomplete"):
        LogitsCache(out)
    with pytest.raises(DataError, match="--resume"):  # a rerun without --resume says what to do
        _harvest(target_dir, rows_file, out)
    capsys.readouterr()
    manifest = _harvest(target_dir, rows_file, out, resume=True)
    assert f"kept 1 of {shards} shards an earlier run wrote" in capsys.readouterr().err
    assert manifest["complete"] and _shard_bytes(out) == _shard_bytes(cache_dir)
    assert [e["sha256"] for e in manifest["shards"]] == [e["sha256"] for e in open_cache(cache_dir).manifest["shards"]]
    assert not list(out.glob("shard-*.json"))  # the per-shard records were merged into harvest.json
    shard = out / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(DataError, match="shard-00001.safetensors is truncated"):
        open_cache(out)
    capsys.readouterr()
    _harvest(target_dir, rows_file, out, resume=True)
    err = capsys.readouterr().err
    assert "shard-00001.safetensors is truncated" in err and f"kept {shards - 1} of {shards} shards" in err
    assert _shard_bytes(out) == _shard_bytes(cache_dir)
    # the storage line counted the truncated shard as written ("still to write" its last 100 bytes, give or take)
    number, unit = re.search(r"; ([\d.,]+) (B|KiB|MiB) still to write", err).groups()
    still = float(number.replace(",", "")) * {"B": 1, "KiB": 1024, "MiB": 1024**2}[unit]
    assert still > 0.9 * shard.stat().st_size, err


def test_each_shard_records_its_device_and_a_resume_on_another_says_so(tmp_path, target_dir, rows_file,
                                                                         monkeypatch, capsys):
    out = tmp_path / "moved"
    with pytest.raises(KeyboardInterrupt):
        _harvest(target_dir, rows_file, out, stop_after=1)
    first = json.loads((out / "shard-00000.json").read_text())["device"]
    assert first.startswith("cpu: ")
    capsys.readouterr()
    monkeypatch.setattr("draftforge.harvest.logits.device_name", lambda device: "cuda: Imaginary GPU")
    manifest = _harvest(target_dir, rows_file, out, resume=True)
    assert f"notice: continued on cuda: Imaginary GPU; the part already written was computed on {first}" in \
        capsys.readouterr().err
    assert [e["device"] for e in manifest["shards"]] == [first] + ["cuda: Imaginary GPU"] * (manifest["num_shards"] - 1)
    _harvest(target_dir, rows_file, out, resume=True)  # nothing left to harvest: nothing to say
    assert "continued on" not in capsys.readouterr().err


# ---------------------------------------------------------------- rows added later: one cache per rows file

def _split_rows(tmp_path: Path, rows_file: Path, at: int = 10) -> tuple[Path, Path]:
    """The rows before and after `at`: at a shard boundary (shard_rows 5), so each harvest batches the rows as one
    harvest of the whole file does, and the teacher's logits agree bitwise."""
    lines = rows_file.read_text().splitlines(keepends=True)
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text("".join(lines[:at]))
    second.write_text("".join(lines[at:]))
    return first, second


def test_two_caches_read_as_one_equal_one_harvest_of_both_files(tmp_path, target_dir, rows_file, cache_dir,
                                                                tiny_tokenizer_dir):
    """The oracle: a harvest over the concatenated rows file. Blocks (ids, labels, cache entries) and every stored
    teacher entry they point at are the same, bitwise, when the two halves come with a cache each."""
    from transformers import AutoTokenizer

    first, second = _split_rows(tmp_path, rows_file)
    _harvest(target_dir, first, tmp_path / "c1")
    _harvest(target_dir, second, tmp_path / "c2")
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    cfg = DataConfig(sources=[str(first), str(second)], format="tokens", eval_fraction=0.2)
    chained = open_cache([tmp_path / "c1", tmp_path / "c2"])
    assert chained.num_rows == 12 and chained.positions == open_cache(cache_dir).positions
    got = cached_block_data(cfg, tok, 64, 0, len(tok), chained)
    one = open_cache(cache_dir)
    want = cached_block_data(DataConfig(sources=[str(rows_file)], format="tokens", eval_fraction=0.2), tok, 64, 0,
                             len(tok), one)
    for split in ("train", "eval"):
        a, b = getattr(got, split), getattr(want, split)
        assert a["input_ids"] == b["input_ids"] and a["labels"] == b["labels"] and a["cache"] == b["cache"]
        entries = [e for row in a["cache"] for e in row if e >= 0]
        x, y = chained.gather(entries), one.gather(entries)
        assert all((x[name] == y[name]).all() for name in x)
    assert len(entries) > 0 and got.stats == want.stats


def test_chained_caches_that_do_not_belong_together_are_refused(tmp_path, tiny_tokenizer_dir, target_dir,
                                                                rows_file, cache_dir):
    first, second = _split_rows(tmp_path, rows_file)
    _harvest(target_dir, first, tmp_path / "c1")
    _harvest(target_dir, second, tmp_path / "c2")
    values = cached_recipe(tmp_path, target_dir, first, cache_dir)
    values["data"]["sources"] = [str(first), str(second)]
    values["distill"]["logits_cache"] = [str(tmp_path / "c1")]  # two rows files, one cache
    with pytest.raises(RecipeError, match="one per cache, in order; 1 cache, 2 sources"):
        recipe_from_dict(values)
    values["distill"]["logits_cache"] = [str(tmp_path / "c2"), str(tmp_path / "c1")]  # swapped
    _refused(values, DataError, "first.jsonl is not the rows file logits cache .*c2 was harvested from")
    _harvest(target_dir, second, tmp_path / "k4", top_k=4)
    values["distill"]["logits_cache"] = [str(tmp_path / "c1"), str(tmp_path / "k4")]
    _refused(values, CompatibilityError, r"differ in top_k \(8 vs 4\); the caches of one run must come from one target")
    other = _save_target(tmp_path / "other-target", tiny_tokenizer_dir, seed=4)
    _harvest(other, second, tmp_path / "other")
    values["distill"]["logits_cache"] = [str(tmp_path / "c1"), str(tmp_path / "other")]
    _refused(values, CompatibilityError, "differ in target_fingerprint")
    # the same weights under an edited config.json are another model: only the first cache's config was checked
    import shutil

    edited = tmp_path / "edited"
    shutil.copytree(target_dir, edited)
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**config, "rope_theta": 500.0}))
    _harvest(edited, second, tmp_path / "edited-cache")
    values["distill"]["logits_cache"] = [str(tmp_path / "c1"), str(tmp_path / "edited-cache")]
    _refused(values, CompatibilityError, "differ in target_config")


# ---------------------------------------------------------------- distill on the cache

def cached_recipe(tmp_path, target, rows, cache, **options) -> dict:
    return {
        "task": "distill", "output_dir": str(tmp_path / "run"),
        "model": {"arch": "mamba2", "size": "tiny", "target": str(target),
                  "overrides": {"hidden_size": 32, "num_hidden_layers": 2, "head_dim": 16, "state_size": 8}},
        "data": {"sources": [str(rows)], "format": "tokens", "eval_fraction": 0.2},
        "distill": {"logits_cache": str(cache), "loss": "mix", "ce_weight": 0.1, **options},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "train": {"max_steps": 20, "global_batch_size": 4, "micro_batch_size": 2, "block_size": 64,
                  "eval_every": 0, "save_every": 20, "log_every": 1, "trackers": []},
    }


@pytest.mark.parametrize("draft", [None, 64], ids=["whole-vocab", "reduced-head"])
def test_distill_trains_from_the_cache_without_loading_the_teacher(tmp_path, monkeypatch, target_dir, rows_file,
                                                                   cache_dir, draft):
    import draftforge.loading
    from safetensors.torch import load_file

    cache = cache_dir
    values = cached_recipe(tmp_path, target_dir, rows_file, cache)
    if draft is not None:  # the cache's draft ids are the ones model.draft_vocab_from counts on the rows
        cache = tmp_path / "draft-cache"
        _harvest(target_dir, rows_file, cache, draft_vocab=str(draft))
        values = cached_recipe(tmp_path, target_dir, rows_file, cache)
        values["model"].update(draft_vocab=draft, draft_vocab_from=str(rows_file))
    seen, real_build = {}, distill.build_distill_task

    def spy(recipe, accelerator, with_data=True):
        spec = real_build(recipe, accelerator, with_data)
        seen.update({n: p.detach().clone() for n, p in spec.model.named_parameters() if p.requires_grad})
        return spec

    def no_teacher(*args, **kwargs):
        raise AssertionError("the teacher was loaded")

    monkeypatch.setattr(distill, "build_distill_task", spy)
    monkeypatch.setattr(draftforge.loading, "load_causal_lm", no_teacher)
    result = run(recipe_from_dict(values))
    monkeypatch.undo()
    logged = [r for r in read_metrics(result.run_dir) if "kl" in r]
    loss = [r["loss"] for r in logged]
    assert sum(loss[-5:]) / 5 < 0.8 * sum(loss[:3]) / 3, loss
    assert all(0 <= r["alpha"] <= 1 and 0 <= r["top1_agree"] <= 1 for r in logged)
    trained = load_file(str(result.export_dir / "model.safetensors"))
    unchanged = [n for n, before in seen.items() if n in trained and torch.equal(trained[n], before)]
    assert not unchanged and len([n for n in seen if n in trained]) >= len(seen) - 1  # a tied head is saved once
    meta = json.loads((result.export_dir / "draftforge.json").read_text())
    report = meta["metrics"]["acceptance"]
    assert meta["logits_cache"] == str(cache) and 0 < report["alpha"] < 1 and 1 <= report["tau_g5"] <= 6
    assert {"alpha_depth1", "alpha_depth5", "tau_chain_g5", "tau_g5_greedy"} <= set(report)


# ---------------------------------------------------------------- bad input: one error each, nothing written

def _refused(values, error, match):
    with pytest.raises(error, match=match):
        run(recipe_from_dict(values))
    assert not Path(values["output_dir"]).exists()  # the run dir was never claimed


def test_a_cache_from_another_target_or_tokenizer_is_refused(tmp_path, tiny_tokenizer_dir, target_dir, rows_file,
                                                             cache_dir):
    from transformers import AutoTokenizer

    other = _save_target(tmp_path / "other-target", tiny_tokenizer_dir, seed=4)
    values = cached_recipe(tmp_path, other, rows_file, cache_dir)
    _refused(values, CompatibilityError, "harvested from target .* not from model.target")
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tok.eos_token = "<|bos|>"  # same ids, other special tokens: another tokenizer fingerprint
    import shutil

    retok = tmp_path / "retok"  # the same weights, its tokenizer files replaced since the harvest
    shutil.copytree(target_dir, retok)
    tok.save_pretrained(retok)
    values = cached_recipe(tmp_path, retok, rows_file, cache_dir)
    values["model"]["tokenizer"] = str(retok)
    _refused(values, CompatibilityError, "was harvested with .* but this run uses")


def test_a_damaged_cache_or_other_rows_are_refused(tmp_path, target_dir, rows_file, cache_dir):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(cache_dir, broken)
    (broken / "shard-00002.safetensors").write_bytes((broken / "shard-00002.safetensors").read_bytes()[:64])
    _refused(cached_recipe(tmp_path, target_dir, rows_file, broken), DataError,
             "shard-00002.safetensors is truncated")
    other_rows = write_rows(tmp_path / "other.jsonl", seed=1)
    _refused(cached_recipe(tmp_path, target_dir, other_rows, cache_dir), DataError,
             "is not the rows file logits cache")
    # a recipe naming its rows file validates without it (a shipped recipe); training then names what is missing
    _refused(cached_recipe(tmp_path, target_dir, tmp_path / "gone.jsonl", cache_dir), DataError,
             r"gone.jsonl does not exist; it should be the rows file logits cache .* was harvested from")
    long_rows = tmp_path / "long.jsonl"  # one row of 100 tokens: a 128-token block needs positions past 63
    long_rows.write_text(rows_file.read_text() + json.dumps({"input_ids": list(range(3, 103))}) + "\n")
    _harvest(target_dir, long_rows, tmp_path / "short-cache")
    values = cached_recipe(tmp_path, target_dir, long_rows, tmp_path / "short-cache")
    values["train"]["block_size"] = 128
    _refused(values, DataError, "was harvested with --max-len 64, but train.block_size is 128")
    before = _shard_bytes(cache_dir)
    with pytest.raises(CompatibilityError, match="rows file"):  # resuming onto other rows
        _harvest(target_dir, other_rows, cache_dir, resume=True)
    assert _shard_bytes(cache_dir) == before


def test_top_k_larger_than_the_draft_vocabulary_is_refused(tmp_path, target_dir, rows_file, cache_dir):
    out = tmp_path / "k-too-big"
    with pytest.raises(CompatibilityError, match="--top-k 16 exceeds the draft vocabulary's 8 ids"):
        _harvest(target_dir, rows_file, out, top_k=16, draft_vocab="8")
    assert not out.exists()
    values = cached_recipe(tmp_path, target_dir, rows_file, cache_dir)  # top-8 over the whole vocabulary
    values["model"].update(draft_vocab=4, draft_vocab_from=str(rows_file))
    _refused(values, CompatibilityError, "top-8 per position, more ids than the student's draft vocabulary of 4")
    values["model"]["draft_vocab"] = 16  # k fits, but the cache cannot tell the tail inside the draft ids
    _refused(values, CompatibilityError, "does not tell how much of the rest")


def test_recipe_rules_of_a_cached_run(tmp_path, target_dir, rows_file, cache_dir):
    values = cached_recipe(tmp_path, target_dir, rows_file, cache_dir, temperature=2.0)
    with pytest.raises(RecipeError, match="distill.temperature"):
        recipe_from_dict(values)
    values = cached_recipe(tmp_path, target_dir, rows_file, cache_dir)
    values["data"]["format"] = "text"
    with pytest.raises(RecipeError, match="data.format"):
        recipe_from_dict(values)
    values = cached_recipe(tmp_path, target_dir, tmp_path, cache_dir)  # a folder, not the rows file
    with pytest.raises(RecipeError, match="give exactly the rows file"):
        recipe_from_dict(values)


def test_cli_help_and_one_error_line(tmp_path, target_dir, rows_file):
    help_text = subprocess.run([sys.executable, "-m", "draftforge", "harvest", "logits", "--help"],
                               capture_output=True, text=True, timeout=120).stdout
    assert "--top-k" in help_text and "--resume" in help_text and "float32" in help_text
    proc = subprocess.run([sys.executable, "-m", "draftforge", "harvest", "logits", "--target", str(target_dir),
                           "--data", str(rows_file), "--out", str(tmp_path / "x"), "--top-k", "9999"],
                          capture_output=True, text=True, timeout=300)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "exceeds the target's" in errors[0], proc.stderr[-2000:]
    assert not (tmp_path / "x").exists()


@pytest.mark.slow  # an accelerate launch of two CPU processes
def test_two_processes_write_the_same_cache_as_one(tmp_path, target_dir, rows_file, cache_dir):
    out = tmp_path / "two"
    events = launch_two_processes(tmp_path, "logits", "--target", str(target_dir), "--data", str(rows_file), "--out",
                                  str(out), "--top-k", "8", "--max-len", "64", "--batch-size", "2", "--shard-rows", "5",
                                  "--dtype", "float32")
    assert_split_is_the_single_process_harvest(events, out, cache_dir)
    assert open_cache(out).manifest["complete"]


def test_an_out_holding_someone_elses_files_is_never_written_into(tmp_path, target_dir, rows_file):
    """A run directory (its own draft_vocab.json, recipe.yaml) given as --out: the harvest overwrote its
    draft_vocab.json, and --overwrite deleted it; both are refused now, every byte left."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "draft_vocab.json").write_text("[1, 2, 3]\n")
    (run / "recipe.yaml").write_text("task: sft\n")
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    for flags in ({}, {"overwrite": True}, {"resume": True}):
        with pytest.raises(DataError, match=r"holds files that are not a harvest \(draft_vocab.json, recipe.yaml; "
                                            r"no harvest.json\)"):
            _harvest(target_dir, rows_file, run, **flags)
        assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_a_users_own_file_inside_a_harvest_is_neither_read_nor_deleted(tmp_path, target_dir, rows_file, cache_dir):
    """shard-notes.json beside the shards: --overwrite deleted it (it matched shard-*.json), and --resume read it as a
    shard record; only the harvest's own names (shard-NNNNN.*) are its files. A file under a record's name that is
    not a record crashed --resume (KeyError 'index'); --overwrite deleted a draft_vocab.json the replaced harvest
    never had and shards past its count."""
    import shutil

    out = tmp_path / "cache"
    shutil.copytree(cache_dir, out)
    mine = {"shard-notes.json": '{"note": "mine"}\n', "shard-00001.json": '{"mine": 2}\n', "shard-00002.json": "[1, 2]\n",
            "draft_vocab.json": "[1, 2, 3]\n", "shard-00099.safetensors": "not a shard\n"}
    for name, text in mine.items():
        (out / name).write_text(text)
    _harvest(target_dir, rows_file, out, resume=True)
    assert {name: (out / name).read_text() for name in mine} == mine
    _harvest(target_dir, rows_file, out, overwrite=True)  # it writes its records under its own names, shard-00001.json
    kept = {name: text for name, text in mine.items() if name not in ("shard-00001.json", "shard-00002.json")}
    assert {name: (out / name).read_text() for name in kept} == kept
    theirs = {name: data for name, data in _shard_bytes(out).items() if name not in mine}
    assert theirs == _shard_bytes(cache_dir) and open_cache(out).manifest["complete"]


def test_a_config_edit_a_row_only_labelled_at_its_first_token_and_an_equivalent_draft_map(tmp_path, target_dir,
                                                                                          rows_file, cache_dir):
    # the weights alone named the target: a config.json edited since (here rope_theta) resumed a harvest into
    # another model's states and trained on them; a resume naming the same draft ids as a file was refused
    import shutil

    edited = tmp_path / "edited"
    shutil.copytree(target_dir, edited)
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**config, "rope_theta": 500.0}))
    out = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        _harvest(target_dir, rows_file, out, stop_after=1)
    with pytest.raises(CompatibilityError, match=re.escape(f"config.json ({target_dir} -> {edited}: another model)")):
        _harvest(edited, rows_file, out, resume=True)  # both named (it said only "edited since the harvest started")
    _refused(cached_recipe(tmp_path, edited, rows_file, cache_dir), CompatibilityError, "another config.json")
    drafted = tmp_path / "drafted"
    with pytest.raises(KeyboardInterrupt):
        _harvest(target_dir, rows_file, drafted, draft_vocab="64", stop_after=1)
    shutil.copy(drafted / "draft_vocab.json", tmp_path / "ids.json")
    assert _harvest(target_dir, rows_file, drafted, draft_vocab=str(tmp_path / "ids.json"), resume=True)["complete"]
    empty = tmp_path / "empty.jsonl"  # no position with a loss: refused at the harvest, not at training
    empty.write_text(json.dumps({"input_ids": [5, 6, 7], "loss_mask": [1, 0, 0]}) + "\n")
    with pytest.raises(DataError, match="no row .* has a loss position"):
        _harvest(target_dir, empty, tmp_path / "none")


def test_cached_blocks_are_the_online_blocks_when_a_row_is_labelled_at_its_first_token(tmp_path, target_dir,
                                                                                       tiny_tokenizer_dir):
    # a label at a row's first token is predicted by nothing in the row: online packing kept a row whose only
    # label it was (the cache has no entry for it, so the cached blocks packed differently) and, packed after
    # another row, scored it from that row's last position
    from transformers import AutoTokenizer

    from draftforge.data.pipeline import build_block_data

    rows = tmp_path / "packed.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in [
        {"input_ids": [10, 11, 12, 13, 14, 15], "prompt_len": 2},
        {"input_ids": [20, 21, 22, 23], "loss_mask": [1, 0, 0, 0]},  # its only label is the first token
        {"input_ids": [30, 31, 32, 33, 34, 35, 36], "prompt_len": 0},  # every token labelled, the first too
        {"input_ids": [40, 41, 42, 43, 44], "prompt_len": 1},
        {"input_ids": [50, 51, 52, 53, 54, 55, 56, 57], "prompt_len": 3}]))
    _harvest(target_dir, rows, tmp_path / "cache", max_len=16)
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    cfg = DataConfig(sources=[str(rows)], format="tokens", eval_fraction=0.0)
    online = build_block_data(cfg, tok, 16, 0, len(tok)).train
    cached = cached_block_data(cfg, tok, 16, 0, len(tok), open_cache(tmp_path / "cache")).train
    assert online["input_ids"] == cached["input_ids"] and online["labels"] == cached["labels"]
    assert [b[:7] for b in online["input_ids"]][:2] == [[10, 11, 12, 13, 14, 15, 30], [40, 41, 42, 43, 44, 50, 51]]
    assert online["labels"][0][6] == -100  # row 3's first token, right after row 1's last
    assert sum(t != -100 for b in online["labels"] for t in b) == open_cache(tmp_path / "cache").positions


def test_a_training_start_hashes_only_the_shards_whose_size_or_time_moved(tmp_path, cache_dir, monkeypatch):
    # every start read the whole cache (every process, a cache of terabytes): a shard with the size and time
    # recorded when it was written is taken as written, as a rows file is; one edited since is hashed and named
    import shutil

    import draftforge.data.logits_cache as lc

    copy = tmp_path / "copy"
    shutil.copytree(cache_dir, copy)  # copy2: the times stay
    hashed, real = [], lc.sha256_file
    monkeypatch.setattr(lc, "sha256_file", lambda path: hashed.append(Path(path).name) or real(path))
    LogitsCache(copy)
    assert hashed == []
    shard = copy / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # the same size, another byte
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="shard-00001.safetensors is corrupt"):
        LogitsCache(copy)
    assert hashed == ["shard-00001.safetensors"]


def test_damage_under_a_kept_mtime_is_named_as_a_corrupt_shard(tmp_path, target_dir, rows_file, cache_dir,
                                                                tiny_tokenizer_dir):
    """The quick check takes a shard with its recorded size and mtime as written; damaged in place with the mtime
    restored, a zeroed header said "not a readable safetensors file" with no fix, and zeroed loss positions blamed
    the rows ("the rows changed since the harvest ... (36 vs 36)"). Both now name the shard as corrupt."""
    import os
    import shutil
    import struct

    for damage in ("header", "positions"):
        copy = tmp_path / damage
        shutil.copytree(cache_dir, copy)
        shard = copy / "shard-00001.safetensors"
        data, st = bytearray(shard.read_bytes()), shard.stat()
        (length,) = struct.unpack("<Q", data[:8])
        if damage == "header":
            data[8:16] = bytes(8)
        else:
            begin, end = json.loads(data[8 : 8 + length])["position"]["data_offsets"]
            data[8 + length + begin : 8 + length + end] = bytes(end - begin)
        shard.write_bytes(bytes(data))
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
        with pytest.raises(DataError, match=r"shard-00001.safetensors is corrupt .*; rerun `draftforge harvest "
                                            r"logits` with the same arguments and --resume"):
            _blocks(LogitsCache(copy), rows_file, tiny_tokenizer_dir)


def test_a_resume_removes_the_half_shard_a_killed_write_left(tmp_path, target_dir, rows_file, cache_dir):
    out = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        _harvest(target_dir, rows_file, out, stop_after=1)
    half = out / ".shard-00001.safetensors.tmp"  # killed inside save_file: possibly gigabytes, never a shard
    half.write_bytes(b"x" * 100)
    _harvest(target_dir, rows_file, out, resume=True)
    assert not half.exists() and _shard_bytes(out) == _shard_bytes(cache_dir)


# ---------------------------------------------------------------- the storage estimate, the process split, Ctrl-C

def estimate_comes_first(events: Events, what: str) -> int:
    """The bytes the estimate line names, checked to be in what stderr got before the harvest's first write."""
    import re

    events.flush()
    first = next(i for i, e in enumerate(events) if e[0] != "said")
    before = "".join(e[1] for e in events[:first] if e[0] == "said")
    after = "".join(e[1] for e in events[first:] if e[0] == "said")
    assert f"{what}: will write about" in before, f"not said before the first write {events[first]}: {before!r}"
    assert "will write about" not in after
    number, unit = re.search(r"will write about ([\d,.]+) (B|KiB|MiB) ", before).groups()
    return int(float(number.replace(",", "")) * {"B": 1, "KiB": 2**10, "MiB": 2**20}[unit])


def test_the_cli_says_the_storage_before_it_writes_anything_and_the_shards_take_it(tmp_path, target_dir, rows_file,
                                                                                  monkeypatch, capsys):
    from draftforge.cli import main as cli_main

    out = tmp_path / "cli"
    events = record_writes(monkeypatch, capsys=capsys)
    assert cli_main(["harvest", "logits", "--target", str(target_dir), "--data", str(rows_file), "--out", str(out),
                     "--top-k", "8", "--max-len", "64", "--batch-size", "2", "--shard-rows", "5", "--dtype",
                     "float32", "--draft-vocab", "64"]) == 0
    said = estimate_comes_first(events, "harvest logits")
    assert [e[2] for e in events if e[0] == "shard"] == [0, 1, 2]
    m = open_cache(out).manifest
    assert abs(said - m["storage"]["bytes"]) <= 0.001 * m["storage"]["bytes"]  # the line names the manifest's
    # the data exactly, each shard's header as 1 KiB (these hold a few hundred bytes)
    assert 0.95 < sum(e["bytes"] for e in m["shards"]) / m["storage"]["bytes"] <= 1


def test_a_disk_without_the_room_is_refused_after_the_estimate_with_nothing_written(tmp_path, target_dir, rows_file,
                                                                                    monkeypatch, capsys):
    import collections
    import shutil

    events = record_writes(monkeypatch, capsys=capsys)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: collections.namedtuple("Usage", "total used free")(
        10**9, 10**9 - 1000, 1000))
    out = tmp_path / "full-disk"
    with pytest.raises(DataError, match=r"the harvest needs about [\d.,]+ KiB more, but .* has 1,000 B free"):
        _harvest(target_dir, rows_file, out)
    events.flush()
    assert [e[0] for e in events] == ["said"] and "harvest logits: will write about" in events[0][1]
    assert not out.exists()


def test_two_processes_split_the_rows_once_and_write_the_single_process_cache(tmp_path, target_dir, rows_file,
                                                                              cache_dir, monkeypatch):
    """In-process (threads for the processes): which process wrote which shard is seen, not only the result."""
    out = tmp_path / "two"
    events = harvest_as_two_processes(monkeypatch, lambda: _harvest(target_dir, rows_file, out))
    assert_split_is_the_single_process_harvest(events, out, cache_dir)


def test_a_ctrl_c_inside_a_shard_write_leaves_only_whole_shards_and_resumes_to_the_uninterrupted_bytes(
        tmp_path, target_dir, rows_file, cache_dir, monkeypatch, capsys):
    """Ctrl-C while safetensors writes shard 1 (half of its bytes on disk): no shard-NNNNN file is half-written, the
    cache is refused as incomplete, and --resume keeps shard 0, harvests 1 and 2, and ends with the uninterrupted
    harvest's bytes (`stop_after` stops only between shards, so it cannot tell an atomic write from a plain one)."""
    import safetensors.torch

    real, saves = safetensors.torch.save_file, []

    def killed_in_the_second(tensors, filename, metadata=None):
        saves.append(filename)
        real(tensors, filename, metadata=metadata)
        if len(saves) == 2:
            path = Path(filename)
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
            raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", killed_in_the_second)
    out, want = tmp_path / "killed", _shard_bytes(cache_dir)
    with pytest.raises(KeyboardInterrupt):
        _harvest(target_dir, rows_file, out)
    assert len(saves) == 2  # interrupted inside the second shard's write, the first one finished
    assert _shard_bytes(out) == {"shard-00000.safetensors": want["shard-00000.safetensors"]}
    assert sorted(p.name for p in out.glob("shard-*.json")) == ["shard-00000.json"]
    with pytest.raises(DataError, match=r"incomplete \(1 of 3 shards written\)"):
        open_cache(out)
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    events = record_writes(monkeypatch)
    capsys.readouterr()
    manifest = _harvest(target_dir, rows_file, out, resume=True)
    assert "kept 1 of 3 shards an earlier run wrote" in capsys.readouterr().err
    assert [e[2] for e in events if e[0] == "shard"] == [1, 2]
    assert manifest["complete"] and _shard_bytes(out) == want
    assert [e["sha256"] for e in manifest["shards"]] == [e["sha256"] for e in open_cache(cache_dir).manifest["shards"]]
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
