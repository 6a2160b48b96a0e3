"""What the loop needs to know about the distributed backend Accelerate was launched with.

The recipe is the single source of batch sizes: DeepSpeed's micro-batch, accumulation and global
batch are written into its config from the recipe (Accelerate on CPU cannot infer them without a
DataLoader), FSDP's wrap policy is narrowed to the block classes the model actually has, FSDP2
runs on CPU processes too (gloo; see `adopt_cpu_fsdp`), the final export gathers sharded weights
(FSDP, ZeRO-3) into one state dict, and a resume on another number of processes is allowed only
where the saved state can be resharded.
Legend: G = global batch, B = micro-batch, W = processes, A = accumulation steps (G = B*A*W).
"""

from __future__ import annotations

import importlib.util
import itertools
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
    ds_json = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if _flag(env, "ACCELERATE_USE_DEEPSPEED") and ds_json and ds_json != "none" and not os.path.isfile(ds_json):
        # launch/deepspeed_zero*.yaml name their JSON relative to the repository root: Accelerate's own error was
        # a traceback ending in "Expected a string path to an existing deepspeed config"
        raise DraftforgeError(f"the launch config's deepspeed_config_file {ds_json!r} does not exist from "
                              f"{os.getcwd()}; launch from the repository root (launch/ holds the JSON), or give "
                              "the file's absolute path in the launch config")


def accelerator_kwargs(env=os.environ) -> dict:
    """Extra Accelerator arguments for several processes on a machine without CUDA (CI, laptops).

    Accelerate's own MULTI_CPU type only starts one process unless launched under mpirun, so
    launch/multi_cpu.yaml uses the torchrun launcher and each process asks here for CPU + gloo.
    DeepSpeed needs gloo named explicitly: otherwise Accelerate finds no device backend, lets
    DeepSpeed start its process group but records a world of 1, and DeepSpeed rejects the batch.
    FSDP2 starts as CPU + gloo too and becomes FSDP in `adopt_cpu_fsdp`. FSDP1 cannot run on CPU
    and is refused here, before Accelerate raises a traceback about it: with sync_module_states
    (forced on by cpu_ram_efficient_loading) Accelerate's plugin asks for an accelerator device
    ("There are currently no available devices found", accelerate 1.15 utils/dataclasses.py,
    FullyShardedDataParallelPlugin.__post_init__), and without it torch's FullyShardedDataParallel
    rejects the CPU device Accelerate passes ("Inconsistent compute device and `device_id` on rank 0:
    cpu vs cpu:0", torch 2.13 distributed/fsdp/_init_utils.py, _get_compute_device).
    """
    several = int(env.get("WORLD_SIZE", "1")) > 1 and "LOCAL_RANK" in env
    if not several or torch.cuda.is_available():
        return {}
    if _flag(env, "ACCELERATE_USE_DEEPSPEED"):
        from accelerate.utils import InitProcessGroupKwargs

        return {"kwargs_handlers": [InitProcessGroupKwargs(backend="gloo")]}
    if _flag(env, "ACCELERATE_USE_FSDP") and fsdp_version(env) != 2:
        raise DraftforgeError(f"this launch asks for FSDP{fsdp_version(env)} (fsdp_version: {fsdp_version(env)}), "
                              "which needs CUDA GPUs, and none is visible; on CPU processes set fsdp_version: 2 in "
                              "the launch config (launch/fsdp.yaml does), or launch with launch/multi_cpu.yaml")
    return {"cpu": True}


def fsdp_version(env=os.environ) -> int:
    """The FSDP version an FSDP launch asks for (Accelerate's own default when the config names none: 1)."""
    return int(env.get("FSDP_VERSION", "1"))


