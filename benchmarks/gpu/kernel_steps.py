"""Steps 2 and 3 of the GPU check: STree's Triton tree scan against its PyTorch reference and against unrolled
per-path scans (benchmarks/micro/tree_scan.py's model and caches), and the Mamba2 drafter's decode step
replayed as a CUDA graph against eager (draftforge/decode/drafters/cuda_graphs.py), per batch size of a tree and for one
whole draft().

Timing: untimed warm-up calls of every method first, then `repeats` rounds in which the methods run in a
rotating order (round r starts at method r mod M), each round's time the mean of `calls` calls between two
device syncs; reported: the median over rounds, with min and max. Nothing is asserted on a time.
"""

from __future__ import annotations

import argparse
import os
from typing import Callable

from benchmarks.common import rotated_ms  # noqa: F401  (this module's steps time with it)
from benchmarks.gpu.record import Skip

TREE = {  # the tree-scan micro-benchmark's defaults on the GPU; a toy model for --dry-run
    "full": dict(depths=(4, 5, 6), layers=4, hidden=256, head_dim=64, state=64, vocab=1024, chunk_size=8,
                 prefix=16, dtype="float32", repeats=15, warmup=3),
    "dry": dict(depths=(3,), layers=2, hidden=64, head_dim=16, state=16, vocab=256, chunk_size=8, prefix=8,
                dtype="float32", repeats=2, warmup=1),
}
GRAPH = {  # the recipes' drafter (recipes/pretrain.yaml: Mamba2 "130m"), bf16 as `--dtype auto` picks on CUDA
    "full": dict(size="130m", vocab=32000, tree="3,2,2,1", prefix=16, dtype="bfloat16", calls=20, repeats=7,
                 warmup=3),
    "dry": dict(size="tiny", vocab=256, tree="2,2", prefix=8, dtype="float32", calls=2, repeats=2, warmup=1),
}


