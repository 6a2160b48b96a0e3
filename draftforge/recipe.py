"""Recipes: YAML files validated into dataclasses (docs/design.md §6, principle 2).

Every field has a default and a one-line doc (`field_docs`, printed by
`draftforge train --help-recipe TASK`). An unknown key, a wrong type or an impossible value
raises RecipeError naming the dotted key, before any model is built.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from draftforge.errors import RecipeError
from draftforge.options import field_rows, literal_choices, one_of, option
from draftforge.runtime import PRECISIONS


def doc(default: Any, text: str, **how):
    """A recipe field: `option` (draftforge/options.py), the one way every setting is declared."""
    return option(default, text, **how)


@dataclass
class DataConfig:
    sources: list[str] = doc([], "HF dataset names, local .txt/.jsonl/.json/.parquet files, folders or globs")
    format: str = doc("text", "'text': raw documents packed with EOS; 'chat': ShareGPT/OpenAI conversations; "
                      "'tokens': JSONL/JSON/parquet rows {input_ids, prompt_len or loss_mask} used as is "
                      "(no re-tokenization; e.g. a target's own continuations); a chat or token row longer than "
                      "train.block_size is cut there (counted)")
    text_field: str = doc("text", "column holding the text when format=text")
    hf_config: str | None = doc(None, "dataset config name for HF datasets")
    split: str = doc("train", "split to read from HF datasets")
    streaming: bool = doc(False, "stream HF datasets instead of downloading them whole")
    eval_fraction: float = doc(0.01, "fraction of documents held out for the eval loss (0 disables)")
    eval_sources: list[str] = doc([], "held-out documents read from these sources (same format as `sources`) "
                                  "instead of a split of `sources`: every document of `sources` trains and "
                                  "eval_fraction is not used; the eval set stays the same when the training data "
                                  "grows, so runs on more rows stay comparable")
    max_documents: int | None = doc(None, "read at most this many documents (None: all)")
    num_proc: int = doc(1, "tokenization worker processes")
    file_glob: str = doc("**/*", "which files of a folder source to read")

    def check(self, at: str) -> None:
        require(self.format in ("text", "chat", "tokens"), f"{at}.format",
                 f"must be 'text', 'chat' or 'tokens', got {self.format!r}")
        require(0.0 <= self.eval_fraction < 1.0, f"{at}.eval_fraction", "must be in [0, 1)")
        require(self.num_proc >= 1, f"{at}.num_proc", "must be >= 1")
        require(self.max_documents is None or self.max_documents > 0, f"{at}.max_documents", "must be > 0")
        require(not (self.eval_sources and self.streaming), f"{at}.eval_sources",
                "is not read when streaming; use eval_fraction")


@dataclass
class LoraConfig:
    enabled: bool = doc(False, "train LoRA adapters (peft) instead of all weights; merged at export")
    r: int = doc(16, "LoRA rank")
    alpha: int = doc(32, "LoRA scaling alpha")
    dropout: float = doc(0.0, "LoRA dropout")
    target_modules: list[str] = doc([], "module names to adapt ([]: in_proj (+ x_proj, dt_proj) for Mamba, whose "
                                    "out_proj PEFT refuses; attention + MLP projections for Llama)")

    def check(self, at: str) -> None:
        require(self.r > 0, f"{at}.r", "must be > 0")
        require(0 < self.alpha < math.inf, f"{at}.alpha",
                 f"must be > 0 (the adapters' scale is alpha / r), got {self.alpha}")
        require(0.0 <= self.dropout < 1.0, f"{at}.dropout", "must be in [0, 1)")


@dataclass
class ModelConfig:
    arch: str = doc("mamba2", "'mamba', 'mamba2', 'llama' or any transformers model_type (ignored with init_from)")
    size: str | None = doc("tiny", "size preset (e.g. tiny, small, 130m for Mamba; tiny-target for Llama)")
    overrides: dict = doc({}, "explicit config fields that win over the preset (hidden_size, num_hidden_layers, ...)")
    init_from: str | None = doc(None, "start from this checkpoint: a draftforge run dir, an export dir or a HF model id "
                                       "(eagle3: an exported head or its run, fine-tuned with its own shape and draft vocabulary)")
    tokenizer: str | None = doc(None, "tokenizer path or HF id (normally the target's); default: target, then init_from")
    target: str | None = doc(None, "the target model this drafter serves (its vocab size is matched; recorded in export)")
    draft_vocab: int | None = doc(None, "reduced draft vocabulary: the head predicts only the N most frequent target "
                                        "tokens of the training data (EAGLE-3's d2t map, kept in config.json); "
                                        "None = the full vocabulary")
    draft_vocab_from: str | None = doc(None, "count the draft vocabulary on these token rows (format: tokens, e.g. "
                                             "`draftforge generate` output: what the target emits) instead of "
                                             "the training data")
    embed_from_target: bool = doc(False, "start the embedding (and head) from the target's: a copy at equal width, "
                                         "else its top principal directions (fresh models only)")
    lora: LoraConfig = field(default_factory=LoraConfig, metadata={"help": "LoRA options (sft)"})

    def check(self, at: str) -> None:
        require(bool(self.tokenizer or self.target or self.init_from), f"{at}.tokenizer",
                 "set model.tokenizer (or model.target / model.init_from, whose tokenizer is then used)")
        require(self.draft_vocab is None or self.draft_vocab > 0, f"{at}.draft_vocab", "must be > 0 (or null)")
        require(self.draft_vocab_from is None or self.draft_vocab is not None, f"{at}.draft_vocab_from",
                 "set model.draft_vocab (how many ids) as well")
        require(not self.embed_from_target or bool(self.target), f"{at}.embed_from_target",
                 "needs model.target (the model whose embedding is copied)")
        require(not (self.embed_from_target and self.init_from), f"{at}.embed_from_target",
                 "only a fresh model starts from the target's embedding; init_from already has one")
        self.lora.check(f"{at}.lora")


@dataclass
class OptimConfig:
    lr: float = doc(3e-4, "peak learning rate (AdamW)")
    weight_decay: float = doc(0.1, "AdamW weight decay (not applied to biases and norms)")
    betas: list[float] = doc([0.9, 0.95], "AdamW betas")
    eps: float = doc(1e-8, "AdamW epsilon")
    warmup_steps: int = doc(100, "linear warm-up steps")
    schedule: str = doc("cosine", "'cosine', 'linear' or 'constant' after warm-up")
    min_lr_ratio: float = doc(0.1, "where the decay ends, as a fraction of the peak LR (cosine/linear): reached "
                                   "after the last step, which runs one step of decay above it")
    grad_clip: float = doc(1.0, "clip the global grad norm to this (0 disables)")
    fused: bool | None = doc(None, "fused AdamW kernel (None: when every trainable parameter is a float tensor "
                                   "on CPU or CUDA; the same update rule, fewer kernel launches)")

    def check(self, at: str) -> None:
        require(0 < self.lr < math.inf, f"{at}.lr", "must be > 0 and finite")
        require(0 < self.eps < math.inf, f"{at}.eps", f"must be > 0 and finite (AdamW divides by it), got {self.eps}")
        require(self.weight_decay >= 0, f"{at}.weight_decay", f"must be >= 0, got {self.weight_decay}")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"{at}.betas", "two values in [0, 1)")
        require(self.warmup_steps >= 0, f"{at}.warmup_steps", "must be >= 0")
        require(self.schedule in ("cosine", "linear", "constant"), f"{at}.schedule",
                 f"must be cosine, linear or constant, got {self.schedule!r}")
        require(0.0 <= self.min_lr_ratio <= 1.0, f"{at}.min_lr_ratio", "must be in [0, 1]")
        require(0 <= self.grad_clip < math.inf, f"{at}.grad_clip",
                 f"must be >= 0 and finite (0 disables clipping), got {self.grad_clip}")


@dataclass
class TrainConfig:
    max_steps: int = doc(1000, "optimizer steps")
    global_batch_size: int = doc(32, "sequences per optimizer step = micro_batch_size x accumulation x processes")
    micro_batch_size: int = doc(8, "sequences per forward on one process")
    block_size: int = doc(512, "tokens per training sequence")
    precision: PRECISIONS = doc("auto", "'auto' (bf16 autocast where bf16 is native: CUDA with bf16, CPUs with "
                                        "AVX512-BF16 or AMX; else fp32), 'fp32', 'bf16' or 'fp16' (or float32, "
                                        "bfloat16, float16: the words eval's --dtype takes)")
    eval_every: int = doc(200, "eval loss every N steps (0: only at the end)")
    eval_batches: int = doc(8, "micro-batches of held-out data per eval: eval_batches x micro_batch_size rows in "
                               "all, shared out over the processes (the same rows on 1 or N)")
    eval_at_start: bool = doc(False, "also evaluate before the first step, logged as step 0: the starting weights' "
                                     "metrics (e.g. of model.init_from) next to the fine-tuned ones; with keep_best the "
                                     "start competes, so a run that never beats it exports the starting weights")
    save_every: int = doc(500, "checkpoint every N steps (a final one is always written)")
    keep_checkpoints: int = doc(2, "how many recent checkpoints to keep")
    log_every: int = doc(10, "log metrics every N steps")
    trackers: list[str] = doc(["auto"], "Accelerate trackers: tensorboard, wandb; 'auto' = tensorboard if installed")
    seed: int = doc(0, "seed for init, data order and dropout")
    export: bool = doc(True, "export safetensors to OUTPUT_DIR/export when training ends")
    keep_best: str | None = doc(None, "export the weights of the eval with the best value of this eval metric "
                                      "instead of the last step's: loss and the divergences kl/tvd/ce/brier (lowest) "
                                      "or any other logged eval metric (highest), "
                                      "e.g. predicted_speedup or tau_chain_g5 for distill; None: the last step's")

    def check(self, at: str) -> None:
        for key in ("max_steps", "global_batch_size", "micro_batch_size", "block_size", "eval_batches",
                    "keep_checkpoints", "log_every"):
            require(getattr(self, key) > 0, f"{at}.{key}", f"must be > 0, got {getattr(self, key)}")
        for key in ("eval_every", "save_every"):
            require(getattr(self, key) >= 0, f"{at}.{key}", "must be >= 0")
        require(0 <= self.seed < 2**32, f"{at}.seed", f"must be in [0, 2**32), got {self.seed}")
        require(self.global_batch_size % self.micro_batch_size == 0, f"{at}.global_batch_size",
                 f"{self.global_batch_size} is not a multiple of micro_batch_size={self.micro_batch_size}")
        from accelerate.utils import LoggerType

        known = ["auto", *(x.value for x in LoggerType)]
        unknown = [x for x in self.trackers if x not in known]
        require(not unknown, f"{at}.trackers", f"unknown tracker(s) {unknown}; known: {', '.join(known)}")


@dataclass
class Recipe:
    task: str = doc("pretrain", "what to train: a registered task (pretrain, sft, ...; --help-recipe lists them)")
    plugins: list[str] = doc([], "modules to import before the task is looked up (they register tasks of their own)")
    output_dir: str = doc("runs/draftforge", "run directory: resolved recipe, checkpoints, logs, export")
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "the model being trained"})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "training data"})
    optim: OptimConfig = field(default_factory=OptimConfig, metadata={"help": "optimizer and LR schedule"})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "loop settings"})
    # The task's own section (e.g. `eesd:`), validated by the dataclass the task registered; None
    # for tasks without one. In YAML and in to_dict() it sits under the task's name.
    task_options: Any = field(default=None, metadata={"section": True})

    def check(self) -> None:
        from draftforge.tasks import get_task

        info = get_task(self.task)
        require(bool(self.data.sources), "data.sources", "list at least one data source")
        self.model.check("model")
        self.data.check("data")
        self.optim.check("optim")
        self.train.check("train")
        if hasattr(self.task_options, "check"):
            self.task_options.check(self.task)
        own_split = getattr(self.task_options, "eval_fraction", None) is not None  # c2t holds out its own trees
        require(not self.train.keep_best or own_split or self.data.eval_fraction > 0 or bool(self.data.eval_sources),
                "train.keep_best", "needs held-out data to pick the best eval (data.eval_fraction > 0 or "
                "data.eval_sources); without it the last step's weights were exported silently")
        if self.model.lora.enabled:
            require(self.model.init_from is not None, "model.lora.enabled",
                     "LoRA adapts a pretrained model: set model.init_from")
        if info.check is not None:  # task rules, checked before anything is built or written
            info.resolve("check")(self)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        options = out.pop("task_options")
        if options is not None:
            out[self.task] = options
        return out


def require(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise RecipeError(f"recipe key '{key}': {why}")


# ---------------------------------------------------------------- typed conversion

def _convert(value: Any, tp: Any, key: str) -> Any:
    """Convert a YAML value to annotation `tp`, raising RecipeError that names `key`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(value, arg, key)
            except RecipeError as e:
                errors.append(str(e))
        raise RecipeError(errors[0] if errors else f"recipe key '{key}': bad value {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise RecipeError(f"recipe key '{key}': expected a mapping, got {type(value).__name__}")
        return _build(tp, value, key)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"recipe key '{key}': expected a list, got {value!r}")
        (item_tp,) = typing.get_args(tp) or (Any,)
        return [_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"recipe key '{key}': expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    choices = literal_choices(tp)
    if choices:
        return one_of(value, f"recipe key '{key}'", choices)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    name = getattr(tp, "__name__", str(tp))
    raise RecipeError(f"recipe key '{key}': expected {name}, got {value!r}")


def _build(cls: type, values: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("section")]
    kwargs = {}
    for k, v in values.items():
        dotted = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            close = difflib.get_close_matches(str(k), names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(names)})"
            raise RecipeError(f"unknown recipe key '{dotted}'{hint}")
        kwargs[k] = _convert(v, hints[k], dotted)
    built = cls(**kwargs)
    for f in dataclasses.fields(cls):  # a field's own check (option(check=...)), once, naming the dotted key
        check, value = f.metadata.get("check"), getattr(built, f.name)
        if check is not None and value is not None:
            setattr(built, f.name, check(value, f"recipe key '{prefix + '.' if prefix else ''}{f.name}'"))
    return built


