"""The numeric regime and thread count a command runs in: chosen once, said once, recorded in the manifest.

`resolve_dtype("auto", device)` gives bf16 where the device computes it natively (CUDA with bf16; a CPU
with AVX512-BF16 or AMX, read from the CPU's flags) and fp32 elsewhere, with the reason. An explicit
dtype the device can only emulate (bf16 or fp16 on a CPU without the instructions, fp16 on any CPU) runs
as asked, with one line saying it will be slow; it never falls back silently. fp32 keeps bitwise
self-checks; reduced precision gets a near-tie classification (eval/selfcheck.py).
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from typing import Literal, get_args

# One set of words for a numeric regime, the same in a recipe's train.precision and in --dtype / --drafter-dtype:
# each short name means its long one. `resolve_dtype` is the one resolver of both.
PRECISIONS = Literal["auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"]
DTYPE_CHOICES = get_args(PRECISIONS)
LONG_NAME = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
SHORT_NAME = {long: short for short, long in LONG_NAME.items()}
# CPU flags (Linux /proc/cpuinfo names) under which oneDNN runs bf16 matrix products in hardware
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def add_dtype_flag(parser, note: str = "", what: str = "model dtype", flag: str = "--dtype") -> None:
    """--dtype as every command has it: auto (default) is bf16 where the device computes it natively."""
    parser.add_argument(flag, choices=DTYPE_CHOICES, default="auto",
                        help=f"{what}: auto (default) = bfloat16 where the device computes it natively (CUDA with "
                             f"bf16, CPUs with AVX512-BF16 or AMX), else float32{note}")


def add_device_flag(parser, where: str = "") -> None:
    parser.add_argument("--device", default="cpu", help=f"{where}cpu, cuda or cuda:N (default cpu)")


def cpuinfo(field: str) -> str | None:
    """The first `field` line's value in /proc/cpuinfo (None where there is none, e.g. macOS)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    return set((cpuinfo("flags") or "").split())


def cpu_bf16_native(flags: set[str] | None = None) -> str | None:
    """The flag that makes bf16 native on this CPU (e.g. 'avx512_bf16'), or None."""
    flags = cpu_flags() if flags is None else flags
    return next((f for f in BF16_CPU_FLAGS if f in flags), None)


def _is_cuda(device) -> bool:
    return str(device).startswith("cuda")


def check_device(device, flag: str = "--device", error=None) -> None:
    """A CUDA device asked for where torch has none: one line naming it, before any model loads (torch itself
    fails with an AssertionError deep in the first .to())."""
    if device is None or not str(device).startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        from draftforge.errors import RecipeError

        raise (error or RecipeError)(f"{flag} {device}: no CUDA device here (torch {torch.__version__}, "
                                     "torch.cuda.is_available() is False); use --device cpu")


def device_name(device) -> str:
    """What ran a computation, as far as its rounding goes: "cuda: <GPU name>" or "cpu: <CPU model>" (bf16 and
    fp32 kernels differ between GPU models and between CPUs, so the same model's numbers differ at rounding level)."""
    if _is_cuda(device):
        import torch

        return f"cuda: {torch.cuda.get_device_name(torch.device(device))}"
    return f"cpu: {cpuinfo('model name') or platform.processor() or platform.machine()}"


def other_devices(recorded, now: str) -> list[str]:
    """The devices in `recorded` (names, None for work recorded before devices were) other than `now`, sorted."""
    return sorted({d for d in recorded if d is not None and d != now})


def mixed_devices_text(others: list[str], now: str) -> str:
    """The notice a resume on another device gives: the output mixes work from both, which differs in rounding."""
    return (f"continued on {now}; the part already written was computed on {' and '.join(others)}: the two parts "
            "differ at rounding level (other kernels), so the whole is not what one uninterrupted run on either "
            "would write")


@dataclass(frozen=True)
class DtypeChoice:
    name: str  # float32 | bfloat16 | float16
    reason: str  # one line a reader can check
    slow: bool = False  # asked for a dtype the device only emulates

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.name)

    def as_dict(self) -> dict:
        return {"dtype": self.name, "reason": self.reason}


