"""Plain decoding through the harness against context length: where a round's time goes, before and after the
four changes that remove per-token work (packed linear weights, decode/packing.py; the growing KV cache,
decode/targets/growing_cache.py; the decode attention, decode/attention.py; the lean forward,
decode/lean_forward.py).

For each context length a random prompt of that many tokens is prefilled (not timed), then `--steps` tokens are
decoded AR through `draftforge.decode` (EOS ignored). Per decoded token: the round's time, the time inside the
target model's forward (a hook around it, or around the lean forward; the KV cache's append happens inside it),
and the rest, the harness's own overhead per round (verification, commit, bookkeeping). Variants are rotated within each repeat; medians
over repeats; one torch thread unless --threads.

    python -m benchmarks.micro.target_context --target ~/.cache/draftforge/smollm2 --contexts 1024 2048 4096 8192 \
        --steps 32 --repeats 3 --out runs/bench/target_context.json

Variants: "before" (plain torch linears, transformers' DynamicCache, sdpa, the model's own forward), "packed"
(packed linears only), "packed+growing" (and the growing cache), "after" (and draftforge's decode attention,
decode/attention.py), "lean" (and the lean forward: what the harness does now). The first three compute the same
numbers, so their greedy tokens must be equal, and so must "after" and "lean" (checked; the run fails otherwise);
"after" rounds attention differently in bf16 from the first three, and the JSON says for how many tokens its answer
agrees.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import checked_args, positive_int, print_table, write_json

# name: (pack_weights, growing cache, decode_attention, lean_forward)
VARIANTS = {"before": ("off", False, "off", "off"), "packed": ("on", False, "off", "off"),
            "packed+growing": ("on", True, "off", "off"), "after": ("on", True, "on", "off"),
            "lean": ("on", True, "on", "on")}
SAME_NUMBERS = (("before", "packed", "packed+growing"), ("after", "lean"))  # bitwise-equal groups: tokens agree


def kv_bytes(target) -> tuple[int, int]:
    """(bytes of cached keys and values, bytes allocated for them: the growing cache's spare rows included)."""
    used = allocated = 0
    for layer in target.lm.cache.layers:
        if getattr(layer, "keys", None) is not None:
            used += 2 * layer.keys.numel() * layer.keys.element_size()
            buffer = getattr(layer, "keys_BHCD", None)
            allocated += 2 * (buffer if buffer is not None else layer.keys).numel() * layer.keys.element_size()
    return used, allocated


class ForwardClock:
    """The duration of every model.forward call (a pre/post hook pair), in order."""

    def __init__(self, model):
        self.durations, self._t0 = [], None
        model.register_forward_pre_hook(self._pre)
        model.register_forward_hook(self._post)

    def _pre(self, *_):
        self._t0 = time.perf_counter()

    def _post(self, *_):
        self.durations.append(time.perf_counter() - self._t0)

    def timed(self, lean):
        """`lean` (a LeanForward) with each call's duration recorded too: it runs instead of model.forward."""
        clock = self

        class Timed:
            def applies(self, model, rows):
                return lean.applies(model, rows)

            def __call__(self, *args, **kwargs):
                clock._pre()
                try:
                    return lean(*args, **kwargs)
                finally:
                    clock._post()

        return Timed()


def run(targets: dict, clocks: dict, ctx: int, steps: int, repeats: int, vocab: int, seed: int) -> dict:
    """One context length: every variant decodes the same random prompt, rotated, the first pass untimed."""
    from draftforge.decode import build_decoder

    gen = torch.Generator().manual_seed(seed + ctx)
    prompt = torch.randint(0, vocab, (ctx,), generator=gen).tolist()
    decoders = {name: build_decoder("ar", t) for name, t in targets.items()}
    per = {name: {"round_ms": [], "forward_ms": [], "overhead_ms": []} for name in targets}
    tokens, kv = {}, {}
    order = list(targets)
    for rep in range(repeats + 1):
        for name in order[rep % len(order):] + order[: rep % len(order)]:
            clock = clocks[name]
            clock.durations = []
            res = decoders[name].generate(prompt, max_new_tokens=steps, eos_token_id=[])
            n = len(res.tokens)
            round_s = (res.stats.total_time_s - res.stats.prefill_time_s) / n
            forward_s = sum(clock.durations[1:]) / n  # the first forward is the prompt's prefill
            if rep == 0:  # warm-up: kept for the equality check and the cache size only
                tokens[name], kv[name] = res.tokens, kv_bytes(targets[name])
                continue
            per[name]["round_ms"].append(round_s * 1e3)
            per[name]["forward_ms"].append(forward_s * 1e3)
            per[name]["overhead_ms"].append((round_s - forward_s) * 1e3)
    row = {"context": ctx}
    for name in targets:
        row[name] = {k: statistics.median(v) for k, v in per[name].items()} | {
            "kv_mb": kv[name][0] / 2**20, "kv_allocated_mb": kv[name][1] / 2**20}
    groups = [[tokens[n] for n in group if n in tokens] for group in SAME_NUMBERS]
    row["tokens_equal"] = all(t == g[0] for g in groups for t in g)  # within each bitwise-equal group
    same = groups[0]
    if "after" in tokens and same:  # the decode attention rounds differently in bf16: how long the answers agree
        row["after_agrees_for"] = next((i for i, (a, b) in enumerate(zip(tokens["after"], same[0])) if a != b),
                                       len(same[0]))
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--steps", type=int, default=32, help="tokens decoded per timed pass")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench/target_context.json")
    args = checked_args(p, argv)
    if min(args.contexts) < 1 or args.steps < 1 or args.repeats < 1 or args.threads < 1:
        p.error("--contexts, --steps, --repeats and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    from draftforge.decode import load_target

    dtype = getattr(torch, args.dtype)
    targets, clocks = {}, {}
    for name in args.variants:
        pack, grow, attention, lean = VARIANTS[name]
        t = load_target(args.target, dtype=dtype, pack_weights=pack, decode_attention=attention, lean_forward=lean)
        t.lm.grow = grow
        targets[name], clocks[name] = t, ForwardClock(t.model)
        if t.lm.lean is not None:
            t.lm.lean = clocks[name].timed(t.lm.lean)
        print(f"{name}: {t.model.draftforge_packing.describe()}; KV cache: "
              f"{'growing buffer' if grow else 'torch.cat (transformers DynamicCache)'}; "
              f"{t.model.draftforge_attention}; {t.model.draftforge_forward}", flush=True)
    limit = targets[args.variants[0]].max_context
    if limit is not None and max(args.contexts) + args.steps + 2 > limit:
        p.error(f"context {max(args.contexts)} + {args.steps + 2} decoded tokens exceeds the target's {limit}")
    vocab = targets[args.variants[0]].vocab_size
    rows = []
    for ctx in args.contexts:
        print(f"context {ctx} ...", flush=True)
        rows.append(run(targets, clocks, ctx, args.steps, args.repeats, vocab, args.seed))
        if not rows[-1]["tokens_equal"]:
            raise SystemExit(f"context {ctx}: variants that compute the same numbers decoded different tokens")
    table = []
    for r in rows:
        for name in args.variants:
            v = r[name]
            table.append([r["context"], name, f"{v['round_ms']:.2f}", f"{1e3 / v['round_ms']:.1f}",
                          f"{v['forward_ms']:.2f}", f"{v['overhead_ms']:.2f}",
                          f"{v['kv_mb']:.1f} / {v['kv_allocated_mb']:.1f}"])
    print_table(["context", "variant", "ms / token", "tok/s", "model forward ms", "harness overhead ms",
                 "KV MiB (held / allocated)"], table, {2, 3, 4, 5, 6})
    result = {"target": args.target, "dtype": args.dtype, "threads": args.threads, "steps": args.steps,
              "repeats": args.repeats, "rows": rows,
              "variants": {n: dict(zip(("pack_weights", "growing_cache", "decode_attention", "lean_forward"),
                                       VARIANTS[n]))
                           for n in args.variants}}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
