"""The run directory's life: checked before anything is built, written only once the run can start.

`check` (every process, read-only) decides what the run will do with `output_dir`; nothing is
written until `claim`, which the loop calls after the recipe, the data and the model were built.
With --overwrite the previous run is moved aside at `claim`, removed once the new run has committed
its first checkpoint (`settle`), and put back if the new run fails before that (`abandon`). A run
killed before its first checkpoint resumes from step 0 with --resume.

--overwrite only ever replaces a run draftforge wrote: a directory is a run when it holds RUN_MARKER
(written at `claim`) or, for runs from before that marker, the checkpoint marker, and it is replaced
only when it holds nothing but what a run writes (RUN_ENTRIES). Anything else is refused with or
without --overwrite (and --resume takes over no directory without the marker), and the current
directory, its parents, the home directory and / are refused outright.

One run writes an output_dir at a time: `run_lock` holds `.NAME.lock` beside it for the whole run (a second
`draftforge train` on the same directory, with or without --resume/--overwrite, is refused in one line).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import yaml

from draftforge.errors import CheckpointError, DraftforgeError
from draftforge.fsutil import shared_lock, some_entries
from draftforge.recipe import dump_recipe, recipe_from_dict
from draftforge.train import checkpoint as ckpt

NEW, REPLACE, RESUME, RESTART = "new", "replace", "resume", "restart"
EXTENSIBLE_KEYS = {"train.max_steps"}  # may change on --resume: recorded in history.jsonl, the schedule recomputed
MARKER = ".has-checkpoints"  # written beside recipe.yaml at the first checkpoint
RUN_MARKER = ".draftforge-run"  # written at claim: this directory is a run draftforge made


# Every top-level entry a run writes in its output_dir (cli_train's EPILOG lists them for users; best.py, lm.py and
# c2t.py name theirs): --overwrite replaces a run only when it holds nothing else, so a user's notes.txt or analysis/
# beside the run is never deleted with it
RUN_ENTRIES = frozenset({RUN_MARKER, MARKER, "recipe.yaml", "inputs.json", "metrics.jsonl", "history.jsonl",
                         "checkpoints", "export", "best", ".best-at-checkpoint", "logs", "draft_vocab.json",
                         "c2t_harvest.json"})


def _written_by_a_run(name: str) -> bool:
    """One of RUN_ENTRIES, or what a killed write left beside one (fsutil's temp names: .export.tmp-XXXX,
    .best.old-XXXX, .recipe.yaml.XXXX.tmp)."""
    return name in RUN_ENTRIES or (name.startswith(".") and any(name[1:].startswith(f"{e}.") for e in RUN_ENTRIES))


def foreign_entries(path: Path) -> list[str]:
    """The entries of a run directory that no run writes (the user's own), sorted."""
    return sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir() if not _written_by_a_run(p.name))


def is_run_dir(path: Path) -> bool:
    """A directory draftforge wrote as a run (the only kind --overwrite may replace)."""
    return path.is_dir() and ((path / RUN_MARKER).is_file() or (path / MARKER).is_file())


def run_lock(output_dir, acc):
    """Hold the run's lock (`.NAME.lock` beside output_dir) for the block, every process told whether the main one
    took it. Two runs on one directory interleaved their checkpoints and metrics, and an --overwrite moved the other
    run's directory aside under it."""
    def share(problem):
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([problem])[0]

    return shared_lock(output_dir, "draftforge train", acc.is_main_process, share if acc.num_processes > 1 else None)


def _protected(path: Path) -> str | None:
    """Why `path` may never be replaced (the current directory, a parent of it, home, /), else None."""
    here, home, target = Path.cwd().resolve(), Path.home().resolve(), path.resolve()
    if target == Path(target.anchor):
        return "the filesystem root"
    if target == here or target in here.parents:
        return "the current directory" if target == here else "a parent of the current directory"
    if target == home or target in home.parents:
        return "your home directory" if target == home else "a parent of your home directory"
    return None


def _aside(path: Path) -> Path:
    """Where --overwrite keeps the replaced run until the new one has a checkpoint."""
    resolved = path.resolve()
    return resolved.with_name(f".{resolved.name}.replaced")


