"""Helpers the benchmark scripts share: timing, tiny random models, memory, JSON and table output.

The benchmarks run from the repository root as `python -m benchmarks.GROUP.NAME` and import these with
`from benchmarks.common import ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]  # the repository root


def sync(device) -> None:
    """Wait for queued CUDA work (a no-op elsewhere) so a timer reads finished work."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, repeats: int, *, calls: int = 1, warmup: int = 0, prepare=None) -> list[float]:
    """Per repeat, the mean ms of one call, after `warmup` untimed calls.

    With `prepare`, prepare() runs once per repeat outside the timed region (e.g. a fresh cache) and every call of
    that repeat is fn(its result); without it each call is fn().
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


def rotated_ms(fns: dict[str, Callable], device, *, repeats: int, warmup: int, calls: int = 1,
               prepare: dict[str, Callable] | None = None) -> dict[str, dict]:
    """{name: {median_ms, min_ms, max_ms}} per call: untimed warm-up calls of every method first, then `repeats`
    rounds in which the methods run in a rotating order (round r starts at method r mod M), each round's time the
    mean of `calls` calls between two device syncs. prepare[name](), when given,
    runs outside the clock before each round and its value is passed to every call of fns[name]."""
    prepare = prepare or {}
    names = list(fns)

    def rounds(name):
        return prepare[name]() if name in prepare else None

    for name in names:
        for _ in range(warmup):
            fns[name](rounds(name))
    times = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            inputs = rounds(name)
            sync(device)
            t0 = time.perf_counter()
            for _ in range(calls):
                fns[name](inputs)
            sync(device)
            times[name].append((time.perf_counter() - t0) / calls * 1e3)
    return {name: {"median_ms": statistics.median(ts), "min_ms": min(ts), "max_ms": max(ts)}
            for name, ts in times.items()}


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


WRITTEN_BY = "draftforge benchmarks"  # the value of "written_by" in every JSON that write_json / write_digest write


def ours(data) -> bool:
    """Whether parsed JSON is a result or digest this module wrote (its "written_by" mark): only those are replaced."""
    return isinstance(data, dict) and data.get("written_by") == WRITTEN_BY


def json_out_problem(path, flag: str = "--out", what: str = "a JSON result", accept=ours) -> str | None:
    """Why a benchmark's JSON cannot go to `path`, else None: a directory there, a file that is not `what` (JSON
    that `accept` takes: a user's file, even a JSON object, is not replaced; an earlier result is), or no writable
    folder to make it in."""
    path = Path(path)
    if path.is_dir():
        return f"{flag} {path} is a directory; give the JSON file's name"
    if path.exists() or path.is_symlink():
        try:
            ours = accept(json.loads(path.read_text()))
        except (OSError, ValueError):
            ours = False
        if not ours:
            return (f"{flag} {path} exists and is not {what} written by draftforge's benchmarks; it is not replaced: "
                    f"give another {flag}")
    parent = next((q for q in path.absolute().parents if q.exists()), None)
    if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK):
        return f"{flag} {path}: {parent} is not a writable directory"
    return None


def write_json(path, result, indent: int = 2):
    """Write `result` as JSON atomically (parents created), marked as ours (a dict gets "written_by"), say where,
    and return what was written. Where `path` cannot take it (json_out_problem) the result is printed instead and
    the run exits 2."""
    from draftforge.eval.report import atomic_write_text

    path = Path(path)
    marked = {**result, "written_by": WRITTEN_BY} if isinstance(result, dict) else result
    text = json.dumps(marked, indent=indent, default=str) + "\n"
    problem = json_out_problem(path)
    if problem:
        print(text)
        raise SystemExit(f"error: {problem} (the result is printed above)")
    atomic_write_text(path, text)
    print(f"wrote {path}")
    return marked


def print_table(headers: list[str], rows: list[list], right: set[int] | frozenset = frozenset()) -> None:
    """A Markdown table; cells are printed as given (format numbers first), columns in `right` right-aligned."""
    print("| " + " | ".join(headers) + " |")
    print("|" + "|".join("---:" if i in right else "---" for i in range(len(headers))) + "|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


COUNTS = ("repeats", "calls", "num_prompts", "max_new_tokens", "batch_size", "batch", "block", "threads")


def positive_int(text: str) -> int:
    """An argparse type for a count that must be >= 1 (repeats 0 or -1 ended in `no median for empty data`)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def number_list(kind=float, minimum: float | None = None, empty_ok: bool = False):
    """An argparse type for a comma list of numbers ('0,1' -> (0.0, 1.0)): a part that is not a `kind`, is below
    `minimum`, is not finite or is given twice, or no value at all unless `empty_ok`, is refused with the parser's
    usage line, not a traceback minutes in."""
    def parse(text: str) -> tuple:
        values = []
        for part in (p.strip() for p in str(text).split(",")):
            if not part:
                continue
            try:
                value = kind(part)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"expects a comma list of {'whole numbers' if kind is int else 'numbers'}, got {part!r}") from None
            if value != value or value in (float("inf"), float("-inf")):
                raise argparse.ArgumentTypeError(f"expects finite numbers, got {part!r}")
            if minimum is not None and value < minimum:
                raise argparse.ArgumentTypeError(f"values must be >= {minimum:g}, got {part!r}")
            if value in values:
                raise argparse.ArgumentTypeError(f"{part!r} is given twice; give each value once")
            values.append(value)
        if not values and not empty_ok:
            raise argparse.ArgumentTypeError("expects at least one value")
        return tuple(values)

    parse.__name__ = f"{kind.__name__} list"  # argparse names the type in its message
    return parse


