"""The task registry: one place maps a task name to its recipe section and its builder. It sits beside
recipe.py, below draftforge.train: builders are named as "module:attr" strings, so it imports no task.

A task registers itself once with `register_task`. Builders and config classes may be given as
"module:attr" strings, imported only when the task is used, so `draftforge train --help` and
recipe validation stay fast. A recipe's `plugins:` list names modules to import before the task
is looked up: that is how a task defined outside draftforge (or in a test) registers itself,
also in every process of an `accelerate launch`.

    register_task("mytask", builder="mypkg.task:build", config="mypkg.task:MyConfig",
                  doc="what it trains")
    # recipe.yaml:  task: mytask / plugins: [mypkg.task] / mytask: {field: value}
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass
from typing import Any, Callable

from draftforge.errors import RecipeError


@dataclass(frozen=True)
class TaskInfo:
    """name: the recipe's `task`; config: dataclass of the task's own recipe section (named like
    the task), or None; builder(recipe, accelerator, with_data=True) -> TaskSpec; check(recipe)
    raises RecipeError for recipe-level rules of this task, before anything is built or written."""

    name: str
    builder: str | Callable
    doc: str
    config: str | type | None = None
    check: str | Callable | None = None

    def resolve(self, attr: str) -> Any:
        value = getattr(self, attr)
        return _import(value) if isinstance(value, str) else value


_TASKS: dict[str, TaskInfo] = {}


def register_task(name: str, *, builder, doc: str, config=None, check=None) -> TaskInfo:
    """Register a task under `name`; ValueError when another task has that name already (the same
    registration again, as a plugin module imported under a second name would make, is let through)."""
    if not name.isidentifier():
        raise ValueError(f"task name {name!r} must be an identifier (it names a recipe section)")
    info = TaskInfo(name, builder, doc, config, check)
    known = _TASKS.get(name)
    if known is not None and _spelled(known) != _spelled(info):
        raise ValueError(f"task {name!r} is registered already (builder {known.builder!r})")
    _TASKS[name] = info
    return info


def _spelled(info: TaskInfo) -> tuple:
    """What a registration says, with callables and classes by their qualified names."""
    return tuple(v if isinstance(v, str) or v is None else f"{v.__module__}.{v.__qualname__}" for v in
                 (info.builder, info.doc, info.config, info.check))


def get_task(name: str) -> TaskInfo:
    if name not in _TASKS:
        close = difflib.get_close_matches(str(name), list(_TASKS), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise RecipeError(f"recipe key 'task': unknown task {name!r}{hint}; registered tasks: "
                          f"{', '.join(task_names())} (a task defined elsewhere is loaded with plugins: [module])")
    return _TASKS[name]


def task_names() -> list[str]:
    return list(_TASKS)


def import_plugins(modules: list[str]) -> None:
    """Import the modules a recipe lists under `plugins:` (they call register_task)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise RecipeError(f"recipe key 'plugins': cannot import {name!r} ({e}); is it on PYTHONPATH?") from None


def _import(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


# ---------------------------------------------------------------- built-in tasks

# name, builder, config, check (module:attribute, imported when the task runs), doc
BUILT_IN = (
    ("pretrain", "draftforge.train.lm:build_lm_task", None, None,
     "a Mamba / Mamba2 drafter (or any small causal LM) from scratch, next-token CE on packed text"),
    ("sft", "draftforge.train.lm:build_lm_task", None, "draftforge.train.lm:check_sft",
     "a pretrained drafter on chat data or token rows (loss where the mask says), optional LoRA"),
    ("distill", "draftforge.train.distill:build_distill_task", "draftforge.train.distill:DistillConfig",
     "draftforge.train.distill:check_distill",
     "a small SSM drafter on a frozen target's distributions: forward KL at a temperature (+ optional CE)"),
    ("theta", "draftforge.train.cali_ts:build_theta_task", "draftforge.train.cali_ts:ThetaConfig", None,
     "the Cali-TS θ predictor on rows from `draftforge harvest theta` (EESD §3.3, App. B)"),
    ("c2t", "draftforge.train.c2t:build", "draftforge.train.c2t:C2TConfig", None,
     "the C2T classifier (P, H, d) -> accept confidence on harvested EAGLE-2 trees (C2T §4)"),
    ("eesd", "draftforge.train.eesd:build_eesd_task", "draftforge.train.eesd:EesdConfig",
     "draftforge.train.eesd:check_eesd",
     "an early-exit drafter: exit layer + norm + head on the target's frozen first N layers (EESD)"),
    ("eagle3", "draftforge.train.eagle3_cache:build_task", "draftforge.train.eagle3:Eagle3TaskConfig",
     "draftforge.train.eagle3_cache:check_task",
     "an EAGLE-3 head on a frozen target's low/middle/high states, training-time test over K steps (EAGLE-3)"),
)
for _name, _builder, _config, _check, _doc in BUILT_IN:
    register_task(_name, builder=_builder, config=_config, check=_check, doc=_doc)
