"""Drafter decode latency and memory vs context length: Mamba vs a Transformer of similar size.

Mamba Drafters Fig. 1: a Mamba drafter's per-token cost and state stay flat with context, a
Transformer's KV cache grows linearly. For each context length the drafter prefills a random
context, then we time single-token decode steps (after warm-up, median of repeats; every drafter and context is
set up first, then timed in a rotating order per repeat, so slow drift of the machine hits all alike) and read
memory (CUDA allocator peak on GPU, process RSS growth on CPU). Prints a table, writes JSON.

    python -m benchmarks.micro.drafter_context --contexts 1024 2048 4096 8192 --steps 16 --out drafter_context.json

With --feature-target DIR it times the two drafters that read the target's states (EAGLE-3 head and the
feature-conditioned Mamba2 drafter) through their drafter code, and the time of their one-step prompt encode
("prompt ms": the harness's first draft of a prompt pays it). With --drafter DIR (repeatable) it times trained checkpoints through the harness's own decode path
instead (MambaDrafter: prompt encode, then the lean single-token step on CPU; TransformerDrafter: KV
cache), reduced draft heads included: the ms/token a drafting round really pays.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache

from benchmarks.common import (memory_mb, parse_timed, positive_int, print_table, rotated_ms, sync, tiny_model,
                               write_json)
from draftforge.hfcompat import cache_kwargs


@torch.inference_mode()
def measure(model, ctx: int, device) -> tuple:
    """(one decode step after a ctx-token prefill, the row's figures but its time)."""
    ids = torch.randint(0, model.config.vocab_size, (1, ctx), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    mem_before = memory_mb(device)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))  # no ctx x V logits
    tok = ids[:, -1:]
    state_mb = sum(t.numel() * t.element_size() for t in _cache_tensors(cache)) / 2**20

    def step():
        model(input_ids=tok, use_cache=True, **cache_kwargs(model, cache))

    return step, {"context": ctx, "state_mb": state_mb, "memory_growth_mb": memory_mb(device) - mem_before}


@torch.inference_mode()
def measure_harness(path: str, ctx: int, steps: int, repeats: int, full_head: bool = False) -> tuple:
    """(one drafted token through draftforge.decode's drafter for a checkpoint after a ctx-token prefill, the row's
    figures but its time); (None, a skipped row) where the checkpoint's positions end before.

    full_head: swap a reduced draft head for a full-vocabulary one tied to the embedding (the cost that
    model.draft_vocab removes; the weights are then meaningless, the timing is not).
    """
    from draftforge.decode.drafters.transformer import TransformerDrafter
    from draftforge.decode.drafters.mamba import MambaDrafter
    from draftforge.decode.loading import load_hf_causal_lm
    from draftforge.decode.targets import SSM_MODEL_TYPES

    model, _ = load_hf_causal_lm(path, "cpu", None, "drafter")
    vocab = model.get_input_embeddings().weight.shape[0]
    if full_head:
        from draftforge.models.draft_vocab import CONFIG_KEY

        head = torch.nn.Linear(model.config.hidden_size, vocab, bias=False)
        head.weight = model.get_input_embeddings().weight
        model.set_output_embeddings(head)
        setattr(model.config, CONFIG_KEY, None)
    is_ssm = model.config.model_type in SSM_MODEL_TYPES
    drafter = (MambaDrafter if is_ssm else TransformerDrafter)(model, vocab)
    if not is_ssm and ctx + steps * (repeats + 2) > getattr(model.config, "max_position_embeddings", 1 << 30):
        return None, {"context": ctx, "skipped": "beyond max_position_embeddings"}
    seq = torch.randint(0, vocab, (ctx + steps * (repeats + 2),)).tolist()
    mem_before = memory_mb(torch.device("cpu"))
    drafter._sync(seq[:ctx])
    pos = [ctx]

    def step():
        pos[0] += 1
        drafter._sync(seq[:pos[0]])

    state = (sum(c.numel() * c.element_size() + h.numel() * h.element_size() for c, h in drafter.live)
             if is_ssm else sum(t.numel() * t.element_size() for t in _cache_tensors(drafter.lm.cache)))
    return step, {"context": ctx, "state_mb": state / 2**20,
                  "memory_growth_mb": memory_mb(torch.device("cpu")) - mem_before,
                  "params_m": sum(p.numel() for p in model.parameters()) / 1e6}


