"""Mamba drafter decode-step latency, eager vs CUDA graph, for every batch size of a tree configuration.

Tree drafting by batch expansion (Mamba Drafters §4.1) steps the drafter at batch 1 (committed
tokens) and at B_i = N1·…·N_i (draft depth i). Per batch size we time the same StaticStep eagerly and
replayed as a CUDA graph (after warm-up, median over repeats of `--steps` steps, the two alternated), then
one whole `draft()` of the configuration both ways. On CPU graphs need CUDA: only eager is timed. Prints a
table, writes JSON.

    python -m benchmarks.micro.cuda_graphs --device cuda --kind mamba2 --tree 3,2,2,1 --out cuda_graphs.json
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import add_flags, parse_timed, print_table, rotated_ms, tiny_model, write_json
from draftforge.decode.drafters.cuda_graphs import CudaGraph, StaticStep
from draftforge.decode.drafters.mamba import MambaDrafter
from draftforge.decode import parse_tree
from draftforge.decode.sampling import SamplingParams
from draftforge.decode.tree_shape import as_shape


@torch.inference_mode()
def step_latencies(model, widths, args, device, graphs: bool) -> list[dict]:
    drafter = MambaDrafter(model, model.config.vocab_size, cuda_graphs="off")
    drafter._sync(list(range(1, 17)))  # real state shapes
    rows = []
    for batch in [len(nodes) for nodes in as_shape(widths).fed]:  # the batch stepped per depth (nodes with children)
        states = [(c.repeat(batch, *[1] * (c.dim() - 1)), s.repeat(batch, *[1] * (s.dim() - 1)))
                  for c, s in drafter.live]
        ids_B1 = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)
        row = {"batch": batch}
        modes = {"eager": None, "graph": CudaGraph} if graphs else {"eager": None}
        steps = {name: StaticStep(model, [(c.clone(), s.clone()) for c, s in states],
                                  graph_cls() if graph_cls else None) for name, graph_cls in modes.items()}
        times = rotated_ms({name: (lambda _, step=step: step(ids_B1)) for name, step in steps.items()}, device,
                           repeats=args.repeats, warmup=args.warmup, calls=args.steps)  # eager and graph alternated
        rows.append({**row, **{f"{name}_ms": t["median_ms"] for name, t in times.items()}})
    return rows


@torch.inference_mode()
def draft_latency(model, widths, args, device, modes: dict[str, str]) -> dict[str, float]:
    """{name: median ms of one whole draft} for each cuda_graphs mode (name -> "off" / "on"), modes alternated."""
    seq, params = list(range(1, 17)), SamplingParams()

    def one_draft(mode):
        drafter = MambaDrafter(model, model.config.vocab_size, cuda_graphs=mode)
        gen = torch.Generator(device=device).manual_seed(0)

        def draft(_):
            drafter.draft(seq, widths, params, gen)
            drafter.accept([])  # live state unchanged: every call drafts from the same prefix
        return draft

    times = rotated_ms({name: one_draft(mode) for name, mode in modes.items()}, device, repeats=args.repeats,
                       warmup=args.warmup, calls=args.steps)
    return {name: t["median_ms"] for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", choices=("mamba", "mamba2"), default="mamba2")
    add_flags(p, hidden=256, layers=4, vocab=32000)
    p.add_argument("--tree", default="3,2,2,1", help="tree whose batch sizes are timed: N1,...,Nγ, parent lists "
                   "(parents:0,0,0/0,0,1) or stree13")
    p.add_argument("--steps", type=int, default=20, help="calls per timed repeat")
    add_flags(p, repeats=5, warmup=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--out", default="cuda_graphs.json")
    args = parse_timed(p)
    device, widths = torch.device(args.device), parse_tree(args.tree)
    graphs = device.type == "cuda"
    if not graphs:
        print("CUDA graphs need a CUDA device: timing the eager static-buffer path only.")
    model = tiny_model(args.kind, args.vocab, args.hidden, args.layers, device=device, dtype=getattr(torch, args.dtype))
    rows = step_latencies(model, widths, args, device, graphs)
    draft = draft_latency(model, widths, args, device, {"eager_ms": "off", **({"graph_ms": "on"} if graphs else {})})
    print(f"\n{args.kind} hidden={args.hidden} layers={args.layers} vocab={args.vocab} tree={args.tree} "
          f"device={device} dtype={args.dtype} (median of {args.repeats} x {args.steps} calls)\n")
    table = []
    for row in rows + [{"batch": "-", **draft}]:
        graph = row.get("graph_ms")
        table.append(["draft()" if row["batch"] == "-" else "decode step", row["batch"], f"{row['eager_ms']:.3f}",
                      f"{graph:.3f}" if graph else "n/a", f"{row['eager_ms'] / graph:.2f}x" if graph else "n/a"])
    print_table(["step", "batch", "eager ms", "graph ms", "speedup"], table, right={1, 2, 3, 4})
    write_json(args.out, {"config": vars(args), "graphs_timed": graphs, "steps": rows, "draft": draft,
                          "device_name": torch.cuda.get_device_name(device) if graphs else "cpu"})


if __name__ == "__main__":
    main()
