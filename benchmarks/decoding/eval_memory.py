"""Does a long `draftforge eval` hold its memory? RSS every N prompts per method, and the fitted growth.

    OMP_NUM_THREADS=1 python -m benchmarks.decoding.eval_memory --target T --drafter D --bench B --num-prompts 200
    OMP_NUM_THREADS=1 python -m benchmarks.decoding.eval_memory --random-models llama --num-prompts 200 \
        --max-new-tokens 64
    OMP_NUM_THREADS=1 python -m benchmarks.decoding.eval_memory --random-models hybrid ...   # tiny Bamba + Mamba2 drafter

The run is the eval's own: runner._load, the prompts, runner._build_decoders, then runner._timed_runs (reset,
warm-up, one timed pass per method, the records list kept across methods, PassMemory around each pass). Each
decoder is wrapped in a probe that, every --every timed prompts, runs gc.collect() and reads the process RSS
(psutil). Per method the slope of RSS over prompts is fitted by least squares from --fit-from prompts on
(the pass's first prompts regrow the heap that PassMemory's malloc_trim handed back), and set against the
bytes the records of that method hold per prompt (its tokens and per-round stats: that growth is expected).
The live tensors made since loading are counted at each reading too: they must not grow. Everything alive
once the models are loaded is frozen (gc.freeze), so each gc.collect() scans only what the run made (a full
collection over the loaded libraries would cost ~0.5 s a reading); the run's garbage is collected as ever.
With --sampler-overhead it also times passes with PassMemory's RSS-sampling thread forced on against the
kernel high-water mark (nothing running), alternating, and prints the tok/s ratio.
Prints tables, writes JSON (--out).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import fields, is_dataclass
from pathlib import Path

from benchmarks.common import add_flags, checked_args, one_line_errors, print_table, write_json
from draftforge.decode import parse_tree
from draftforge.decode.methods import per_method
from draftforge.eval import metrics, runner
from draftforge.eval.manifest import command_line
from draftforge.data.prompts import load_prompts


def live_tensors() -> tuple[int, int]:
    """(count, bytes) of the torch tensors the garbage collector tracks, those frozen before the run (weights)
    excluded."""
    import warnings

    import torch

    count = nbytes = 0
    with warnings.catch_warnings():  # isinstance on some objects of torch.distributed warns of deprecation
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor):
                count += 1
                nbytes += obj.numel() * obj.element_size()
    return count, nbytes


@contextmanager
def frozen_heap():
    """gc.freeze() what is alive now (libraries, weights): the probe's gc.collect() then scans only what the
    run made, and live_tensors() counts only tensors made since."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class RssProbe:
    """Wraps a decoder: before the first and after every `every` timed prompts, gc.collect(), then the RSS
    and the live tensors, into `passes[-1]` as dicts (prompts, rss, tensors, tensor_bytes).

    The runner calls reset() before each pass's warm-up, so the first `warmup` calls after it are untimed."""

    def __init__(self, dec, every: int, warmup: int):
        self.dec, self.every, self.warmup = dec, every, warmup
        self.passes: list[list[dict]] = []
        self.count = 0

    def __getattr__(self, name):  # drafter, name, ... of the wrapped decoder
        return getattr(self.dec, name)

    def reset(self) -> None:
        reset = getattr(self.dec, "reset", None)
        if callable(reset):
            reset()
        self.count = -self.warmup
        self.passes.append([])

    def _sample(self) -> None:
        gc.collect()
        rss = metrics.rss_bytes()  # before counting tensors: the walk allocates a little
        tensors, tensor_bytes = live_tensors()
        self.passes[-1].append({"prompts": self.count, "rss": rss, "tensors": tensors, "tensor_bytes": tensor_bytes})

    def generate(self, *args, **kwargs):
        if self.count == 0:
            self._sample()
        out = self.dec.generate(*args, **kwargs)
        self.count += 1
        if self.count > 0 and self.count % self.every == 0:
            self._sample()
        return out