def add_flags(parser, **defaults) -> None:
    """Plain options, each `--name-with-dashes` typed by its default (a list default takes one or more values):
    add_flags(p, num_prompts=8, max_new_tokens=64) is --num-prompts 8 and --max-new-tokens 64. A count (COUNTS)
    must be >= 1."""
    for name, default in defaults.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, list):
            parser.add_argument(flag, type=type(default[0]), nargs="+", default=default)
        else:
            kind = positive_int if name in COUNTS and type(default) is int else type(default)
            parser.add_argument(flag, type=kind, default=default)


def drafters_parser(doc: str, *, bench: str, num_prompts: int) -> argparse.ArgumentParser:
    """The options of the scripts that hold drafters up against one target: --target, --drafter (repeat),
    --bench, --num-prompts, --max-new-tokens (64); paths with ~ expanded."""
    def path(text: str) -> str:
        return str(Path(text).expanduser())

    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--target", required=True, type=path, help="target dir (with its tokenizer)")
    p.add_argument("--drafter", action="append", required=True, type=path,
                   help="drafter export dir; repeat to compare")
    p.add_argument("--bench", default=bench, help=f"prompt file or named bench, as for `draftforge eval` "
                                                  f"(default {bench})")
    add_flags(p, num_prompts=num_prompts, max_new_tokens=64)
    return p


def print_drafters(result: dict, headers: list[str], cells) -> None:
    """The table of result["drafters"] (drafter dir -> stats): a row per drafter, cells(stats) after its name."""
    print_table(["drafter", *headers], [[d, *cells(s)] for d, s in result["drafters"].items()])


def parse_timed(parser, argv=None):
    """parser.parse_args(argv) with --threads added, and torch's threads chosen as the CLI chooses them (1
    unless asked or OMP_NUM_THREADS is set; the choice printed)."""
    from draftforge.runtime import choose_threads

    parser.add_argument("--threads", type=int, help="torch threads (default 1, or OMP_NUM_THREADS)")
    args = checked_args(parser, argv)
    print(choose_threads(args.threads))
    return args


def checked_args(parser, argv=None, files: dict[str, str] | None = None):
    """parser.parse_args(argv), and the result's JSON file checked before the minutes of measuring (a usage error
    where write_json would refuse it at the end): --out / --json where they name a .json file, and `files`
    (flag -> the file's name inside that flag's directory, e.g. {"out": "context_curves.json"})."""
    args = parser.parse_args(argv)
    for name in dict.fromkeys(("out", "json", *(files or {}))):
        value = getattr(args, name, None)
        if not isinstance(value, str):
            continue
        path = str(Path(value) / files[name]) if files and name in files else value
        problem = json_out_problem(path, f"--{name}") if path.endswith(".json") else None
        if problem:
            parser.error(problem)
    return args


def load_models(args, drafter: bool = True):
    """(target, drafter) from --target and --drafter at the --dtype chosen (add_dtype_flag); drafter None
    when not asked for."""
    from draftforge.decode import load_drafter, load_target

    dtype = chosen_dtype(args)
    target = load_target(args.target, dtype=dtype)
    return target, load_drafter(args.drafter, target, dtype=dtype) if drafter else None


