"""Benchmark: verify a full binary token tree through a Mamba2 stack packed (STree) vs unrolled.

packed   : one forward over the packed tree (tree scan: Triton kernel on CUDA, reference on CPU)
unrolled : one sequence per leaf, batched, through transformers' own Mamba2 forward

Depth counts the root (the first drafted token after the accepted prefix): depth d has
2**d − 1 nodes and 2**(d−1) leaves of length d. Times are medians over repeats after warm-up.

    python -m benchmarks.micro.tree_scan --depths 4 5 6 --json runs/bench/tree_scan.json
"""

from __future__ import annotations

import argparse

import torch
from transformers.cache_utils import DynamicCache

from benchmarks.common import add_flags, parse_timed, print_table, rotated_ms, tiny_model, write_json
from draftforge.decode.targets.stree import full_binary_parents, leaf_paths, mamba2_tree_logits
from draftforge.hfcompat import cache_kwargs, output_cache


def build_model(args):
    return tiny_model("mamba2", args.vocab, args.hidden, args.layers, device=args.device,
                      dtype=getattr(torch, args.dtype), head_dim=args.head_dim, state_size=args.state,
                      conv_kernel=4, chunk_size=args.chunk_size)


def expanded_cache(model, cache, copies: int) -> DynamicCache:
    """A fresh cache holding ``copies`` repeats of the prefix states (one per unrolled sequence)."""
    fresh = DynamicCache(config=model.config)
    for layer in range(model.config.num_hidden_layers):
        conv = cache.get_conv_state(layer).repeat(copies, 1, 1)
        fresh.update_conv_state(conv, layer, conv_kernel_size=conv.shape[-1])
        fresh.update_recurrent_state(cache.get_recurrent_state(layer).repeat(copies, 1, 1, 1), layer)
    return fresh


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
        return model(leaf_ids_LD, use_cache=True, **cache_kwargs(model, leaf_cache)).logits

    # Correctness on the way: every leaf path's logits agree between the two.
    packed_logits = packed(None)[0]
    unrolled_logits = unrolled(expanded_cache(model, cache, len(paths)))
    max_diff = max((packed_logits[p] - unrolled_logits[i]).abs().max().item() for i, p in enumerate(paths))
    fns = {"packed": packed, "unrolled": unrolled}
    if args.device.startswith("cuda") and args.impl != "ref":  # the packed path runs the kernel: time the PyTorch
        fns["ref"] = lambda _: packed(_, "ref")  # reference there too (kernel vs spec)
    ms = rotated_ms(fns, args.device, repeats=args.repeats, warmup=args.warmup,  # methods rotated per repeat
                    prepare={"unrolled": lambda: expanded_cache(model, cache, len(paths))})
    packed_ms, unrolled_ms = ms["packed"]["median_ms"], ms["unrolled"]["median_ms"]
    ref_ms = ms["ref"]["median_ms"] if "ref" in ms else None
    return dict(depth=depth, nodes=n_nodes, leaves=len(paths), packed_ref_ms=ref_ms,
                packed_ms=packed_ms, unrolled_ms=unrolled_ms, speedup=unrolled_ms / packed_ms,
                packed_states=1, unrolled_states=len(paths),
                packed_tokens=n_nodes, unrolled_tokens=len(paths) * depth, max_logit_diff=max_diff)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(parser, depths=[4, 5, 6], layers=4, hidden=256, head_dim=64, state=64, vocab=1024)
    parser.add_argument("--chunk-size", type=int, default=8,
                        help="transformers' chunk scan pads each sequence to this; >= depth keeps it fair")
    parser.add_argument("--prefix", type=int, default=16, help="accepted prefix length before the tree")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--impl", default="auto", choices=["auto", "ref", "triton"])
    add_flags(parser, warmup=3, repeats=10)
    parser.add_argument("--json", default="runs/bench/tree_scan.json", help="where to write the results")
    args = parse_timed(parser, argv)

    model = build_model(args)
    prefix_1T = torch.randint(0, args.vocab, (1, args.prefix), device=args.device)
    with torch.no_grad():
        cache = output_cache(model(prefix_1T, use_cache=True))
    rows = [bench_depth(model, cache, depth, args) for depth in args.depths]

    path_kind = "kernel" if args.device.startswith("cuda") and args.impl != "ref" else "reference"
    print(f"Mamba2 stack: {args.layers} layers, hidden {args.hidden}, head_dim {args.head_dim}, "
          f"state {args.state}, {args.dtype} on {args.device} (packed = tree scan {path_kind})")
    table = [[r["depth"], r["nodes"], r["leaves"], f"{r['packed_ms']:.2f}",
              "-" if r["packed_ref_ms"] is None else f"{r['packed_ref_ms']:.2f}", f"{r['unrolled_ms']:.2f}",
              f"{r['speedup']:.2f}x", f"{r['packed_states']}/{r['unrolled_states']}",
              f"{r['packed_tokens']}/{r['unrolled_tokens']}", f"{r['max_logit_diff']:.1e}"] for r in rows]
    print_table(["depth", "nodes", "leaves", "packed ms", "packed (reference) ms", "unrolled ms", "unrolled/packed",
                 "states packed/unrolled", "tokens packed/unrolled", "max logit diff"], table)
    write_json(args.json, dict(args=vars(args), threads=torch.get_num_threads(), path=path_kind, rows=rows))


if __name__ == "__main__":
    main()