def adopt_cpu_fsdp(acc, env=os.environ) -> None:
    """Under an FSDP launch on CPU processes, turn the Accelerator into the FSDP2 one it was launched as.

    Accelerate builds the FSDP plugin from the launch's environment but keeps it only for accelerator
    process types: the switch to `DistributedType.FSDP` sits in the MULTI_GPU / MULTI_NPU / ... branch
    of AcceleratorState.__init__ (accelerate 1.15 state.py), never MULTI_CPU, so on CPU the plugin is
    dropped and `prepare` would wrap the model in DDP under an FSDP config. Everything past that switch
    runs on CPU as it does on GPUs: `fully_shard` over a gloo mesh, sharded checkpoints
    (torch.distributed.checkpoint) and the gathered state dict of the export.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = acc.state
    if not _flag(env, "ACCELERATE_USE_FSDP") or state.distributed_type != DistributedType.MULTI_CPU:
        return
    plugin = FullyShardedDataParallelPlugin()  # from the launch's FSDP_* variables, as Accelerator builds it
    if state.mixed_precision != "no":  # what AcceleratorState does for the plugins it keeps
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # read by accelerate's collectives


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


# DeepSpeed's own defaults for the bucket sizes Accelerate fills from model.config.hidden_size when they are "auto"
DEEPSPEED_BUCKET_DEFAULTS = {"reduce_bucket_size": 500_000_000, "stage3_prefetch_bucket_size": 50_000_000,
                             "stage3_param_persistence_threshold": 100_000}


def fill_deepspeed_buckets(acc, model: torch.nn.Module) -> list[str]:
    """Give "auto" bucket sizes DeepSpeed's defaults where the model has no config.hidden_size to size them from
    (theta's and c2t's small heads): Accelerate raised "Can't find `model.config` entry" in prepare. Returns the
    keys it set."""
    plugin = getattr(acc.state, "deepspeed_plugin", None)
    config = getattr(model, "config", None)
    if plugin is None or getattr(config, "hidden_size", None) or getattr(config, "hidden_sizes", None):
        return []
    zero = plugin.deepspeed_config.setdefault("zero_optimization", {})
    filled = [key for key in DEEPSPEED_BUCKET_DEFAULTS if zero.get(key) == "auto"]
    for key in filled:
        zero[key] = DEEPSPEED_BUCKET_DEFAULTS[key]
    return filled


def fit_fsdp_wrap_policy(acc, model: torch.nn.Module) -> None:
    """Keep only the configured wrap classes this model has (Accelerate refuses absent ones)."""
    plugin = getattr(acc.state, "fsdp_plugin", None)
    names = getattr(plugin, "transformer_cls_names_to_wrap", None)
    if not names:
        return
    present = {type(m).__name__ for m in model.modules()}
    kept = [n for n in names if n in present]
    if not kept:
        raise DraftforgeError(f"the FSDP config wraps {', '.join(names)} but the model ({type(model).__name__}, "
                              f"{sum(p.numel() for p in model.parameters()):,} parameters) has none of them; add its "
                              "block class to fsdp_transformer_layer_cls_to_wrap in the launch config, or, for a "
                              "small model without repeated blocks (the theta and c2t heads), launch with DDP "
                              "(launch/multi_gpu.yaml, or launch/multi_cpu.yaml on CPU processes)")
    plugin.transformer_cls_names_to_wrap = kept


def check_resume(saved: dict, acc, ckpt_dir) -> None:
    """A checkpoint resumes only on a backend that can read it, and on another W only if reshardable."""
    now, then = backend(acc), saved.get("backend")
    was_world = saved.get("world_size")
    if then == "fsdp" and now == "single" and _flag(os.environ, "ACCELERATE_USE_FSDP"):
        # the launch config is FSDP's, but on one CPU process Accelerate sets up no distributed state at all
        raise CheckpointError(f"--resume: {ckpt_dir} was written under fsdp, and FSDP on CPU processes needs 2 or "
                              "more of them (one CPU process runs without FSDP, which cannot read the sharded "
                              "checkpoint); relaunch with --num_processes 2 or more")
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


def gathered_model(acc, model, rebuild=None) -> torch.nn.Module | None:
    """Under FSDP / ZeRO-3: a full CPU copy of the trained model on the main process (None elsewhere).

    `get_state_dict` is collective (every rank must call it); the copy is rebuilt from the config
    (or by `rebuild`, see `model_from_state`) and loaded with the gathered weights, so the sharded
    model itself is left untouched.
    """
    state = acc.get_state_dict(model)  # ZeRO-3 needs stage3_gather_16bit_weights_on_model_save
    if not acc.is_main_process:
        return None
    return model_from_state(acc.unwrap_model(model), state, rebuild)


def model_from_state(like: torch.nn.Module, state: dict, rebuild=None) -> torch.nn.Module:
    """A fresh CPU model of `like`'s class and config holding `state` (strict: every key must fit).

    A module that is not a transformers model (eesd's ExitHead, built from a target's layers) cannot
    be constructed from its config; `rebuild()` then builds an empty one of the same structure."""
    from transformers import PreTrainedModel

    if rebuild is not None and not isinstance(like, PreTrainedModel):
        copy = rebuild().cpu()
    else:
        # The plain constructor, not `_from_config`: under ZeRO-3 that opens deepspeed.zero.Init, a
        # collective the other ranks never join (the copy is built on the main process only).
        copy = type(like)(like.config)
    copy = copy.to(next(iter(state.values())).dtype)
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


def share_frozen(acc, frozen: dict) -> None:
    """Under FSDP, give every process rank 0's copy of each frozen module (on its device already).

    transformers' FSDP loading (FSDP_CPU_RAM_EFFICIENT_LOADING, set by launch/fsdp.yaml) takes rank 0 as
    the source of a model's weights: on the other ranks it leaves missing keys uninitialised and
    non-persistent buffers as placeholders for the FSDP wrapper to overwrite from rank 0
    (modeling_utils: `is_fsdp_enabled() and not is_local_dist_rank_0()`). A frozen module is never
    wrapped, so nothing would; one broadcast per tensor at start-up makes every rank's teacher the same.
    """
    if not frozen or backend(acc) != "fsdp":
        return
    for module in frozen.values():
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            data = tensor.data if tensor.is_contiguous() else tensor.data.contiguous()  # collectives need dense
            torch.distributed.broadcast(data, src=0)
            if data is not tensor.data:  # e.g. an expanded position-ids buffer: rank 0's values, stored densely
                tensor.data = data


def check_frozen_placement(acc, frozen: dict) -> None:
    """Frozen modules (a target, a teacher) must be whole on every process: ZeRO-3's init flag would have
    partitioned them while they were built, and nothing gathers them outside the training engine."""
    plugin = getattr(acc.state, "deepspeed_plugin", None)
    # with the flag off, transformers still partitions a model it loads under a ZeRO-3 config (HfDeepSpeedConfig):
    # its parameters then hold no values here (numel 0, a ds_id), and the first forward died in torch
    partitioned = plugin is not None and getattr(plugin, "zero_stage", None) == 3 and any(
        hasattr(p, "ds_id") or p.numel() == 0 for module in frozen.values() for p in module.parameters())
    if not frozen or plugin is None:
        return
    fix = ("launch it with ZeRO-2 (launch/deepspeed_zero2.yaml) or FSDP2 (launch/fsdp.yaml), which keep frozen "
           "modules whole")
    if partitioned:
        raise DraftforgeError(f"this task keeps frozen modules ({', '.join(frozen)}) outside ZeRO, but under ZeRO-3 "
                              "transformers partitioned them while loading (distill's teacher, eesd's trunk, an "
                              f"online eagle3 target): {fix}")
    if getattr(plugin, "zero3_init_flag", False):
        raise DraftforgeError(f"this task keeps frozen modules ({', '.join(frozen)}) outside ZeRO, but the launch "
                              "config sets zero3_init_flag: true, which partitions every model built under it; "
                              "set zero3_init_flag: false (launch/deepspeed_zero3.yaml does). Even then a frozen "
                              "model loaded through transformers (distill's teacher, eesd's trunk, an online eagle3 "
                              f"target) is partitioned by it under ZeRO-3: {fix}")