def add_dtype_flag(parser) -> None:
    """--dtype as `draftforge eval` has it (runtime.add_dtype_flag): auto is bf16 where the device computes it."""
    from draftforge.runtime import add_dtype_flag as add

    add(parser)


def chosen_dtype(args, device: str = "cpu"):
    """The torch dtype --dtype resolves to, said once on stderr with the reason."""
    from draftforge.runtime import announce, resolve_dtype

    choice = resolve_dtype(args.dtype, getattr(args, "device", None) or device)
    announce(choice, "models")
    return choice.torch_dtype


def versus_ar(target, prompts, ar_outputs, outputs, stats=None, check_ar_tokens: bool = True) -> dict:
    """The T=0 self-check of `draftforge eval` (draftforge/eval/selfcheck.py) for a benchmark's greedy outputs:
    per prompt identical to AR's, a near-tie (at the first differing position the two tokens' logits are within
    the rounding the model's own plain forward shows there against float32; bf16), or a defect; AR's own tokens
    are checked against that plain forward too (`check_ar_tokens`; off only for hand-made AR outputs). prompts: token-id lists; outputs: one token list
    per prompt (a method's last repeat); stats: their DecodeStats (the row counts to probe), else 2 rows.
    `ok` is False on any defect and, as the eval's self-check rules, in fp32 on any difference at all (there the
    harness is bitwise lossless; the difference is still classified, for the report)."""
    from draftforge.decode.base import DecodeStats
    from draftforge.eval.metrics import RunRecord
    from draftforge.eval.selfcheck import self_check

    ids = {str(k): list(p) for k, p in enumerate(prompts)}
    stats = list(stats) if stats else [DecodeStats() for _ in outputs]
    mine = [RunRecord("method", 0.0, 0, str(k), len(ids[str(k)]), list(o), s)
            for k, (o, s) in enumerate(zip(outputs, stats))]
    ar = [RunRecord("ar", 0.0, 0, str(k), len(ids[str(k)]), list(r), DecodeStats()) for k, r in enumerate(ar_outputs)]
    out = self_check(mine, ar, ids, target, check_ar_tokens)  # the eval's own count and classifier
    model = getattr(target, "model", None)
    fp32 = model is not None and next(model.parameters()).dtype == torch.float32
    out["ok"] = out["defects"] == 0 and not (fp32 and out["identical"] < out["total"])
    return out


def versus_ar_cell(check: dict) -> str:
    """'4/6 (2 near-tie)' / '6/6' / '3/6 (1 near-tie, 2 DEFECT)' for a table."""
    notes = [f"{check['near_ties']} near-tie"] if check["near_ties"] else []
    notes += [f"{check['defects']} DEFECT"] if check["defects"] else []
    return f"{check['identical']}/{check['total']}" + (f" ({', '.join(notes)})" if notes else "")


def one_line_errors(main):
    """A benchmark's main() whose draftforge errors (an unknown method, a bad option) end in one `error:` line and
    exit 2, as draftforge's own commands do, not a traceback."""
    import functools

    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        from draftforge.errors import DraftforgeError

        try:
            return main(*args, **kwargs)
        except DraftforgeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    return wrapped


def digest_cli(doc: str, make, compare) -> int:
    """The regression digests' command line: `--out FILE` runs make(FILE), `--compare A B` runs compare(A, B)
    (each returns the exit status: 1 where the digests differ; 2 for a file that cannot be read or written)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", help="write the digest JSON here (a new file, or a digest written before)")
    what.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two digests (exit 1 if they differ)")
    args = p.parse_args()
    try:
        if args.compare:
            return compare(*args.compare)
        digest_out_problem(args.out)  # before the minutes of work, not after them
        return make(args.out)
    except DigestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


class DigestError(Exception):
    """A digest file that cannot be read, or an --out that cannot take one."""


def read_digest(path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise DigestError(f"{path}: not a readable digest ({getattr(e, 'strerror', None) or e})") from None
    if not isinstance(data, dict):
        raise DigestError(f"{path}: not a digest (a digest is a JSON object)")
    data.pop("written_by", None)  # the mark is not a digest entry (digests written before it have none)
    return data


def digest_out_problem(out) -> None:
    """--out must be a new file or an earlier digest (its "written_by" mark): a user's file there is not replaced."""
    problem = json_out_problem(out, what="a digest")
    if problem:
        raise DigestError(problem)


def write_digest(out, result: dict, indent: int | None = None) -> None:
    digest_out_problem(out)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({**result, "written_by": WRITTEN_BY}, indent=indent))
    print(f"wrote {out}")