INPUTS_FILE = "inputs.json"  # what the run read (recipe_inputs): weight files, data files, caches, fingerprinted
_END = 1 << 16


def quick_fingerprint(path: Path) -> dict:
    """A file's size and the sha256 of its first and last 64 KiB: cheap for a 16 GB checkpoint or a folder of
    thousands of shards, and it changes when the file is replaced by another (a safetensors header and a JSONL's
    first rows sit at the start). An edit in the middle that keeps the size is not seen."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(_END))
        if size > 2 * _END:
            f.seek(size - _END)
            h.update(f.read(_END))
    return {"size": size, "sha256_ends": h.hexdigest()}


def changed_inputs(run_dir: Path, recipe, who: str) -> list[str]:
    """The inputs (recipe_inputs' keys) whose files differ from what the run in `run_dir` recorded when it started
    (its INPUTS_FILE); [] for a run that recorded none. `who` names the command in the error for an unreadable
    record."""
    import json

    saved = Path(run_dir) / INPUTS_FILE
    if not saved.is_file():
        return []
    try:
        old = json.loads(saved.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{who}: {saved} is not readable JSON ({e}); it records what the run trained on: "
                              "start a new output_dir, or remove it to go on unchecked") from None
    old, now = _by_file(old), _by_file(recipe_inputs(recipe))  # a path spelt another way is the same input
    # an input the run did not record (it started before draftforge recorded that kind) is not checked
    return sorted(k for k in old if old[k] != now.get(k))


def _by_file(inputs: dict) -> dict:
    """recipe_inputs' entries keyed "KEY PATH" with PATH resolved (runs/demo/testbed/x and the cache it links to are
    one input), so a resume that spells a path another way is checked against what the run recorded."""
    def key(k: str) -> str:
        name, _, path = k.partition(" ")
        try:
            return f"{name} {Path(path).expanduser().resolve()}" if path else k
        except (OSError, RuntimeError, ValueError):
            return k

    return {key(k): v for k, v in inputs.items()}


# recipe keys naming files or folders a run reads, besides model.target, model.init_from and data.sources
INPUT_KEYS = ("data.eval_sources", "model.draft_vocab_from", "distill.logits_cache", "eagle3.hidden_cache",
              "eesd.open_sources")


def recipe_inputs(recipe) -> dict:
    """model.target's and model.init_from's weight files, and every local file (a folder's files) of data.sources
    and INPUT_KEYS, fingerprinted; a Hub name or a glob is not a file here and is left out."""
    def files(root: Path) -> dict:
        if root.is_file():
            return {"": quick_fingerprint(root)}
        return {str(f.relative_to(root)): quick_fingerprint(f) for f in sorted(root.rglob("*")) if f.is_file()}

    def weights(root: Path) -> dict:
        return {f.name: quick_fingerprint(f) for f in sorted(root.glob("*.safetensors"))}

    out = {}
    target = getattr(recipe.model, "target", None)
    if target and Path(target).expanduser().is_dir():
        out["model.target"] = weights(Path(target).expanduser())
    init = Path(str(recipe.model.init_from or "")).expanduser()
    if recipe.model.init_from and init.is_dir():
        out["model.init_from"] = weights(init if any(init.glob("*.safetensors")) else init / "export")  # run dir
    for src in recipe.data.sources:
        path = Path(str(src)).expanduser()
        if path.exists():
            out[f"data.sources {src}"] = files(path)
    values = ckpt.flatten(recipe.to_dict())
    for key in INPUT_KEYS:
        paths = values.get(key) or []
        for src in [paths] if isinstance(paths, str) else paths:
            path = Path(str(src)).expanduser()
            if path.exists():
                out[f"{key} {src}"] = files(path)
    return out


def as_read_now(saved: dict) -> dict:
    """A run's saved recipe as this draftforge reads it: fields added since it was written take their defaults, so
    they are not differences (a run made before a task gained an option resumes). A saved recipe this version can
    no longer read is compared as it is (and its differences named)."""
    try:
        return recipe_from_dict(saved).to_dict()
    except DraftforgeError:
        return saved


class RunDir:
    def __init__(self, recipe, acc, *, resume: bool, overwrite: bool):
        self.recipe, self.acc, self.path = recipe, acc, Path(recipe.output_dir)
        self.changes: dict[str, list] = {}  # key -> [saved, now]: what a resumed run changed (EXTENSIBLE_KEYS)
        self.resume_from: Path | None = None  # the newest intact checkpoint a resumed run continues from
        self.mode = self._check(resume, overwrite)
        self.aside: Path | None = None
        self.real: Path = self.path  # output_dir with links resolved, from claim() on
        self.claimed = False  # claim() wrote the run's first files
        self.created = False  # this run made the directory (so abandoning removes it)
        self.checkpointed = False  # set once the run has a checkpoint: from then on it resumes, never abandons

    def _check(self, resume: bool, overwrite: bool) -> str:
        saved = self.path / "recipe.yaml"
        if resume:
            if not saved.is_file():
                raise CheckpointError(f"--resume: {self.path} holds no run (no recipe.yaml); start without --resume")
            if not is_run_dir(self.path):  # a user's folder that happens to hold a recipe.yaml: never taken over
                raise CheckpointError(f"--resume: {self.path} holds a recipe.yaml but is not a run draftforge wrote "
                                      f"(no {RUN_MARKER}); draftforge never writes into it: choose another output_dir")
            saved_values = as_read_now(yaml.safe_load(saved.read_text()))
            diff = ckpt.recipe_differences(saved_values, self.recipe.to_dict())
            extended = [k for k in diff if k in EXTENSIBLE_KEYS]
            diff = [k for k in diff if k not in EXTENSIBLE_KEYS]
            if diff:
                raise CheckpointError(f"--resume: the recipe differs from the run in {self.path} in "
                                      f"{', '.join(diff)}; resume with the same recipe or use a new output_dir "
                                      f"(a resumed run may change only {', '.join(sorted(EXTENSIBLE_KEYS))} and "
                                      "the cadence fields: eval/save/log_every, keep_checkpoints, trackers, export)")
            old, new = ckpt.flatten(saved_values), ckpt.flatten(self.recipe.to_dict())
            self.changes = {k: [old.get(k), new.get(k)] for k in extended}
            self._check_inputs()
            if ckpt.list_checkpoints(self.path):
                # the step the run continues from is its newest *intact* checkpoint's (a damaged newer one is
                # skipped, and said so once, here), so an extension is checked against it and history records it
                self.resume_from = ckpt.latest_valid(self.path, warn=self.acc.print)
                reached = self.reached()
                if "train.max_steps" in self.changes and self.recipe.train.max_steps <= reached:
                    raise CheckpointError(f"--resume: train.max_steps {self.recipe.train.max_steps} is not past step "
                                          f"{reached}, which the run in {self.path} has reached; give a larger value")
                return RESUME
            if (self.path / MARKER).exists():  # not a run killed early: its checkpoints were removed
                raise CheckpointError(f"--resume: no checkpoint in {self.path / 'checkpoints'}, although this run "
                                      "wrote some (were they deleted?); start again with --overwrite")
            return RESTART
        if self.path.exists() and not self.path.is_dir():
            raise DraftforgeError(f"output_dir {self.path} exists and is not a directory; choose another output_dir")
        if self.path.is_dir() and any(self.path.iterdir()):
            if not is_run_dir(self.path):
                raise DraftforgeError(f"output_dir {self.path} holds files draftforge did not write "
                                      f"({some_entries(self.path)}); draftforge never replaces them, not even with "
                                      "--overwrite: choose another output_dir")
            if not overwrite:
                raise DraftforgeError(f"output directory {self.path} already holds a run; pass --resume to continue "
                                      "it, --overwrite to replace it, or choose another output_dir")
            why = _protected(self.path)
            if why:
                raise DraftforgeError(f"--overwrite would replace {self.path}, {why}; draftforge never does: "
                                      "choose another output_dir")
            theirs = foreign_entries(self.path)
            if theirs:
                raise DraftforgeError(f"replacing the run in {self.path} would delete {', '.join(theirs[:5])}"
                                      f"{', ...' if len(theirs) > 5 else ''}, which it did not write; move them out "
                                      "first, or choose another output_dir")
            aside = _aside(self.path)
            if aside.exists() and not is_run_dir(aside):
                raise DraftforgeError(f"{aside} is in the way of --overwrite (it is not a run draftforge set "
                                      "aside); move it, then run again")
            return REPLACE
        return NEW

    def reached(self) -> int:
        """The step of the checkpoint a resumed run continues from."""
        return int(self.resume_from.name[len(ckpt.PREFIX):])

    def _check_inputs(self) -> None:
        """A resumed run reads what it started on: the same recipe paths can hold another target's weights or other
        rows (a run made before inputs.json was written is not checked)."""
        changed = changed_inputs(self.path, self.recipe, "--resume")
        if changed:
            raise CheckpointError(f"--resume: {'; '.join(changed)} changed since the run in {self.path} started "
                                  f"(another file, or other content, at the same path: {INPUTS_FILE} records them); "
                                  "resume with what it trained on, or start a new output_dir")

    def claim(self, files: dict[str, str] | None = None) -> None:
        """Write the run's first files (main process); a replaced run is moved aside, not deleted yet."""
        self.acc.wait_for_everyone()  # every process has checked before the main process writes
        if self.acc.is_main_process:
            # output_dir may be a link to the run: the run is what moves aside and is made anew, the link stays
            # (renaming the link put it beside the run, outside output_dir's folder, and rmtree then failed on it)
            self.real = self.path.resolve()
            if self.mode == REPLACE:
                self.aside = _aside(self.path)
                if self.aside.exists():  # a run set aside by one killed before its first checkpoint (checked)
                    shutil.rmtree(self.aside)
                self.real.rename(self.aside)
            self.created = not self.real.exists()
            self.real.mkdir(parents=True, exist_ok=True)
            (self.path / RUN_MARKER).write_text("a draftforge training run: `draftforge train --overwrite` may "
                                                "replace this directory\n")
            if self.mode != RESUME:
                import json

                (self.path / "recipe.yaml").write_text(dump_recipe(self.recipe))
                (self.path / INPUTS_FILE).write_text(json.dumps(recipe_inputs(self.recipe), indent=1) + "\n")
            elif self.changes:
                self._record_changes()
            for name, text in (files or {}).items():
                (self.path / name).write_text(text)
        self.claimed = True
        self.acc.wait_for_everyone()

    def _record_changes(self) -> None:
        """A resumed run that changed max_steps: say what happens to the learning rate, append the change to
        history.jsonl, and make recipe.yaml the recipe the run now follows (a later --resume compares with it)."""
        import dataclasses
        import json
        import time

        from draftforge.fsutil import atomic_write_text
        from draftforge.train.optim import lr_lambda

        reached = self.reached()
        note = ""
        if "train.max_steps" in self.changes:
            before, after = self.changes["train.max_steps"]
            was = dataclasses.replace(self.recipe, train=dataclasses.replace(self.recipe.train, max_steps=before))
            lr = self.recipe.optim.lr
            note = (f"train.max_steps {before} -> {after}: the {self.recipe.optim.schedule} learning-rate schedule is "
                    f"recomputed over {after} steps (warm-up unchanged), so at step {reached} the learning rate "
                    f"moves from {lr * lr_lambda(was)(reached):.3g} to {lr * lr_lambda(self.recipe)(reached):.3g}")
            self.acc.print(f"[draftforge] --resume: {note}")
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "resumed_at_step": reached, "changed": self.changes,
                 "note": note}
        with open(self.path / "history.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
        atomic_write_text(self.path / "recipe.yaml", dump_recipe(self.recipe))

    def settle(self) -> None:
        """The run has a checkpoint (call after each save): the run it replaced can go."""
        if self.acc.is_main_process and not self.checkpointed:
            (self.path / MARKER).touch()
            if self.aside is not None:
                shutil.rmtree(self.aside, ignore_errors=True)
        self.aside, self.checkpointed = None, True

    def abandon(self) -> None:
        """The run failed before its first checkpoint: leave output_dir as it was before (main process)."""
        if not self.claimed or not self.acc.is_main_process or self.mode in (RESUME, RESTART):
            return
        if self.aside is not None:
            shutil.rmtree(self.real, ignore_errors=True)
            self.aside.rename(self.real)
            self.aside = None
        else:
            shutil.rmtree(self.real, ignore_errors=True)
            if not self.created:  # it was an empty directory before
                self.real.mkdir(parents=True, exist_ok=True)
