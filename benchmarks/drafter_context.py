"""Drafter decode latency and memory vs context length: Mamba vs a Transformer of similar size.

Mamba Drafters Fig. 1: a Mamba drafter's per-token cost and state stay flat with context, a
Transformer's KV cache grows linearly. For each context length the drafter prefills a random
context, then we time single-token decode steps (after warm-up, median of repeats) and read
memory (CUDA allocator peak on GPU, process RSS growth on CPU). Prints a table, writes JSON.

    python benchmarks/drafter_context.py --contexts 1024 2048 4096 8192 --steps 16 --out drafter_context.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import psutil
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, MambaConfig, MambaForCausalLM


def build(kind: str, hidden: int, layers: int, vocab: int, max_ctx: int):
    torch.manual_seed(0)
    if kind == "mamba":
        return MambaForCausalLM(MambaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, state_size=16))
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=max(hidden // 64, 1), max_position_embeddings=max_ctx)
    return LlamaForCausalLM(config)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return psutil.Process(os.getpid()).memory_info().rss / 2**20


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
    model(input_ids=tok, use_cache=True, **{cache_key: cache})  # warm-up step
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            model(input_ids=tok, use_cache=True, **{cache_key: cache})
        sync(device)
        times.append((time.perf_counter() - t0) / steps * 1e3)
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
    for kind in ("mamba", "transformer"):
        model = build(kind, args.hidden, args.layers, args.vocab, max(args.contexts) + 16).to(device).eval()
        params_m = sum(p.numel() for p in model.parameters()) / 1e6
        for ctx in args.contexts:
            rows.append({"drafter": kind, "params_m": round(params_m, 2), **measure(model, ctx, args.steps, args.repeats, device)})
    header = f"{'drafter':<12}{'params(M)':>10}{'context':>9}{'ms/token':>10}{'min':>8}{'max':>8}{'state MB':>10}{'mem +MB':>9}"
    print(header)
    for r in rows:
        print(f"{r['drafter']:<12}{r['params_m']:>10.2f}{r['context']:>9}{r['ms_per_token']:>10.2f}{r['ms_min']:>8.2f}"
              f"{r['ms_max']:>8.2f}{r['state_mb']:>10.2f}{r['memory_growth_mb']:>9.1f}")
    with open(args.out, "w") as f:
        json.dump({"device": str(device), "torch": torch.__version__, "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
