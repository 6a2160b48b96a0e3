"""Training: one loop (loop.py) and one small module per task."""

from __future__ import annotations


def task_builder(task: str):
    """The TaskParts builder of a task name (imported lazily so the CLI starts fast)."""
    if task in ("pretrain", "sft"):
        from draftforge.train.lm import build_lm_task

        return build_lm_task
    from draftforge.errors import RecipeError

    raise RecipeError(f"recipe key 'task': no trainer for task {task!r}")


def run(recipe, *, resume: bool = False, overwrite: bool = False, stop_after: int | None = None):
    from draftforge.train.loop import train

    return train(recipe, task_builder(recipe.task), resume=resume, overwrite=overwrite, stop_after=stop_after)
