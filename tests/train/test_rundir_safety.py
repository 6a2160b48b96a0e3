"""--overwrite only ever replaces a run draftforge wrote: a folder of the user's own files, the current directory,
its parents, home and / are refused (with or without --overwrite), and nothing of theirs is touched."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftforge.errors import DraftforgeError
from draftforge.recipe import recipe_from_dict
from draftforge.train import run
from draftforge.train.rundir import RUN_ENTRIES, RUN_MARKER, foreign_entries, is_run_dir
from tests.train.test_loop import tiny_recipe


def test_run_entries_name_what_each_module_writes():
    from draftforge.train.best import AT_CHECKPOINT_DIR, BEST_DIR
    from draftforge.train.c2t import HARVEST_FILE
    from draftforge.train.lm import DRAFT_VOCAB_FILE
    from draftforge.train.rundir import INPUTS_FILE, MARKER

    assert {AT_CHECKPOINT_DIR, BEST_DIR, HARVEST_FILE, DRAFT_VOCAB_FILE, INPUTS_FILE, MARKER, RUN_MARKER} <= RUN_ENTRIES


def _users_folder(path: Path) -> dict[str, str]:
    (path / "data").mkdir(parents=True)
    files = {"my_code.py": "print('mine')\n", "data/notes.txt": "keep me\n"}
    for name, text in files.items():
        (path / name).write_text(text)
    return files


def _unchanged(path: Path, files: dict[str, str]) -> bool:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()) == sorted(files) and all(
        (path / n).read_text() == t for n, t in files.items())


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_of_the_users_files_is_refused_and_kept(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, overwrite):
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=1)
    files = _users_folder(Path(values["output_dir"]))
    with pytest.raises(DraftforgeError, match=r"holds files draftforge did not write \(data/, my_code.py\).*not "
                                              r"even with --overwrite"):
        run(recipe_from_dict(values), overwrite=overwrite)
    assert _unchanged(Path(values["output_dir"]), files)


def test_a_run_is_marked_and_replaced_with_overwrite(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    """Every entry a run writes (export, best/, tensorboard logs, ...) is one RUN_ENTRIES names, so --overwrite
    replaces it; a file of the user's beside them stops --overwrite (it was deleted with the run) and is kept."""
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=2, eval_every=1, export=True,
                         keep_best="loss", trackers=["tensorboard"])
    first = run(recipe_from_dict(values))
    assert (first.run_dir / RUN_MARKER).is_file() and is_run_dir(first.run_dir)
    written = {p.name for p in first.run_dir.iterdir()}
    assert {"export", "best", "logs", "checkpoints"} <= written and foreign_entries(first.run_dir) == []
    (first.run_dir / ".export.tmp-k1ll3d").mkdir()  # a killed export's temp dir is the run's own, replaced with it
    (first.run_dir / ".metrics.jsonl.x7.tmp").write_text("")
    assert run(recipe_from_dict(values), overwrite=True).step == 2
    (first.run_dir / "analysis.md").write_text("my notes\n")
    (first.run_dir / "plots").mkdir()
    with pytest.raises(DraftforgeError, match=r"replacing the run in .* would delete analysis.md, plots/, which it "
                                              r"did not write"):
        run(recipe_from_dict(values), overwrite=True)
    assert (first.run_dir / "analysis.md").read_text() == "my notes\n" and (first.run_dir / "plots").is_dir()


def test_resume_never_takes_over_a_users_folder_that_holds_a_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    """A folder with the user's own recipe.yaml (and notes): --resume overwrote the recipe and marked the folder a
    run, which a later --overwrite then deleted."""
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=1)
    files = _users_folder(Path(values["output_dir"]))
    files["recipe.yaml"] = "# my annotated recipe\ntask: pretrain\n"
    (Path(values["output_dir"]) / "recipe.yaml").write_text(files["recipe.yaml"])
    with pytest.raises(DraftforgeError, match=r"holds a recipe.yaml but is not a run draftforge wrote"):
        run(recipe_from_dict(values), resume=True)
    assert _unchanged(Path(values["output_dir"]), files)