def deep_size(obj, seen: set | None = None) -> int:
    """Bytes of `obj` and everything it references (lists, dicts, dataclasses), each object counted once."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(deep_size(k, seen) + deep_size(v, seen) for k, v in obj.items())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        size += sum(deep_size(x, seen) for x in obj)
    elif is_dataclass(obj) and not isinstance(obj, type):
        size += sum(deep_size(getattr(obj, f.name), seen) for f in fields(obj))
    return size


def growth(series: list[dict], fit_from: int) -> dict:
    """Slope (bytes per prompt) of RSS over prompts from `fit_from` on (the median step: one heap-growth
    jump does not make a leak), the RSS rise over that span, and how many live tensors came or went over it."""
    kept = [s for s in series if s["prompts"] >= fit_from]
    slope = metrics.step_slope([s["prompts"] for s in kept], [s["rss"] for s in kept])
    first, last = (kept[0], kept[-1]) if kept else ({}, {})
    return {"slope_bytes_per_prompt": slope, "fit_prompts": [first.get("prompts"), last.get("prompts")],
            "rise_bytes": last["rss"] - first["rss"] if kept else None,
            "tensors_change": last["tensors"] - first["tensors"] if kept else None,
            "tensor_bytes_change": last["tensor_bytes"] - first["tensor_bytes"] if kept else None}


def config_from(args, target: str, drafter: str | None, bench: str) -> runner.EvalConfig:
    methods = tuple(m for m in args.methods.split(",") if m)
    return runner.EvalConfig(
        target=target, drafter=drafter, bench=bench, methods=methods, baselines=(), num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens, temperatures=(args.temperature,), repeats=1, warmup=args.warmup,
        ignore_eos=True, method_options=per_method(
            {"chain_length": args.chain_length, "tree": parse_tree(args.tree) if args.tree else None}, methods)[0],
        device=args.device, dtype=args.dtype, threads=args.threads, cost_repeats=0, plots=False, quiet=True,
        out_dir=str(Path(args.out).parent), command=command_line())


@contextmanager
def loaded(cfg: runner.EvalConfig):
    """(target, drafter, regime, prompts, decoders) of an eval config, as the eval loads them; torch's thread
    count is restored on the way out."""
    import torch

    cfg = runner.validate(cfg)  # the options resolved once, as run_eval does
    before = torch.get_num_threads()
    try:
        target, drafter, regime = runner._load(cfg)
        prompts = load_prompts(cfg.bench, target.tokenizer, num_prompts=cfg.num_prompts, chat=cfg.chat_template,
                               context_length=target.max_context, max_new_tokens=cfg.max_new_tokens)
        decoders, _ = runner._build_decoders(cfg, target, drafter)
        yield target, drafter, regime, prompts, decoders
    finally:
        torch.set_num_threads(before)


def measure(cfg: runner.EvalConfig, every: int = 10, fit_from: int | None = None, wrap=None) -> dict:
    """The long-run measurement of one eval config (one pass per method): per method its RSS series, the
    fitted slope, the records' bytes per prompt, the pass memory and tok/s. `wrap(method, decoder)`, if
    given, replaces each decoder before it is probed (tests inject a leak with it)."""
    runner.validate(cfg)
    with loaded(cfg) as (target, drafter, regime, prompts, decoders):
        if wrap is not None:
            decoders = {m: wrap(m, dec) for m, dec in decoders.items()}
        probes = {m: RssProbe(dec, every, cfg.warmup) for m, dec in decoders.items()}
        with frozen_heap():
            rss_loaded = metrics.rss_bytes()
            t0 = time.perf_counter()
            records, memory, _ = runner._timed_runs(cfg, probes, prompts, runner._eos_id(cfg, target))
            wall = time.perf_counter() - t0
    fit_from = len(prompts) // 4 if fit_from is None else fit_from
    methods = {}
    for m, probe in probes.items():
        mine = [r for r in records if r.method == m]
        series = probe.passes[-1]
        secs = sum(r.stats.total_time_s for r in mine)
        methods[m] = {"series": series, **growth(series, fit_from),
                      "record_bytes_per_prompt": deep_size(mine) / max(len(mine), 1),
                      "memory": memory.get(f"{m}@{cfg.temperatures[0]:g}"),
                      "tokens_per_s": sum(r.stats.new_tokens for r in mine) / secs if secs else None}
    return {"config": {"target": cfg.target, "drafter": cfg.drafter, "bench": cfg.bench, "methods": list(probes),
                       "num_prompts": len(prompts), "max_new_tokens": cfg.max_new_tokens, "every": every,
                       "fit_from": fit_from, "temperature": cfg.temperatures[0], "dtype": cfg.dtype,
                       "device": cfg.device},
            "target_type": type(target).__name__, "drafter_type": type(drafter).__name__ if drafter else None,
            "regime": regime, "rss_after_load_bytes": rss_loaded, "wall_s": wall, "methods": methods,
            "drafter_steps": len(getattr(getattr(drafter, "runner", None), "steps", ())) or None}


def sampler_overhead(cfg: runner.EvalConfig, rounds: int = 3) -> dict:
    """tok/s of timed passes with PassMemory's sampling thread forced on vs the kernel high-water mark,
    alternating (sampled first in odd rounds); per method the median over rounds of the ratio."""
    with loaded(cfg) as (target, _, _, prompts, decoders):
        eos, out = runner._eos_id(cfg, target), {}
        params = runner.sampling_params(cfg, cfg.temperatures[0])
        for m, dec in decoders.items():
            runner._reset_and_warm(cfg, dec, prompts, params, eos)
            tps = {False: [], True: []}
            for r in range(rounds):
                for sampled in ((False, True) if r % 2 == 0 else (True, False)):
                    with metrics.PassMemory(cfg.device, sampler=sampled):
                        t0, n = time.perf_counter(), 0
                        for i, p in enumerate(prompts):
                            n += runner._run_one(dec, p.input_ids, cfg, params, i, eos).stats.new_tokens
                        tps[sampled].append(n / (time.perf_counter() - t0))
            ratios = [s / k for s, k in zip(tps[True], tps[False])]
            out[m] = {"tokens_per_s_hwm": tps[False], "tokens_per_s_sampled": tps[True],
                      "ratio_median": statistics.median(ratios)}
    return out


def random_models(kind: str, root: Path, num_prompts: int) -> tuple[str, str, str]:
    """(target, drafter, bench) of tiny random models: "llama" (Llama target, Mamba drafter, as
    benchmarks.decoding.spec_decode --random-models), "llama-llama" (Llama drafter) or "hybrid" (Bamba target,
    Mamba2 drafter)."""
    from benchmarks.decoding import spec_decode as bench_mod

    if kind in ("llama", "llama-llama"):
        paths = bench_mod.save_random_models(root)
        drafter = paths["mamba_drafter" if kind == "llama" else "transformer_drafter"]
        return paths["target"], drafter, bench_mod.write_random_prompts(root / "prompts.jsonl", num_prompts)
    if kind != "hybrid":
        raise SystemExit(f"--random-models {kind!r}: use llama, llama-llama or hybrid")
    import torch
    from transformers import BambaConfig, BambaForCausalLM, Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)  # the shapes of tests/fixtures/hybrid.py tiny_bamba and its Mamba2 drafter
    vocab = 64
    mamba = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
                 mamba_expand=2, mamba_chunk_size=8)
    target = BambaForCausalLM(BambaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1, 3], max_position_embeddings=256, pad_token_id=None,
        eos_token_id=None, bos_token_id=None, **mamba))
    drafter = Mamba2ForCausalLM(Mamba2Config(vocab_size=vocab, hidden_size=32, state_size=8, num_hidden_layers=2,
                                             expand=2, conv_kernel=4, num_heads=4, head_dim=16, n_groups=1,
                                             chunk_size=16))
    target.save_pretrained(root / "target")
    drafter.save_pretrained(root / "drafter")
    bench = bench_mod.write_random_prompts(root / "prompts.jsonl", num_prompts, vocab=vocab)
    return str(root / "target"), str(root / "drafter"), bench


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", help="target checkpoint")
    p.add_argument("--bench", default="testbed", help="prompt file or a named bench (default testbed)")
    p.add_argument("--drafter", help="drafter checkpoint (or prompt-lookup)")
    p.add_argument("--random-models", choices=("llama", "llama-llama", "hybrid"),
                   help="tiny random models instead: Llama target + Mamba drafter, + Llama drafter, or Bamba + Mamba2")
    add_flags(p, num_prompts=200, max_new_tokens=64)
    p.add_argument("--methods", default="ar,chain,tree", help="comma-separated (ar always runs)")
    p.add_argument("--every", type=int, default=10, help="read RSS every N prompts (default 10)")
    p.add_argument("--fit-from", type=int, help="fit the slope from this many prompts on (default a quarter)")
    p.add_argument("--warmup", type=int, default=1, help="untimed prompts before each pass (as the eval)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--chain-length", type=int)
    p.add_argument("--tree", help="static tree (widths, parents:..., or stree13)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--threads", type=int)
    p.add_argument("--sampler-overhead", type=int, default=0, metavar="ROUNDS",
                   help="also time ROUNDS pairs of passes with the RSS sampling thread on vs off")
    p.add_argument("--out", default="bench_out/eval_memory.json")
    return checked_args(p, argv)


def kib(x) -> str:
    return "–" if x is None else f"{x / 1024:.1f}"


def print_result(result: dict) -> None:
    methods = result["methods"]
    cfg = result["config"]
    points = sorted({s["prompts"] for m in methods.values() for s in m["series"]})
    by_method = {name: {s["prompts"]: s["rss"] for s in m["series"]} for name, m in methods.items()}
    print(f"\nRSS (MiB) after gc.collect(), every {cfg['every']} prompts: {result['target_type']} target, "
          f"drafter {result['drafter_type']}, {cfg['num_prompts']} prompts x {cfg['max_new_tokens']} tokens\n")
    print_table(["prompts"] + list(methods),
                [[n] + [f"{by_method[m][n] / 2**20:.2f}" if n in by_method[m] else "–" for m in methods]
                 for n in points], right=set(range(len(methods) + 1)))
    print(f"\nslope fitted from prompt {cfg['fit_from']} on; records = bytes the run's records hold per prompt "
          "(tokens + per-round stats, expected to stay)\n")
    rows = []
    for name, m in methods.items():
        mem = m["memory"] or {}
        slope = m["slope_bytes_per_prompt"]
        excess = None if slope is None else slope - m["record_bytes_per_prompt"]
        rows.append([name, kib(slope), kib(m["record_bytes_per_prompt"]), kib(excess),
                     kib(m["rise_bytes"]), f"{m['tensors_change']:+d}",
                     f"+{mem.get('bytes', 0) / 2**20:.1f} ({mem.get('start_bytes', 0) / 2**20:.0f})",
                     f"{m['tokens_per_s']:.0f}" if m["tokens_per_s"] else "–"])
    print_table(["method", "slope KiB/prompt", "records KiB/prompt", "slope - records", "rise KiB (fit span)",
                 "live tensors (fit span)", "pass mem MiB +pass (start)", "tok/s"], rows, right={1, 2, 3, 4, 5, 7})


@one_line_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    if not (args.random_models or args.target):
        raise SystemExit("give --target (and --drafter), or --random-models for tiny random models")
    with tempfile.TemporaryDirectory() as tmp:
        if args.random_models:
            target, drafter, bench = random_models(args.random_models, Path(tmp), args.num_prompts)
        else:
            target, drafter, bench = args.target, args.drafter, args.bench
        cfg = config_from(args, target, drafter, bench)
        result = measure(cfg, every=args.every, fit_from=args.fit_from)
        print_result(result)
        if args.sampler_overhead:
            over = sampler_overhead(cfg, args.sampler_overhead)
            result["sampler_overhead"] = over
            print(f"\nRSS sampling thread (every {metrics.SAMPLE_EVERY_S * 1e3:g} ms) vs none: tok/s ratio, "
                  f"median of {args.sampler_overhead} alternating pairs\n")
            print_table(["method", "tok/s no thread", "tok/s sampled", "ratio"],
                        [[m, f"{statistics.median(o['tokens_per_s_hwm']):.0f}",
                          f"{statistics.median(o['tokens_per_s_sampled']):.0f}", f"{o['ratio_median']:.3f}"]
                         for m, o in over.items()], right={1, 2, 3})
    result["command"] = command_line()
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