@torch.inference_mode()
def measure_feature(kind: str, target_dir: str, ctx: int, draft_vocab: int = 8192, dtype=torch.bfloat16,
                    device=torch.device("cpu")) -> tuple:
    """(one drafted token of a drafter that reads the target (kind "eagle3" or "feature_mamba2") after ctx
    committed anchors, the row's figures but its time: the bytes its committed state holds, ...). The anchors'
    features are random: a step's cost does not depend on their values, so the target's ctx-token prefill is not
    run; the head is untrained (the same shapes a trained one has: the target's width, `draft_vocab` head rows)."""
    from transformers import AutoConfig

    from draftforge.decode.drafters.eagle3 import Eagle3Drafter, FeatureMambaDrafter
    from draftforge.models.eagle3 import Eagle3Config, Eagle3Head
    from draftforge.models.feature_mamba import FeatureMamba2Head, FeatureMambaConfig
    from draftforge.models.target_embed import read_target_embedding

    config = AutoConfig.from_pretrained(target_dir)
    d2t = list(range(draft_vocab))
    torch.manual_seed(0)
    if kind == "eagle3":
        head, drafter_class = Eagle3Head(Eagle3Config.from_target(config, draft_vocab=d2t)), Eagle3Drafter
    else:
        head = FeatureMamba2Head(FeatureMambaConfig.from_target(config, draft_vocab=d2t))
        drafter_class = FeatureMambaDrafter
    head = head.to(device=device, dtype=dtype).eval()
    if kind == "eagle3":  # its decoding attention kernel, chosen as load_drafter chooses it
        from draftforge.decode.attention import use_head_attention

        use_head_attention(head)
    embedding = torch.nn.Embedding.from_pretrained(read_target_embedding(target_dir).to(device=device, dtype=dtype))
    head.use_embedding(embedding)
    drafter = drafter_class(head, config.vocab_size)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    mem_before = memory_mb(device)
    features = torch.randn(ctx, len(head.config.aux_layers) * config.hidden_size, dtype=dtype, device=device)
    tokens = torch.randint(0, config.vocab_size, (ctx + 1,), device=device)
    sync(device)
    t_prompt = time.perf_counter()
    with torch.inference_mode():  # the prompt's ctx anchors in one step, as the harness's first draft feeds them
        out = drafter._feed_anchors(tokens[1:], head.fuse(features), torch.arange(1, ctx + 1, device=device))
    sync(device)
    prompt_ms = (time.perf_counter() - t_prompt) * 1e3
    drafter.anchors, drafter.committed = ctx, ctx + 1
    drafter.node_out[-1] = out[-1]

    def step():  # one drafting step from the root: a node at depth 1 (the tree is dropped after each)
        drafter._clear_tree()
        drafter.node_out[-1] = out[-1]
        drafter.feed([-1], [int(tokens[0])], [0])

    return step, {"context": ctx, "prompt_ms": prompt_ms, "state_mb": drafter.cache_bytes() / 2**20,
            "memory_growth_mb": memory_mb(device) - mem_before,
            "params_m": sum(p.numel() for p in head.parameters()) / 1e6,
            **({"attention": head.draftforge_attention} if hasattr(head, "draftforge_attention") else {})}


@torch.inference_mode()  # the steps were set up in it: their tensors are inference tensors
def timed_rows(setups: list[tuple], steps: int, repeats: int, device) -> list[dict]:
    """The rows of `setups` ((step or None, row) each, all set up first) with their ms per token: every step timed
    over `repeats` rounds of `steps` calls after one warm-up round, the steps' order rotated per round."""
    steps_by = {i: (lambda _, f=step: f()) for i, (step, _) in enumerate(setups) if step is not None}
    times = rotated_ms(steps_by, device, repeats=repeats, warmup=steps, calls=steps) if steps_by else {}
    return [{**row, **({"ms_per_token": times[i]["median_ms"], "ms_min": times[i]["min_ms"],
                        "ms_max": times[i]["max_ms"]} if i in times else {})} for i, (_, row) in enumerate(setups)]


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
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="drafter_context.json")
    ap.add_argument("--drafter", action="append", help="time this trained checkpoint through the harness "
                                                        "(repeatable; CPU; replaces the random models)")
    ap.add_argument("--full-head", action="store_true", help="with --drafter: time a full-vocabulary head "
                                                             "instead of the checkpoint's reduced one")
    ap.add_argument("--feature-target", metavar="DIR",
                    help="time the two drafters that read this target (the EAGLE-3 head and the feature-conditioned "
                         "Mamba2 drafter, bf16, 8,192-row heads) through the harness's drafter code, on --device")
    args = parse_timed(ap)
    device = torch.device(args.device)
    setups = []  # (step, row) of every drafter at every context, all set up before any is timed
    for kind in ("eagle3", "feature_mamba2") if args.feature_target else ():
        for ctx in args.contexts:
            step, r = measure_feature(kind, args.feature_target, ctx, device=device)
            setups.append((step, {"drafter": kind, "params_m": round(r.pop("params_m"), 2), **r}))
            print(setups[-1][1], flush=True)
    for path in args.drafter or []:
        for ctx in args.contexts:
            step, r = measure_harness(path, ctx, args.steps, args.repeats, args.full_head)
            setups.append((step, {"drafter": path + (" (full head)" if args.full_head else ""),
                                  "params_m": round(r.pop("params_m", 0.0), 2), **r}))
            print(setups[-1][1], flush=True)
    for kind in () if args.drafter or args.feature_target else ("mamba", "llama"):
        positions = max(args.contexts) + (args.repeats + 2) * args.steps  # the context, then every timed step's
        extra = {"max_position_embeddings": positions} if kind == "llama" else {}
        model = tiny_model(kind, args.vocab, args.hidden, args.layers, device=device, **extra)
        params_m = sum(p.numel() for p in model.parameters()) / 1e6
        for ctx in args.contexts:
            step, r = measure(model, ctx, device)
            setups.append((step, {"drafter": "transformer" if kind == "llama" else kind, "params_m": round(params_m, 2),
                                  **r}))
    print(f"timing {sum(s is not None for s, _ in setups)} drafter x context steps, {args.repeats} rotated rounds of "
          f"{args.steps} calls each", flush=True)
    rows = timed_rows(setups, args.steps, args.repeats, device)
    print_table(["drafter", "params (M)", "context", "ms/token", "min", "max", "prompt ms", "state MB", "mem +MB"],
                [[r["drafter"], f"{r['params_m']:.2f}", r["context"], f"{r['ms_per_token']:.2f}", f"{r['ms_min']:.2f}",
                  f"{r['ms_max']:.2f}", f"{r['prompt_ms']:.0f}" if "prompt_ms" in r else "–", f"{r['state_mb']:.2f}",
                  f"{r['memory_growth_mb']:.1f}"] for r in rows if "skipped" not in r],
                right=set(range(1, 9)))
    write_json(args.out, {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
                          "args": vars(args), "rows": rows}, indent=1)


if __name__ == "__main__":
    main()