def kernel_unavailable(device: str) -> str | None:
    """Why the Triton tree-scan kernel cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return ("the Triton kernel needs CUDA, or on CPU TRITON_INTERPRET=1 set before triton is imported "
                "(--dry-run sets it when triton is installed)")
    return None


def tree_scan_step(ctx) -> dict:
    """Step 2: kernel vs reference vs unrolled per full binary tree depth; logits checked against unrolled."""
    import torch

    from benchmarks.micro import tree_scan as micro
    from draftforge.hfcompat import output_cache

    size = ctx.size(TREE)
    no_kernel = kernel_unavailable(ctx.device)
    model = micro.build_model(argparse.Namespace(device=ctx.device, **size))
    prefix_1T = torch.randint(0, size["vocab"], (1, size["prefix"]), device=ctx.device)
    with torch.inference_mode():
        cache = output_cache(model(prefix_1T, use_cache=True))
        rows = [tree_depth(model, cache, depth, size, ctx.device, no_kernel is None) for depth in size["depths"]]
    base = "kernel" if no_kernel is None and ctx.device == "cuda" else "reference"  # interpreted: no speed
    last = rows[-1]
    summary = (f"depth {last['depth']} ({last['nodes']} nodes): "
               + ", ".join(f"{m} {last[m + '_ms']:.2f} ms" for m in ("kernel", "reference", "unrolled")
                           if last.get(m + "_ms") is not None)
               + f"; unrolled/{base} {last['unrolled_ms'] / last[base + '_ms']:.2f}x")
    notes = [f"Mamba2 stack {size['layers']} layers, hidden {size['hidden']}, head_dim {size['head_dim']}, state "
             f"{size['state']}, {size['dtype']} on {ctx.device}; full binary trees, prefix {size['prefix']} tokens; "
             f"median of {size['repeats']} rotated rounds after {size['warmup']} warm-up calls each"]
    if no_kernel:
        notes.append(f"kernel not timed: {no_kernel}")
    elif ctx.device != "cuda":
        notes.append("kernel ran under TRITON_INTERPRET=1 on CPU: its times say nothing about the GPU")
    headers = ["depth", "nodes", "leaves", "kernel ms", "reference ms", "unrolled ms", "reference/kernel",
               "unrolled/kernel", "unrolled/reference", "max |Δlogit| kernel, reference vs unrolled"]
    table = [[r["depth"], r["nodes"], r["leaves"], _ms(r.get("kernel_ms")), _ms(r["reference_ms"]),
              _ms(r["unrolled_ms"]), _ratio(r["reference_ms"], r.get("kernel_ms")),
              _ratio(r["unrolled_ms"], r.get("kernel_ms")), _ratio(r["unrolled_ms"], r["reference_ms"]),
              f"{_sci(r.get('kernel_max_diff'))}, {_sci(r['reference_max_diff'])}"] for r in rows]
    return {"kernel": no_kernel or "timed", "config": size, "rows": rows, "summary": summary, "notes": notes,
            "table": {"headers": headers, "rows": table}}


def tree_depth(model, cache, depth: int, size: dict, device: str, with_kernel: bool) -> dict:
    """One depth: the three methods timed in rotation, each packed method's leaf logits against unrolled."""
    import torch

    from benchmarks.micro.tree_scan import expanded_cache
    from draftforge.decode.targets.stree import full_binary_parents, leaf_paths, mamba2_tree_logits
    from draftforge.hfcompat import cache_kwargs

    parents = full_binary_parents(depth)
    paths = leaf_paths(parents)
    tree_ids_1N = torch.randint(0, model.config.vocab_size, (1, len(parents)), device=device)
    leaf_ids_LD = tree_ids_1N[0, torch.tensor(paths, device=device)]

    def packed(impl: str) -> Callable:
        return lambda _: mamba2_tree_logits(model, tree_ids_1N, parents, cache, impl=impl)[0]

    def unrolled(leaf_cache):
        return model(leaf_ids_LD, use_cache=True, **cache_kwargs(model, leaf_cache)).logits

    def fresh_cache():
        return expanded_cache(model, cache, len(paths))

    fns = {"kernel": packed("triton")} if with_kernel else {}
    fns.update(reference=packed("ref"), unrolled=unrolled)
    want = unrolled(fresh_cache())
    row = {"depth": depth, "nodes": len(parents), "leaves": len(paths)}
    for name in fns:
        if name != "unrolled":
            got = fns[name](None)[0]
            row[f"{name}_max_diff"] = max((got[p] - want[i]).abs().max().item() for i, p in enumerate(paths))
    times = rotated_ms(fns, device, repeats=size["repeats"], warmup=size["warmup"],
                       prepare={"unrolled": fresh_cache})
    for name, t in times.items():
        row[f"{name}_ms"], row[f"{name}_ms_range"] = t["median_ms"], [t["min_ms"], t["max_ms"]]
    return row


def cuda_graph_step(ctx) -> dict:
    """Step 3: the Mamba2 drafter's decode step, eager vs CUDA graph (CUDA only)."""
    if ctx.device != "cuda":
        raise Skip("needs CUDA")
    from draftforge.decode.drafters.cuda_graphs import CudaGraph

    return graph_vs_eager(ctx.size(GRAPH), "cuda", CudaGraph)


