"""Benchmark: verify a full binary token tree through a Mamba2 stack packed (STree) vs unrolled.

packed   : one forward over the packed tree (tree scan: Triton kernel on CUDA, reference on CPU)
unrolled : one sequence per leaf, batched, through transformers' own Mamba2 forward

Depth counts the root (the first drafted token after the accepted prefix): depth d has
2**d − 1 nodes and 2**(d−1) leaves of length d. Times are medians over repeats after warm-up.

    python benchmarks/tree_scan.py --depths 4 5 6 --json runs/bench/tree_scan.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import Mamba2Config, Mamba2ForCausalLM
from transformers.cache_utils import DynamicCache

from draftforge.decode.mamba2_tree import full_binary_parents, leaf_paths, mamba2_tree_logits
from draftforge.eval.report import atomic_write_text


def build_model(args) -> Mamba2ForCausalLM:
    config = Mamba2Config(
        hidden_size=args.hidden, num_heads=args.hidden * 2 // args.head_dim, head_dim=args.head_dim,
        expand=2, n_groups=1, state_size=args.state, conv_kernel=4, num_hidden_layers=args.layers,
        vocab_size=args.vocab, chunk_size=args.chunk_size,
    )
    torch.manual_seed(0)
    return Mamba2ForCausalLM(config).eval().to(args.device, getattr(torch, args.dtype))


def expanded_cache(model, cache, copies: int) -> DynamicCache:
    """A fresh cache holding ``copies`` repeats of the prefix states (one per unrolled sequence)."""
    fresh = DynamicCache(config=model.config)
    for layer in range(model.config.num_hidden_layers):
        conv = cache.get_conv_state(layer).repeat(copies, 1, 1)
        fresh.update_conv_state(conv, layer, conv_kernel_size=conv.shape[-1])
        fresh.update_recurrent_state(cache.get_recurrent_state(layer).repeat(copies, 1, 1, 1), layer)
    return fresh


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_ms(fn, prepare, device, warmup, repeats) -> float:
    times = []
    for i in range(warmup + repeats):
        inputs = prepare()  # built outside the timed region (e.g. a fresh cache)
        sync(device)
        start = time.perf_counter()
        fn(inputs)
        sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


@torch.no_grad()
def bench_depth(model, cache, depth: int, args) -> dict:
    parents = full_binary_parents(depth)
    n_nodes = len(parents)
    paths = leaf_paths(parents)
    tree_ids_1N = torch.randint(0, model.config.vocab_size, (1, n_nodes), device=args.device)
    leaf_ids_LD = tree_ids_1N[0, torch.tensor(paths, device=args.device)]

    def packed(_, impl=args.impl):
        return mamba2_tree_logits(model, tree_ids_1N, parents, cache, impl=impl)[0]

    def unrolled(leaf_cache):
        return model(leaf_ids_LD, cache_params=leaf_cache, use_cache=True).logits

    # Correctness on the way: every leaf path's logits agree between the two.
    packed_logits = packed(None)[0]
    unrolled_logits = unrolled(expanded_cache(model, cache, len(paths)))
    max_diff = max((packed_logits[p] - unrolled_logits[i]).abs().max().item() for i, p in enumerate(paths))
    packed_ms = median_ms(packed, lambda: None, args.device, args.warmup, args.repeats)
    unrolled_ms = median_ms(unrolled, lambda: expanded_cache(model, cache, len(paths)), args.device,
                            args.warmup, args.repeats)
    # On CUDA the packed path runs the kernel; time the PyTorch reference there too (kernel vs spec).
    ref_ms = (median_ms(lambda _: packed(_, "ref"), lambda: None, args.device, args.warmup, args.repeats)
              if args.device.startswith("cuda") and args.impl != "ref" else None)
    return dict(depth=depth, nodes=n_nodes, leaves=len(paths), packed_ref_ms=ref_ms,
                packed_ms=packed_ms, unrolled_ms=unrolled_ms, speedup=unrolled_ms / packed_ms,
                packed_states=1, unrolled_states=len(paths),
                packed_tokens=n_nodes, unrolled_tokens=len(paths) * depth, max_logit_diff=max_diff)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 5, 6])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--state", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--chunk-size", type=int, default=8,
                        help="transformers' chunk scan pads each sequence to this; >= depth keeps it fair")
    parser.add_argument("--prefix", type=int, default=16, help="accepted prefix length before the tree")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--impl", default="auto", choices=["auto", "ref", "triton"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default="runs/bench/tree_scan.json", help="where to write the results")
    args = parser.parse_args(argv)

    model = build_model(args)
    prefix_1T = torch.randint(0, args.vocab, (1, args.prefix), device=args.device)
    with torch.no_grad():
        cache = model(prefix_1T, use_cache=True).cache_params
    rows = [bench_depth(model, cache, depth, args) for depth in args.depths]

    path_kind = "kernel" if args.device.startswith("cuda") and args.impl != "ref" else "reference"
    print(f"Mamba2 stack: {args.layers} layers, hidden {args.hidden}, head_dim {args.head_dim}, "
          f"state {args.state}, {args.dtype} on {args.device} (packed = tree scan {path_kind})")
    print("| depth | nodes | leaves | packed ms | packed (reference) ms | unrolled ms | unrolled/packed "
          "| states packed/unrolled | tokens packed/unrolled | max logit diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ref = "-" if r["packed_ref_ms"] is None else f"{r['packed_ref_ms']:.2f}"
        print(f"| {r['depth']} | {r['nodes']} | {r['leaves']} | {r['packed_ms']:.2f} | {ref} | {r['unrolled_ms']:.2f} "
              f"| {r['speedup']:.2f}x | {r['packed_states']}/{r['unrolled_states']} "
              f"| {r['packed_tokens']}/{r['unrolled_tokens']} | {r['max_logit_diff']:.1e} |")
    out = Path(args.json)
    atomic_write_text(out, json.dumps(dict(args=vars(args), path=path_kind, rows=rows), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