def native_bf16(device, flags: set[str] | None = None) -> tuple[bool, str]:
    """(does `device` compute bf16 in hardware, why)."""
    if _is_cuda(device):
        import torch

        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return ok, ("CUDA device supports bf16" if ok else "this CUDA device has no bf16")
    flag = cpu_bf16_native(flags)
    if flag:
        return True, f"CPU has {flag}"
    return False, f"CPU ({platform.machine()}) has none of {', '.join(BF16_CPU_FLAGS)}"


def resolve_dtype(requested: str | None, device="cpu", *, flags: set[str] | None = None) -> DtypeChoice:
    """The dtype to run in: `auto` (or None) picks bf16 where native, else fp32; an explicit choice is kept."""
    from draftforge.errors import RecipeError

    requested = requested or "auto"
    if requested not in DTYPE_CHOICES:
        raise RecipeError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {requested!r}")
    requested = LONG_NAME.get(requested, requested)
    native, why = native_bf16(device, flags)
    if requested == "auto":
        return DtypeChoice("bfloat16", f"auto: {why}") if native else DtypeChoice("float32", f"auto: {why}")
    if requested == "float32":
        return DtypeChoice("float32", "asked (--dtype float32)")
    if _is_cuda(device):
        return DtypeChoice(requested, f"asked (--dtype {requested})")
    if requested == "float16":
        return DtypeChoice("float16", "asked (--dtype float16); CPUs emulate fp16 matrix products: slow", slow=True)
    if not native:
        return DtypeChoice("bfloat16", f"asked (--dtype bfloat16); {why}, so bf16 is emulated: slow", slow=True)
    return DtypeChoice("bfloat16", f"asked (--dtype bfloat16); {why}")


def resolve_precision(requested: str, *, flags: set[str] | None = None) -> str:
    """train.precision as Accelerate names it (fp32 | bf16 | fp16), through `resolve_dtype` on the device training
    will use: `auto` is bf16 autocast where bf16 is native (CUDA with bf16, AVX512-BF16 / AMX CPUs), else fp32.
    Measured on a Zen 5 CPU (benchmarks/micro/train_throughput.py --compare precision, 200 steps, 1 thread): bf16
    trained the tiny Llama 1.44x and the tiny Mamba2 1.10x faster than fp32, final losses within 0.01% of fp32's."""
    device = "cpu"
    if (requested or "auto") == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return SHORT_NAME[resolve_dtype(requested, device, flags=flags).name]


def announce(choice: DtypeChoice, what: str = "models", say=None) -> None:
    """One line on stderr: the dtype and why; slow emulation is said, never hidden."""
    say = say or (lambda line: print(f"[draftforge] {line}", file=sys.stderr, flush=True))  # a caller's say prefixes
    warn = " WARNING: expect it to run slower than float32" if choice.slow else ""
    say(f"{what} run in {choice.name} ({choice.reason}).{warn}")


def choose_threads(threads: int | None) -> str:
    """Pin torch's intra-op threads (1 unless asked or OMP_NUM_THREADS is set); the sentence saying so.

    Measured on a 2-core machine with other work running: the tiny drafter trained at 4,500-4,900 tok/s
    with 1 thread vs 900-1,200 with 2, and the tiny target decoded at 9-11 vs 32-86 ms/token; SmolLM2 AR
    ran at 7.0 tok/s with 1 thread against 1.1 with torch's default 2. Batch-1 decoding of small models
    gains little from a second thread even on an idle core, and loses several-fold when one is busy."""
    import torch

    if threads is None and os.environ.get("OMP_NUM_THREADS"):
        return f"torch threads: {torch.get_num_threads()} (from OMP_NUM_THREADS)"
    torch.set_num_threads(threads or 1)
    why = "as asked" if threads else "batch-1 decoding gains little from more, and loses several-fold when a core is busy"
    return f"torch threads: {threads or 1} ({why}; change with --threads N)"
