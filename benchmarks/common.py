"""Helpers the benchmark scripts share: timing, tiny random models, memory, JSON and table output.

The benchmarks run as `python benchmarks/X.py`, which puts this folder first on sys.path, so each
imports these with `from common import ...`.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch


def sync(device) -> None:
    """Wait for queued CUDA work (a no-op elsewhere) so a timer reads finished work."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, repeats: int, *, calls: int = 1, warmup: int = 0, prepare=None) -> list[float]:
    """Per repeat, the mean ms of one call, after `warmup` untimed calls.

    With `prepare`, each call is fn(prepare()) and prepare runs outside the timed region (once per
    repeat, e.g. a fresh cache); without it each call is fn().
    """
    def call(inputs=None):
        return fn() if prepare is None else fn(inputs)

    for _ in range(warmup):
        call(prepare() if prepare else None)
    times = []
    for _ in range(repeats):
        inputs = prepare() if prepare else None
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            call(inputs)
        sync(device)
        times.append((time.perf_counter() - t0) / calls * 1e3)
    return times


def median_ms(fn, device, repeats: int, **kwargs) -> float:
    """statistics.median of `time_ms` (same arguments)."""
    return statistics.median(time_ms(fn, device, repeats, **kwargs))


def tiny_model(kind: str, vocab: int, hidden: int, layers: int, *, device="cpu", dtype=torch.float32, seed: int = 0,
               **config):
    """A random "mamba", "mamba2" or "llama" causal LM in eval mode; `config` overrides the defaults below.

    Defaults: Mamba state 16; Mamba2 state 64, head_dim 64, expand 2, one group, heads derived;
    Llama FFN 3x hidden, one head per 64 channels.
    """
    from transformers import (LlamaConfig, LlamaForCausalLM, Mamba2Config, Mamba2ForCausalLM, MambaConfig,
                              MambaForCausalLM)

    common = {"vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers}
    if kind == "mamba":
        model_cls, cfg = MambaForCausalLM, MambaConfig(**{"state_size": 16, **common, **config})
    elif kind == "mamba2":
        dims = {"state_size": 64, "head_dim": 64, "expand": 2, "n_groups": 1, **common, **config}
        dims.setdefault("num_heads", dims["expand"] * hidden // dims["head_dim"])
        model_cls, cfg = Mamba2ForCausalLM, Mamba2Config(**dims)
    elif kind == "llama":
        dims = {"intermediate_size": 3 * hidden, "num_attention_heads": max(hidden // 64, 1), **common, **config}
        model_cls, cfg = LlamaForCausalLM, LlamaConfig(**dims)
    else:
        raise SystemExit(f"unknown model kind {kind!r}: use mamba, mamba2 or llama")
    from draftforge.loading import note_cpu_kernels

    torch.manual_seed(seed)
    model = model_cls(cfg).to(device=device, dtype=dtype).eval()
    note_cpu_kernels(model)  # says once what runs without CUDA kernels; drops transformers' install advice
    return model


def memory_mb(device) -> float:
    """CUDA allocator peak on a GPU, this process's resident memory elsewhere, in MiB."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss / 2**20


def write_json(path, result, indent: int = 2) -> Path:
    """Write `result` as JSON atomically (parents created) and say where."""
    from draftforge.eval.report import atomic_write_text

    path = Path(path)
    atomic_write_text(path, json.dumps(result, indent=indent, default=str) + "\n")
    print(f"wrote {path}")
    return path


def print_table(headers: list[str], rows: list[list], right: set[int] | frozenset = frozenset()) -> None:
    """A Markdown table; cells are printed as given (format numbers first), columns in `right` right-aligned."""
    print("| " + " | ".join(headers) + " |")
    print("|" + "|".join("---:" if i in right else "---" for i in range(len(headers))) + "|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


def add_dtype_flag(parser) -> None:
    """--dtype as `draftforge eval` has it: auto (default) is bf16 where the device computes it natively."""
    from draftforge.runtime import DTYPE_CHOICES

    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="model dtype: auto (default) = bfloat16 where the device computes it natively, else "
                             "float32")


def chosen_dtype(args, device: str = "cpu"):
    """The torch dtype --dtype resolves to, said once on stderr with the reason."""
    from draftforge.runtime import announce, resolve_dtype

    choice = resolve_dtype(args.dtype, getattr(args, "device", None) or device)
    announce(choice, "models")
    return choice.torch_dtype