# ---------------------------------------------------------------- loading

def apply_overrides(values: dict, overrides: list[str]) -> dict:
    """Apply `--set a.b.c=value` overrides (value parsed as YAML) to a nested dict."""
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override {item!r} must look like key.path=value")
        path, raw = item.split("=", 1)
        if not path.strip() or any(not part.strip() for part in path.split(".")):
            raise RecipeError(f"override {item!r} must look like key.path=value (the key path has an empty part)")
        node = values
        parts = path.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise RecipeError(f"override {item!r}: '{part}' is not a section")
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    return values


def _expand(value):
    import os

    return os.path.expanduser(os.path.expandvars(value)) if isinstance(value, str) else value


def recipe_from_dict(values: dict, overrides: list[str] = ()) -> Recipe:
    """Validate a nested dict into a Recipe; `~` and $VARS in path fields are expanded."""
    values = apply_overrides(dict(values or {}), list(overrides))
    section, options_cls = _task_section(values)
    recipe = _build(Recipe, values)
    if options_cls is not None:
        recipe.task_options = _convert(section or {}, options_cls, recipe.task)
    recipe.output_dir = _expand(recipe.output_dir)
    m = recipe.model
    m.init_from, m.tokenizer, m.target = _expand(m.init_from), _expand(m.tokenizer), _expand(m.target)
    m.draft_vocab_from = _expand(m.draft_vocab_from)
    recipe.data.sources = [_expand(s) for s in recipe.data.sources]
    recipe.data.eval_sources = [_expand(s) for s in recipe.data.eval_sources]
    recipe.check()
    return recipe