@pytest.mark.parametrize("where", ["cwd", "parent", "home"])
def test_overwrite_never_replaces_the_current_directory_its_parents_or_home(
        tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, monkeypatch, where):
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=1)
    done = run(recipe_from_dict(values)).run_dir  # a real run, so only the location can be the reason
    inside = done / "sub"
    inside.mkdir()
    monkeypatch.chdir(inside if where == "parent" else done)
    if where == "home":
        monkeypatch.setenv("HOME", str(done))
        monkeypatch.chdir(tmp_path)
    output_dir = {"cwd": ".", "parent": "..", "home": str(done)}[where]
    why = {"cwd": "the current directory", "parent": "a parent of the current directory", "home": "your home"}[where]
    before = sorted(p.name for p in done.iterdir())
    with pytest.raises(DraftforgeError, match=f"--overwrite would replace .*, {why}"):
        run(recipe_from_dict({**values, "output_dir": output_dir}), overwrite=True)
    assert sorted(p.name for p in done.iterdir()) == before


def test_a_users_folder_where_the_old_run_would_be_set_aside_is_not_deleted(
        tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=1)
    run(recipe_from_dict(values))
    aside = tmp_path / ".run.replaced"
    files = _users_folder(aside)
    with pytest.raises(DraftforgeError, match=r"\.run\.replaced is in the way of --overwrite"):
        run(recipe_from_dict(values), overwrite=True)
    assert _unchanged(aside, files) and is_run_dir(tmp_path / "run")


@pytest.mark.parametrize("flags", [{}, {"resume": True}, {"overwrite": True}])
def test_a_second_run_on_a_directory_being_trained_is_refused(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, flags):
    """Two `draftforge train` on one output_dir (a relaunch while the first still runs) interleaved their
    checkpoints, and --overwrite moved the live run's directory aside. A live run's lock refuses the second with
    the directory untouched; a killed run's lock is taken over, and a finished run leaves none."""
    import json
    import os
    import socket
    import subprocess

    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=1)
    out = Path(values["output_dir"])
    run(recipe_from_dict(values))
    before = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    lock = out.with_name(f".{out.name}.lock")  # a first run still training: this process, by its lock's record
    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "what": "draftforge train",
                                "started": "then"}))
    with pytest.raises(DraftforgeError, match=rf"{out.name} is being written by another draftforge train \(pid "
                                              rf"{os.getpid()}, started then\)"):
        run(recipe_from_dict({**values, "train": {**values["train"], "max_steps": 2}}), **flags)
    assert {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert lock.exists()  # the first run's lock is its own to remove
    gone = subprocess.Popen(["true"])
    gone.wait()
    lock.write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname()}))
    assert run(recipe_from_dict({**values, "train": {**values["train"], "max_steps": 2}}), resume=True).step == 2
    assert not lock.exists()


@pytest.mark.parametrize("fail", [False, True])
def test_overwrite_through_a_link_replaces_the_run_it_points_at_and_keeps_the_link(
        tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, monkeypatch, fail):
    """output_dir a link to a run: --overwrite renamed the link itself to beside the run (outside output_dir's
    folder, a stray `.run.replaced` link), made a fresh directory where the link was, and the next replace died on
    rmtree of that link. Now the run moves aside and comes back (a failed start) or goes (the first checkpoint)."""
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=1)
    real = Path(values["output_dir"])
    run(recipe_from_dict(values))
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    values["output_dir"] = str(link)
    if fail:
        from draftforge.train import loop

        def boom(self, *a, **k):
            raise RuntimeError("killed before the first checkpoint")

        monkeypatch.setattr(loop.Trainer, "save", boom)
        with pytest.raises(RuntimeError, match="killed"):
            run(recipe_from_dict(values), overwrite=True)
    else:
        for _ in range(2):  # the second replace died on rmtree of the stray link
            assert run(recipe_from_dict(values), overwrite=True).step == 1
    assert link.is_symlink() and link.resolve() == real.resolve() and is_run_dir(real)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # nothing left aside
