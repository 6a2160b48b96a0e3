"""The run directory's life: checked before anything is built, written only once the run can start.

`check` (every process, read-only) decides what the run will do with `output_dir`; nothing is
written until `claim`, which the loop calls after the recipe, the data and the model were built.
With --overwrite the previous run is moved aside at `claim`, removed once the new run has committed
its first checkpoint (`settle`), and put back if the new run fails before that (`abandon`). A run
killed before its first checkpoint resumes from step 0 with --resume.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from draftforge.errors import CheckpointError, DraftforgeError
from draftforge.recipe import dump_recipe
from draftforge.train import checkpoint as ckpt

NEW, REPLACE, RESUME, RESTART = "new", "replace", "resume", "restart"
MARKER = ".has-checkpoints"  # written beside recipe.yaml at the first checkpoint


class RunDir:
    def __init__(self, recipe, acc, *, resume: bool, overwrite: bool):
        self.recipe, self.acc, self.path = recipe, acc, Path(recipe.output_dir)
        self.mode = self._check(resume, overwrite)
        self.aside: Path | None = None
        self.claimed = False  # claim() wrote the run's first files
        self.created = False  # this run made the directory (so abandoning removes it)
        self.checkpointed = False  # set once the run has a checkpoint: from then on it resumes, never abandons

    def _check(self, resume: bool, overwrite: bool) -> str:
        saved = self.path / "recipe.yaml"
        if resume:
            if not saved.is_file():
                raise CheckpointError(f"--resume: {self.path} holds no run (no recipe.yaml); start without --resume")
            diff = ckpt.recipe_differences(yaml.safe_load(saved.read_text()), self.recipe.to_dict())
            if diff:
                raise CheckpointError(f"--resume: the recipe differs from the run in {self.path} in "
                                      f"{', '.join(diff)}; resume with the same recipe or use a new output_dir")
            if ckpt.list_checkpoints(self.path):
                return RESUME
            if (self.path / MARKER).exists():  # not a run killed early: its checkpoints were removed
                raise CheckpointError(f"--resume: no checkpoint in {self.path / 'checkpoints'}, although this run "
                                      "wrote some (were they deleted?); start again with --overwrite")
            return RESTART
        if self.path.exists() and not self.path.is_dir():
            raise DraftforgeError(f"output_dir {self.path} exists and is not a directory; choose another output_dir")
        if self.path.is_dir() and any(self.path.iterdir()):
            if not overwrite:
                raise DraftforgeError(f"output directory {self.path} already holds a run; pass --resume to continue "
                                      "it, --overwrite to replace it, or choose another output_dir")
            return REPLACE
        return NEW

    def claim(self, files: dict[str, str] | None = None) -> None:
        """Write the run's first files (main process); a replaced run is moved aside, not deleted yet."""
        self.acc.wait_for_everyone()  # every process has checked before the main process writes
        if self.acc.is_main_process:
            if self.mode == REPLACE:
                self.aside = self.path.with_name(f".{self.path.name}.replaced")
                if self.aside.exists():  # left by a run killed before its first checkpoint
                    shutil.rmtree(self.aside)
                self.path.rename(self.aside)
            self.created = not self.path.exists()
            self.path.mkdir(parents=True, exist_ok=True)
            if self.mode != RESUME:
                (self.path / "recipe.yaml").write_text(dump_recipe(self.recipe))
            for name, text in (files or {}).items():
                (self.path / name).write_text(text)
        self.claimed = True
        self.acc.wait_for_everyone()

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
            shutil.rmtree(self.path, ignore_errors=True)
            self.aside.rename(self.path)
            self.aside = None
        else:
            shutil.rmtree(self.path, ignore_errors=True)
            if not self.created:  # it was an empty directory before
                self.path.mkdir(parents=True, exist_ok=True)
