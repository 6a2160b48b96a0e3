"""Drafter decode latency and memory vs context length: Mamba vs a Transformer of similar size.

Mamba Drafters Fig. 1: a Mamba drafter's per-token cost and state stay flat with context, a
Transformer's KV cache grows linearly. For each context length the drafter prefills a random
context, then we time single-token decode steps (after warm-up, median of repeats) and read
memory (CUDA allocator peak on GPU, process RSS growth on CPU). Prints a table, writes JSON.

    python benchmarks/drafter_context.py --contexts 1024 2048 4096 8192 --steps 16 --out drafter_context.json
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import memory_mb, print_table, time_ms, tiny_model, write_json
from transformers import DynamicCache


@torch.inference_mode()
def measure(model, ctx: int, steps: int, repeats: int, device) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (1, ctx), device=device)
    cache_key = "cache_params" if model.config.model_type == "mamba" else "past_key_values"
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    mem_before = memory_mb(device)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_key: cache})  # no ctx x V logits
    tok = ids[:, -1:]
    times = time_ms(lambda: model(input_ids=tok, use_cache=True, **{cache_key: cache}), device, repeats,
                    calls=steps, warmup=1)
    state_mb = sum(t.numel() * t.element_size() for t in _cache_tensors(cache)) / 2**20
    return {"context": ctx, "ms_per_token": statistics.median(times), "ms_min": min(times), "ms_max": max(times),
            "state_mb": state_mb, "memory_growth_mb": memory_mb(device) - mem_before}


def _cache_tensors(cache):
    for layer in cache.layers:
        for name in ("keys", "values"):
            if isinstance(getattr(layer, name, None), torch.Tensor):
                yield getattr(layer, name)
        for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
            yield from (t for t in states.values() if isinstance(t, torch.Tensor))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="drafter_context.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = []
    for kind in ("mamba", "llama"):
        extra = {"max_position_embeddings": max(args.contexts) + 16} if kind == "llama" else {}
        model = tiny_model(kind, args.vocab, args.hidden, args.layers, device=device, **extra)
        params_m = sum(p.numel() for p in model.parameters()) / 1e6
        for ctx in args.contexts:
            rows.append({"drafter": "transformer" if kind == "llama" else kind, "params_m": round(params_m, 2),
                         **measure(model, ctx, args.steps, args.repeats, device)})
    print_table(["drafter", "params (M)", "context", "ms/token", "min", "max", "state MB", "mem +MB"],
                [[r["drafter"], f"{r['params_m']:.2f}", r["context"], f"{r['ms_per_token']:.2f}", f"{r['ms_min']:.2f}",
                  f"{r['ms_max']:.2f}", f"{r['state_mb']:.2f}", f"{r['memory_growth_mb']:.1f}"] for r in rows],
                right=set(range(1, 8)))
    write_json(args.out, {"device": str(device), "torch": torch.__version__, "args": vars(args), "rows": rows},
               indent=1)


if __name__ == "__main__":
    main()
