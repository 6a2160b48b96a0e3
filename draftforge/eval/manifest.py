"""Run manifest: what a reader needs to tell a real speedup from a different machine, library or noise."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import shlex
import sys
from datetime import datetime, timezone

from draftforge.runtime import device_name

LIBRARIES = ("torch", "transformers", "accelerate", "draftforge", "triton", "mamba-ssm", "causal-conv1d")
# transformers' assisted generation reads its draft length policy from the assistant's generation_config
ASSISTED_POLICY_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


def cpu_model() -> str:
    return device_name("cpu").removeprefix("cpu: ")


def gpu_names() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def library_versions() -> dict[str, str | None]:
    """Installed versions; None for libraries that are absent (triton and mamba-ssm are optional)."""
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def command_line(argv: list[str] | None = None) -> str:
    argv = sys.argv if argv is None else argv
    return " ".join(shlex.quote(a) for a in argv)


def build_manifest(
    *, device: str, dtype: str, seed: int, repeats: int, command: str | None, tokens_per_s_spread: dict,
    extra: dict | None = None,
) -> dict:
    """tokens_per_s_spread: {"method@T": {"min", "median", "max"}} over repeats."""
    manifest = {
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hardware": {
            "cpu": cpu_model(),
            "cpu_count": os.cpu_count(),
            "torch_threads": _torch_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "gpu": gpu_names(),
            "device": device,
        },
        "platform": platform.platform(),
        "python": platform.python_version(),
        "libraries": library_versions(),
        "dtype": dtype,
        "seed": seed,
        "command": command if command is not None else command_line(),
        "repeats": repeats,
        "tokens_per_s_spread": tokens_per_s_spread,
    }
    if extra:
        manifest.update(extra)
    return manifest


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def assisted_policy(model) -> dict:
    """The draft-length policy transformers' assisted generation uses with `model` as the assistant:
    the model's generation_config values, transformers' own defaults where those are unset.

    `source` says which; `confidence_threshold_adapts` is True when scikit-learn is installed
    (transformers then tunes the threshold from an ROC curve during each call)."""
    config = getattr(model, "generation_config", None)
    getter = getattr(config, "_get_default_generation_params", None)
    try:
        defaults = getter() if callable(getter) else {}
    except Exception:  # a private transformers helper: a change there must not break the report
        defaults = {}
    policy, source = {}, {}
    for key in ASSISTED_POLICY_KEYS:
        value = getattr(config, key, None)
        policy[key] = value if value is not None else defaults.get(key)
        source[key] = "generation_config" if value is not None else (
            "transformers default" if key in defaults else "unknown")
    policy["source"] = source
    policy["confidence_threshold_adapts"] = importlib.util.find_spec("sklearn") is not None
    return policy