def graph_vs_eager(size: dict, device: str, graph_factory) -> dict:
    """Per batch size of the tree, the same StaticStep eager and graphed (graph_factory(): CudaGraph, or a CPU
    stand-in in tests), then one whole draft() both ways; the graphed logits compared with the eager ones."""
    import torch

    from draftforge.decode import parse_tree
    from draftforge.decode.drafters.mamba import MambaDrafter
    from draftforge.decode.sampling import SamplingParams
    from draftforge.models.mamba import build_mamba

    torch.manual_seed(0)
    dtype = getattr(torch, size["dtype"])
    model = build_mamba("mamba2", size["vocab"], size=size["size"]).to(device=device, dtype=dtype).eval()
    shape = parse_tree(size["tree"])
    seq = list(range(1, size["prefix"] + 1))
    rows = [step_row(model, batch, seq, size, device, graph_factory) for batch in [len(n) for n in shape.fed]]
    drafters = {name: MambaDrafter(model, size["vocab"], cuda_graphs=mode, graph_factory=factory)
                for name, mode, factory in (("eager", "off", None), ("graph", "on", graph_factory))}
    gen = torch.Generator(device=device).manual_seed(0)

    def draft(drafter):
        def once(_):
            drafter.draft(seq, shape, SamplingParams(), gen)
            drafter.accept([])  # the live state stays: every call drafts from the same prefix
        return once

    with torch.inference_mode():
        draft_ms = rotated_ms({n: draft(d) for n, d in drafters.items()}, device, repeats=size["repeats"],
                              warmup=size["warmup"], calls=size["calls"])
    rows.append({"batch": "draft()", "eager_ms": draft_ms["eager"]["median_ms"],
                 "graph_ms": draft_ms["graph"]["median_ms"], "max_diff": None})
    for row in rows:
        row["speedup"] = row["eager_ms"] / row["graph_ms"]
    params = sum(p.numel() for p in model.parameters())
    summary = (f"batch 1 step: eager {rows[0]['eager_ms']:.3f} ms, graph {rows[0]['graph_ms']:.3f} ms "
               f"({rows[0]['speedup']:.2f}x); draft() {rows[-1]['speedup']:.2f}x")
    table = [[r["batch"], f"{r['eager_ms']:.3f}", f"{r['graph_ms']:.3f}", f"{r['speedup']:.2f}x", _sci(r["max_diff"])]
             for r in rows]
    return {"config": size, "params": params, "rows": rows, "summary": summary,
            "notes": [f"Mamba2 drafter preset {size['size']!r} ({params / 1e6:.1f} M parameters, vocab "
                      f"{size['vocab']}), {size['dtype']}, tree {size['tree']}; median of {size['repeats']} rotated "
                      f"rounds of {size['calls']} calls"],
            "table": {"headers": ["batch", "eager ms", "graph ms", "eager/graph", "max |Δlogit|"], "rows": table}}


def step_row(model, batch: int, seq: list[int], size: dict, device: str, graph_factory) -> dict:
    """One batch size: eager and graphed StaticSteps over copies of the same prefilled states."""
    import torch

    from draftforge.decode.drafters.cuda_graphs import StaticStep
    from draftforge.decode.drafters.mamba import MambaDrafter

    with torch.inference_mode():
        prefill = MambaDrafter(model, size["vocab"], cuda_graphs="off")
        prefill._sync(seq)  # real prefix states (the benchmark in benchmarks/micro/cuda_graphs.py does the same)
        states = [(c.repeat(batch, *[1] * (c.dim() - 1)), s.repeat(batch, *[1] * (s.dim() - 1)))
                  for c, s in prefill.live]
        steps = {"eager": StaticStep(model, [(c.clone(), s.clone()) for c, s in states]),
                 "graph": StaticStep(model, [(c.clone(), s.clone()) for c, s in states], graph_factory())}
        ids_B1 = torch.randint(0, size["vocab"], (batch, 1), device=device)
        first = {name: step(ids_B1).float().clone() for name, step in steps.items()}  # the graph captures here
        ms = rotated_ms({name: (lambda _, step=step: step(ids_B1)) for name, step in steps.items()}, device,
                        repeats=size["repeats"], warmup=size["warmup"], calls=size["calls"])
    return {"batch": batch, "eager_ms": ms["eager"]["median_ms"], "graph_ms": ms["graph"]["median_ms"],
            "max_diff": (first["graph"] - first["eager"]).abs().max().item()}


def _ms(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ratio(num, den) -> str:
    return "-" if num is None or den is None else f"{num / den:.2f}x"


def _sci(value) -> str:
    return "-" if value is None else f"{value:.1e}"
