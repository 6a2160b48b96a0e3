"""Token ids know their tokenizer: `draftforge generate` writes ROWS.meta.json before its rows; training and the
harvests refuse ids of another tokenizer in one line naming both sides, before any model trains; rows with no
record (made outside draftforge) are used with a one-line notice; a resume with another tokenizer or target
is refused with nothing appended."""

from __future__ import annotations

import json
import types

import pytest
import torch

from draftforge.cli import main as cli_main
from draftforge.data import build_block_data
from draftforge.data.generate import chat_jobs, generate_rows, jobs_fingerprint
from draftforge.data.provenance import OUTSIDE, sidecar_path
from draftforge.errors import CompatibilityError, DataError
from draftforge.export import tokenizer_fingerprint
from draftforge.models.cali_ts import model_fingerprint
from tests.data.common import data_cfg, write_jsonl
from tests.fixtures.decode import tiny_llama, tiny_mamba2


def _llama(vocab: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
                      eos_token_id=0, pad_token_id=1)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def target(tok):
    """A tiny random Llama over make_tokenizer's ids (the same tokenizer as `tok`, without the template)."""
    return _llama(len(tok))


@pytest.fixture
def other_tok(tiny_tokenizer_dir):
    """Another tokenizer (512 tokens, its own merges), loaded from a directory: its name is that path."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture
def jobs(chat_tok, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    write_jsonl(prompts, [{"prompt_id": f"p{i}", "messages": [{"role": "user", "content": q}]}
                          for i, q in enumerate(["What is a list?", "Write add(a, b).", "Hi"])])
    return chat_jobs(prompts, chat_tok, context=96, max_new_tokens=6)


@pytest.fixture
def rows(target, chat_tok, jobs, tmp_path):
    """`draftforge generate` rows of `target` with chat_tok, alone in a folder (so a folder source sees them)."""
    out = tmp_path / "rows" / "rows.jsonl"
    generate_rows(target, chat_tok, jobs, out, temperatures=[0], max_new_tokens=6, target="tiny/target")
    return out


def _one_line(err: Exception) -> str:
    msg = str(err)
    assert "\n" not in msg
    return msg


def test_generate_writes_the_sidecar(rows, target, chat_tok, jobs):
    meta = json.loads(sidecar_path(rows).read_text())
    assert sidecar_path(rows).name == "rows.jsonl.meta.json"
    devices = meta.get("devices", [])
    assert len(devices) == 1 and devices[0].startswith("cpu: ")  # where the rows were computed (kernels round)
    assert meta == {"tokenizer": None, "tokenizer_fingerprint": tokenizer_fingerprint(chat_tok),
                    "target": "tiny/target", "target_fingerprint": model_fingerprint(target),
                    "written_by": "draftforge generate", "version": 1,
                    "settings": {"max_new_tokens": 6, "seed": 0, "batch_size": 8, "dtype": "float32"},
                    "jobs_sha256": jobs_fingerprint(jobs), "devices": devices}
    assert len(rows.read_text().splitlines()) == 3


def test_training_data_checks_the_rows_tokenizer(rows, chat_tok, other_tok, tiny_tokenizer_dir, capsys):
    for source in (rows, rows.parent):  # a folder source reads the rows, not their sidecar
        bd = build_block_data(data_cfg([source], format="tokens"), chat_tok, 32, seed=0)
        assert bd.stats["documents"] == 3
        assert "notice" not in capsys.readouterr().err
        with pytest.raises(DataError) as e:
            build_block_data(data_cfg([source], format="tokens"), other_tok, 32, seed=0)
        msg = _one_line(e.value)
        assert str(rows) in msg and "regenerate the rows" in msg and "tiny/target" in msg
        assert tokenizer_fingerprint(chat_tok)[:12] in msg and tokenizer_fingerprint(other_tok)[:12] in msg
        assert str(tiny_tokenizer_dir) in msg  # the recipe's side, by name
    from draftforge.train.lm import row_labels  # model.draft_vocab_from counts ids of such rows: checked too

    assert len(list(row_labels(str(rows), chat_tok))) == 3
    with pytest.raises(DataError, match="regenerate the rows"):
        row_labels(str(rows), other_tok)


def test_rows_without_a_sidecar_are_used_with_one_notice(tmp_path, chat_tok, capsys):
    plain = write_jsonl(tmp_path / "outside.jsonl", [{"input_ids": [5, 6, 7, 8], "prompt_len": 1}] * 2)
    bd = build_block_data(data_cfg([plain], format="tokens"), chat_tok, 16, seed=0)
    assert bd.stats["documents"] == 2
    notices = [line for line in capsys.readouterr().err.splitlines() if "notice" in line]
    assert len(notices) == 1 and str(plain) in notices[0] and OUTSIDE in notices[0]


def test_a_run_with_another_tokenizer_stops_before_training(rows, chat_tok, tiny_tokenizer_dir, tmp_path, capsys):
    chat_tok.save_pretrained(tmp_path / "tok")  # the rows' own tokenizer, saved: the same fingerprint
    recipe = {"task": "pretrain", "output_dir": str(tmp_path / "run"),
              "model": {"arch": "mamba2", "size": "tiny", "tokenizer": str(tiny_tokenizer_dir),
                        "overrides": {"hidden_size": 32, "num_hidden_layers": 2, "head_dim": 16, "state_size": 8}},
              "data": {"sources": [str(rows)], "format": "tokens", "eval_fraction": 0.0},
              "train": {"max_steps": 1, "global_batch_size": 2, "micro_batch_size": 2, "block_size": 32,
                        "eval_every": 0, "save_every": 0, "trackers": [], "export": False}}
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe))
    assert cli_main(["train", str(path)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and tokenizer_fingerprint(chat_tok)[:12] in errors[0]
    assert not (tmp_path / "run").exists()  # refused before any model was built or trained
    assert cli_main(["train", str(path), "--set", f"model.tokenizer={tmp_path / 'tok'}"]) == 0


def test_resume_with_another_tokenizer_or_target_is_refused_and_nothing_appended(rows, target, chat_tok, other_tok,
                                                                                  jobs):
    with open(rows, "a") as f:
        f.write('{"input_ids": [1, 2')  # a killed run's torn last line: a refused resume must not trim it either
    before = rows.read_bytes(), sidecar_path(rows).read_bytes()
    kw = dict(temperatures=[0, 1.0], max_new_tokens=6)
    with pytest.raises(DataError) as e:
        generate_rows(target, other_tok, jobs, rows, **kw)
    msg = _one_line(e.value)
    assert "(another tokenizer)" in msg and "another --out" in msg and "--target tiny/target" in msg
    assert tokenizer_fingerprint(chat_tok)[:12] in msg and tokenizer_fingerprint(other_tok)[:12] in msg
    with pytest.raises(DataError, match=r"\(another target\)"):
        generate_rows(_llama(len(chat_tok), seed=1), chat_tok, jobs, rows, **kw)
    assert (rows.read_bytes(), sidecar_path(rows).read_bytes()) == before
    stats = generate_rows(target, chat_tok, jobs, rows, target="tiny/target", **kw)  # the same pair resumes
    assert stats.skipped == 3 and stats.rows == 3 and sidecar_path(rows).read_bytes() == before[1]


def test_resume_into_rows_without_a_sidecar_appends_with_a_notice(target, chat_tok, jobs, tmp_path, capsys):
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"input_ids": [5, 6], "prompt_len": 1, "prompt_id": "p0",
                                                    "temperature": 0.0}])
    stats = generate_rows(target, chat_tok, jobs, plain, temperatures=[0], max_new_tokens=4)
    assert stats.rows == 2 and not sidecar_path(plain).exists()  # no record vouching for rows it never saw
    assert sum("notice" in line for line in capsys.readouterr().err.splitlines()) == 1


# ---------------------------------------------------------------- harvests

def _fake(model, tokenizer=None):
    return types.SimpleNamespace(model=model, tokenizer=tokenizer)


def _save_target(model, tokenizer, out):
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def test_c2t_harvest_records_and_checks_the_tokenizer(target, chat_tok, other_tok, tmp_path):
    from draftforge.harvest import c2t as hv
    from draftforge.recipe import recipe_from_dict
    from draftforge.train import run

    out = tmp_path / "h"
    meta = hv.harvest_meta(_fake(target, chat_tok), _fake(target), hv.HarvestSettings(), "bench")
    assert meta["tokenizer_fingerprint"] == tokenizer_fingerprint(chat_tok)
    hv.open_harvest(out, meta)
    other_meta = hv.harvest_meta(_fake(target, other_tok), _fake(target), hv.HarvestSettings(), "bench")
    with pytest.raises(CompatibilityError, match="another tokenizer_fingerprint"):
        hv.open_harvest(out, other_meta)
    shard = {c: [v] for c, v in zip(hv.COLUMNS, ["p0/0", "p0", 0, -1, 0.5, 0.1, 1, 1, meta["target"],
                                                    meta["drafter"]])}
    hv.write_shard(shard, hv.shard_path(out, 0))
    assert len(hv.load_harvest([out], tokenizer=chat_tok)) == 1
    with pytest.raises(DataError) as e:
        hv.load_harvest([out], tokenizer=other_tok)
    msg = _one_line(e.value)
    assert str(out) in msg and tokenizer_fingerprint(chat_tok)[:12] in msg and tokenizer_fingerprint(other_tok)[:12] in msg
    t_dir = _save_target(target, other_tok, tmp_path / "target")  # the recipe's target, with another tokenizer
    recipe = {"task": "c2t", "output_dir": str(tmp_path / "run"), "model": {"target": str(t_dir)},
              "data": {"sources": [str(out)]}, "train": {"max_steps": 1, "trackers": []}}
    with pytest.raises(DataError, match="harvest again"):
        run(recipe_from_dict(recipe))
    assert not (tmp_path / "run").exists()


def test_theta_harvest_checks_its_rows_and_records_the_tokenizer(rows, chat_tok, other_tok, tmp_path):
    from draftforge.harvest.cali_ts import harvest_theta, load_harvest
    from draftforge.recipe import recipe_from_dict
    from draftforge.train import run

    model = tiny_llama(vocab=len(chat_tok))
    good, bad = _save_target(model, chat_tok, tmp_path / "t-good"), _save_target(model, other_tok, tmp_path / "t-bad")
    d_dir = _save_target(tiny_mamba2(vocab=len(chat_tok)), chat_tok, tmp_path / "drafter")
    kw = {"max_offset": 2, "anchor_stride": 4, "progress": False}
    with pytest.raises(DataError) as e:  # rows of chat_tok for a target of another tokenizer
        harvest_theta(bad, d_dir, [str(rows)], tmp_path / "h-bad", allow_vocab_mismatch=True, **kw)
    assert str(rows) in _one_line(e.value) and "--target tiny/target" in str(e.value)
    assert not (tmp_path / "h-bad").exists()
    manifest = harvest_theta(good, d_dir, [str(rows)], tmp_path / "h", **kw)
    assert manifest["tokenizer_fingerprint"] == tokenizer_fingerprint(chat_tok) and manifest["rows"] > 0
    assert len(load_harvest(tmp_path / "h", tokenizer=chat_tok)[0]) == manifest["rows"]
    with pytest.raises(DataError) as e:
        load_harvest(tmp_path / "h", tokenizer=other_tok)
    assert tokenizer_fingerprint(other_tok)[:12] in _one_line(e.value)
    recipe = {"task": "theta", "output_dir": str(tmp_path / "run"), "model": {"target": str(bad)},
              "data": {"sources": [str(tmp_path / "h")]}, "train": {"max_steps": 1, "trackers": []}}
    with pytest.raises(DataError, match="harvest again"):
        run(recipe_from_dict(recipe))
    assert not (tmp_path / "run").exists()
