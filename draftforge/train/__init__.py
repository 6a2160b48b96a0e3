"""Training: one loop (loop.py) and one small module per task; tasks register in draftforge/tasks.py."""

from __future__ import annotations


def task_builder(task: str):
    """The builder of a registered task (imported lazily so the CLI starts fast)."""
    from draftforge.tasks import get_task

    return get_task(task).resolve("builder")


def run(recipe, *, resume: bool = False, overwrite: bool = False, auto_resume: bool = False,
        stop_after: int | None = None):
    from draftforge.train.loop import train

    return train(recipe, task_builder(recipe.task), resume=resume, overwrite=overwrite, auto_resume=auto_resume,
                 stop_after=stop_after)


# Modules that moved after 0.1.0 (one home per method, sub-packages by role): their old names import the new modules,
# with a DeprecationWarning, until the next release.
from draftforge.deprecation import moved_modules  # noqa: E402

moved_modules({
    "draftforge.train.theta": "draftforge.train.cali_ts",
})
