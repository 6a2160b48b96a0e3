"""Bad inputs the issue-14 sweep (tests/sweep/bad_input_sweep.py) found: each now exits 2 with one
`error:` line naming the fix, without a traceback, and leaves the files as they were."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftforge.cli import main as cli_main


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.is_dir() or p.read_bytes()) for p in sorted(root.rglob("*"))}


def refused(argv: list[str], root: Path, capsys) -> str:
    """Run the CLI in-process: exit 2, one `error:` line, nothing under root changed; returns the line."""
    before = _snapshot(root)
    assert cli_main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert _snapshot(root) == before
    return err[0]


def test_train_without_a_recipe_is_a_one_line_error(tmp_path, capsys):
    line = refused(["train"], tmp_path, capsys)
    assert "needs a recipe file" in line and "--help-recipe" in line


def test_target_prompts_refuses_n_zero_and_an_out_under_a_file(tmp_path, capsys):
    line = refused(["target", "prompts", "--out", str(tmp_path / "p.jsonl"), "-n", "0"], tmp_path, capsys)
    assert "-n" in line and "must be >= 1" in line  # it wrote every prompt before: rows[:n] if n else rows
    (tmp_path / "a_file").write_text("x")
    line = refused(["target", "prompts", "--out", str(tmp_path / "a_file" / "p.jsonl"), "-n", "3"], tmp_path, capsys)
    assert "cannot write the prompts" in line and "--out" in line


@pytest.mark.parametrize("wheel", ["missing.whl", "not_a_wheel.whl"])
def test_smollm2_with_a_bad_wheel_leaves_no_cache_dir(tmp_path, capsys, wheel):
    (tmp_path / "not_a_wheel.whl").write_text("not a zip\n")
    line = refused(["target", "smollm2", "--wheel", str(tmp_path / wheel), "--cache", str(tmp_path / "c" / "d")],
                   tmp_path, capsys)
    assert wheel in line


@pytest.mark.parametrize("flags, want", [
    (["--num-prompts", "0"], "error: --num-prompts must be >= 1, got 0"),
    (["--max-new-tokens", "0"], "error: --max-new-tokens must be >= 1, got 0"),
    (["--threads", "0"], "error: --threads must be >= 1, got 0"),
    (["--out", "{a_file}"], "error: --out {a_file}: {a_file} is a file, not a directory; give --out a directory"),
    (["--testbed", "{a_file}/sub"],
     "error: --testbed {a_file}/sub: {a_file} is a file, not a directory; give --testbed a directory"),
], ids=["num-prompts", "max-new-tokens", "threads", "out-file", "testbed-under-file"])
def test_demo_refuses_bad_flags_before_any_work(tmp_path, capsys, flags, want):
    """These failed after minutes of training (counts) or with a FileExistsError traceback (paths)."""
    (tmp_path / "a_file").write_text("x")
    flags = [f.format(a_file=tmp_path / "a_file") for f in flags]
    argv = ["demo", "--out", str(tmp_path / "out"), "--testbed", str(tmp_path / "tb"), *flags]
    assert refused(argv, tmp_path, capsys) == want.format(a_file=tmp_path / "a_file")


@pytest.mark.parametrize("key", ["model.target", "model.tokenizer"])
def test_a_missing_target_or_tokenizer_dir_is_named_with_its_key(tmp_path, capsys, key, tiny_corpus_dir,
                                                                 tiny_tokenizer_dir):
    """It said "recipe key 'model.tokenizer'" for a missing model.target, with the Hub's "Repo id must be ..."."""
    import yaml

    from tests.train.test_loop import tiny_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir)))
    line = refused(["train", str(recipe), "--set", f"{key}={tmp_path / 'gone'}"], tmp_path, capsys)
    assert f"recipe key '{key}'" in line and f"directory {tmp_path / 'gone'} does not exist" in line
    assert "Repo id" not in line


def test_resume_and_overwrite_together_are_refused(tmp_path, capsys):
    """With a run in output_dir, `--resume --overwrite` resumed without a word."""
    with pytest.raises(SystemExit) as exit_:
        cli_main(["train", str(tmp_path / "r.yaml"), "--resume", "--overwrite"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument --overwrite: not allowed with argument --resume" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())


def test_export_names_a_missing_checkpoint_dir(tmp_path, capsys):
    """It said "checkpoint X is unusable: manifest.json is missing" about a directory that does not exist."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text("task: pretrain\n")
    line = refused(["export", str(run), "--out", str(tmp_path / "x"), "--checkpoint", str(run / "nope")], tmp_path,
                   capsys)
    assert f"--checkpoint {run / 'nope'} is not a directory" in line and "manifest" not in line


@pytest.mark.parametrize("setup, want", [
    (lambda out: (out / "sft_distill.jsonl").write_text("my rows\n"),
     "sft_distill.jsonl not written by a draftforge demo"),
    (lambda out: (out / "summary.json").write_text('{"mine": 1}'), "summary.json not written by a draftforge demo"),
    (lambda out: ((out / "drafter-sft").mkdir(), (out / "drafter-sft" / "notes.txt").write_text("x")),
     "drafter-sft/ not written by a draftforge demo"),
    (lambda out: ((out / "eval").mkdir(), (out / "eval" / "report.md").write_text("# mine")),
     "holds report.md that draftforge eval did not write"),
], ids=["rows", "summary", "run-dir", "eval-report"])
def test_demo_refuses_an_out_holding_files_it_would_replace_before_any_work(tmp_path, capsys, setup, want):
    """These were overwritten (rows, summary) or refused only after both drafters had trained (eval/, run dir)."""
    out = tmp_path / "out"
    out.mkdir()
    setup(out)
    line = refused(["demo", "--out", str(out), "--testbed", str(tmp_path / "tb")], tmp_path, capsys)
    assert want in line
