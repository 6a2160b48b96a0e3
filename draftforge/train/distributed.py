"""What the loop needs to know about the distributed backend Accelerate was launched with.

The recipe is the single source of batch sizes: DeepSpeed's micro-batch, accumulation and global
batch are written into its config from the recipe (Accelerate on CPU cannot infer them without a
DataLoader), FSDP's wrap policy is narrowed to the block classes the model actually has, the
final export gathers sharded weights (FSDP, ZeRO-3) into one state dict, and a resume on another
number of processes is allowed only where the saved state can be resharded.
Legend: G = global batch, B = micro-batch, W = processes, A = accumulation steps (G = B*A*W).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from draftforge.errors import CheckpointError, DraftforgeError

DEEPSPEED_EXTRA = "pip install 'draftforge[deepspeed]'"
# Block classes FSDP wraps one unit each (transformers' own names; launch/fsdp.yaml lists them all).
FSDP_BLOCK_CLASSES = ("MambaBlock", "Mamba2Block", "LlamaDecoderLayer")


def require_backend_installed(env=os.environ) -> None:
    """Before Accelerate starts: a DeepSpeed launch without deepspeed installed gets the exact fix."""
    if _flag(env, "ACCELERATE_USE_DEEPSPEED") and importlib.util.find_spec("deepspeed") is None:
        raise DraftforgeError(f"this launch uses a DeepSpeed config but deepspeed is not installed: run "
                              f"{DEEPSPEED_EXTRA} (on CPU-only machines set DS_BUILD_OPS=0), or launch with "
                              "launch/multi_gpu.yaml or launch/fsdp.yaml instead")


def accelerator_kwargs(env=os.environ) -> dict:
    """Extra Accelerator arguments for several processes on a machine without CUDA (CI, laptops).

    Accelerate's own MULTI_CPU type only starts one process unless launched under mpirun, so
    launch/multi_cpu.yaml uses the torchrun launcher and each process asks here for CPU + gloo.
    DeepSpeed needs gloo named explicitly: otherwise Accelerate finds no device backend, lets
    DeepSpeed start its process group but records a world of 1, and DeepSpeed rejects the batch.
    FSDP without CUDA is refused: each process would silently train alone.
    """
    several = int(env.get("WORLD_SIZE", "1")) > 1 and "LOCAL_RANK" in env
    if not several or torch.cuda.is_available():
        return {}
    if _flag(env, "ACCELERATE_USE_DEEPSPEED"):
        from accelerate.utils import InitProcessGroupKwargs

        return {"kwargs_handlers": [InitProcessGroupKwargs(backend="gloo")]}
    if _flag(env, "ACCELERATE_USE_FSDP"):
        raise DraftforgeError("launch/fsdp.yaml needs CUDA GPUs and none is visible; on CPU launch with "
                              "launch/multi_cpu.yaml (DDP) or launch/deepspeed_zero3.yaml (sharded)")
    return {"cpu": True}


def _flag(env, name: str) -> bool:
    return env.get(name, "false").lower() in ("1", "true", "yes")


def backend(acc) -> str:
    """'single', 'ddp', 'fsdp' or 'deepspeed-zeroN' (written into every checkpoint's loop state)."""
    plugin = getattr(acc.state, "deepspeed_plugin", None)
    if plugin is not None:
        return f"deepspeed-zero{plugin.zero_stage}"
    if getattr(acc.state, "fsdp_plugin", None) is not None:
        return "fsdp"
    return "ddp" if acc.num_processes > 1 else "single"


def shards_weights(acc) -> bool:
    """True when no process holds the full model (FSDP, ZeRO-3): the export must gather it."""
    name = backend(acc)
    return name == "fsdp" or name == "deepspeed-zero3"


def configure_deepspeed(acc, recipe) -> str | None:
    """Write the recipe's batch sizes into the DeepSpeed config; refuse explicit values that disagree."""
    plugin = getattr(acc.state, "deepspeed_plugin", None)
    if plugin is None:
        return None
    t = recipe.train
    want = {"train_micro_batch_size_per_gpu": t.micro_batch_size,
            "gradient_accumulation_steps": acc.gradient_accumulation_steps,
            "train_batch_size": t.global_batch_size,
            "gradient_clipping": float(recipe.optim.grad_clip)}
    cfg = plugin.deepspeed_config
    for key, value in want.items():
        have = cfg.get(key, "auto")
        if have != "auto" and have != value:
            raise DraftforgeError(f"the DeepSpeed config sets {key}={have} but the recipe implies {value} "
                                  f"(global batch {t.global_batch_size} = micro-batch {t.micro_batch_size} x "
                                  f"{acc.gradient_accumulation_steps} accumulation x {acc.num_processes} processes); "
                                  f"set {key} to \"auto\" in the DeepSpeed JSON so the recipe decides")
        cfg[key] = value
    # The loop hands DeepSpeed a plain torch AdamW (same update as every other backend).
    cfg.setdefault("zero_allow_untested_optimizer", True)
    return batch_note(acc)


def batch_note(acc) -> str | None:
    """The line the loop prints about DeepSpeed's batch fields (None without DeepSpeed)."""
    plugin = getattr(acc.state, "deepspeed_plugin", None)
    if plugin is None:
        return None
    c = plugin.deepspeed_config
    return (f"DeepSpeed ZeRO-{plugin.zero_stage} config from the recipe: train_micro_batch_size_per_gpu="
            f"{c['train_micro_batch_size_per_gpu']}, gradient_accumulation_steps={c['gradient_accumulation_steps']}, "
            f"train_batch_size={c['train_batch_size']}, gradient_clipping={c['gradient_clipping']}")


def fit_fsdp_wrap_policy(acc, model: torch.nn.Module) -> None:
    """Keep only the configured wrap classes this model has (Accelerate refuses absent ones)."""
    plugin = getattr(acc.state, "fsdp_plugin", None)
    names = getattr(plugin, "transformer_cls_names_to_wrap", None)
    if not names:
        return
    present = {type(m).__name__ for m in model.modules()}
    kept = [n for n in names if n in present]
    if not kept:
        raise DraftforgeError(f"the FSDP config wraps {', '.join(names)} but the model has none of them; add "
                              f"its block class to fsdp_transformer_layer_cls_to_wrap in the launch config")
    plugin.transformer_cls_names_to_wrap = kept


def check_resume(saved: dict, acc, ckpt_dir) -> None:
    """A checkpoint resumes only on a backend that can read it, and on another W only if reshardable."""
    now, then = backend(acc), saved.get("backend")
    was_world = saved.get("world_size")
    if then is not None and _family(then) != _family(now):
        raise CheckpointError(f"--resume: {ckpt_dir} was written under {then}; this launch is {now}. Resume "
                              f"with the launch config of the original run (checkpoint formats differ)")
    if was_world is None or was_world == acc.num_processes:
        return
    if now.startswith("deepspeed"):  # per-rank partitioned optimizer files, laid out for W ranks
        raise CheckpointError(
            f"--resume: {ckpt_dir} was written by {was_world} processes under {now}, whose optimizer state is "
            f"partitioned per rank; this launch has {acc.num_processes}. Relaunch with {was_world} processes "
            "(--num_processes), or export the weights (draftforge export) and start a new run from them with "
            "model.init_from (the optimizer state restarts)")


def _family(name: str) -> str:
    if name.startswith("deepspeed"):
        return name  # ZeRO stages lay out their state differently from each other
    return "fsdp" if name == "fsdp" else "ddp"  # single and DDP checkpoints are the same files


def gathered_model(acc, model) -> torch.nn.Module | None:
    """Under FSDP / ZeRO-3: a full CPU copy of the trained model on the main process (None elsewhere).

    `get_state_dict` is collective (every rank must call it); the copy is rebuilt from the config
    and loaded with the gathered weights, so the sharded model itself is left untouched.
    """
    state = acc.get_state_dict(model)  # ZeRO-3 needs stage3_gather_16bit_weights_on_model_save
    if not acc.is_main_process:
        return None
    return model_from_state(acc.unwrap_model(model), state)


def model_from_state(like: torch.nn.Module, state: dict) -> torch.nn.Module:
    """A fresh CPU model of `like`'s class and config holding `state` (strict: every key must fit)."""
    config = like.config
    # The plain constructor, not `_from_config`: under ZeRO-3 that opens deepspeed.zero.Init, a
    # collective the other ranks never join (the copy is built on the main process only).
    copy = type(like)(config).to(next(iter(state.values())).dtype)
    load_fitting_state(copy, {k: v.cpu() for k, v in state.items()}, "the gathered state")
    return copy.eval()


def load_fitting_state(model: torch.nn.Module, state: dict, what: str) -> None:
    """Load `state` into `model`; every key must fit, except an lm_head tied to the embedding (saved once)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    config = getattr(model, "config", None)
    tied = {k for k in missing if k.endswith("lm_head.weight") and getattr(config, "tie_word_embeddings", False)}
    if set(missing) - tied or unexpected:
        raise CheckpointError(f"{what} does not fit {type(model).__name__} (missing "
                              f"{sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})")
    if tied:
        model.tie_weights()


def check_frozen_placement(acc, frozen: dict) -> None:
    """Frozen modules (a target, a teacher) must be whole on every process: ZeRO-3's init flag would have
    partitioned them while they were built, and nothing gathers them outside the training engine."""
    plugin = getattr(acc.state, "deepspeed_plugin", None)
    if frozen and plugin is not None and getattr(plugin, "zero3_init_flag", False):
        raise DraftforgeError(f"this task keeps frozen modules ({', '.join(frozen)}) outside ZeRO, but the launch "
                              "config sets zero3_init_flag: true, which partitions every model built under it; "
                              "set zero3_init_flag: false (launch/deepspeed_zero3.yaml does)")