def _task_section(values: dict) -> tuple[Any, type | None]:
    """Pop the section named after the task (plugins imported first); refuse other tasks' sections."""
    from draftforge.tasks import get_task, import_plugins, task_names

    plugins = values.get("plugins") or []
    if isinstance(plugins, list):
        import_plugins([str(p) for p in plugins])
    task = values.get("task", "pretrain")
    info = get_task(task if isinstance(task, str) else str(task))
    section = values.pop(info.name, None)
    for other in task_names():
        if other in values and other != info.name and other not in _field_names(Recipe):
            raise RecipeError(f"recipe section '{other}' belongs to task {other!r}, but this recipe's task is "
                              f"{info.name!r}; remove the section or set task: {other}")
    options_cls = info.resolve("config")
    if options_cls is None and section is not None:
        raise RecipeError(f"recipe section '{info.name}': task {info.name!r} has no options of its own")
    return section, options_cls


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, but a key given twice in one mapping is an error: PyYAML keeps the last silently, so a second
    `optim:` block at the end of a recipe replaced the first one whole (a stray lr: 1000 trained, exit 0)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice in one mapping",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_recipe(path: str | Path, overrides: list[str] = ()) -> Recipe:
    path = Path(path)
    if not path.is_file():
        what = "is a directory; give the YAML file" if path.is_dir() else "does not exist"
        raise RecipeError(f"recipe file {path} {what}")
    try:
        values = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecipeError(f"recipe file {where} is not valid YAML ({what})") from None
    except UnicodeDecodeError:
        raise RecipeError(f"recipe file {path} is not a text file (not UTF-8: a checkpoint or other binary?); give "
                          "the recipe's YAML file") from None
    if not isinstance(values, dict):
        raise RecipeError(f"recipe file {path} must hold a mapping at the top level")
    return recipe_from_dict(values, overrides)


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.to_dict(), sort_keys=False)


def task_field_docs(task: str) -> list[tuple[str, str, str]]:
    """field_docs of the common sections plus the task's own section (RecipeError for an unknown task)."""
    from draftforge.tasks import get_task

    options_cls = get_task(task).resolve("config")
    return field_docs() + (field_docs(options_cls, f"{task}.") if options_cls is not None else [])


def field_docs(cls: type = Recipe, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, doc) for every leaf field, for --help-recipe."""
    return field_rows(cls, prefix, skip=lambda f: bool(f.metadata.get("section")))
