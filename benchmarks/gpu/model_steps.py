"""Steps 4 and 5 of the GPU check: bf16 training tokens/s and MFU of the Mamba2 drafter recipe through
draftforge's own loop, and an eval of AR / chain / tree on tiny random models through `run_eval`.

Training runs recipes/pretrain.yaml's model (Mamba2 "130m") on offline data: a byte-level BPE tokenizer and a
corpus from the Python standard library (draftforge.testbed, as benchmarks/micro/train_throughput.py does), no
eval, no checkpoints, no export. Each repeat is a whole short run; the loop's tokens/s leaves out its first
step (warm-up), and the median over repeats is reported. MFU = tokens/s × 6N ÷ the device's peak dense bf16
FLOP/s (benchmarks/gpu/env.py), N = the model's parameters (tied embedding counted once): the usual
forward + backward estimate, which leaves out the SSM scan's own FLOPs.

The eval is `draftforge eval`'s runner on benchmarks/decoding/spec_decode.py's seeded random models (a Llama
target and a Mamba drafter; on CUDA its steps replay as CUDA graphs): warm-up, rotated methods, repeats, AR in
the same run, the T=0 self-check. Random models accept few drafts, so τ is near 1: the tokens/s prove the
path, not a drafter's worth.
"""

from __future__ import annotations

import copy
import statistics

from benchmarks.common import REPO

RECIPE = REPO / "recipes" / "pretrain.yaml"
TRAIN = {  # size None keeps the recipe's; vocab is the offline tokenizer's (the recipe's target is not here)
    "full": dict(size=None, vocab=8192, files=60, steps=12, micro_batch=4, accum=4, block=2048, repeats=3),
    "dry": dict(size="tiny", vocab=512, files=6, steps=3, micro_batch=2, accum=1, block=64, repeats=2),
}
EVAL = {
    "full": dict(num_prompts=8, max_new_tokens=64, repeats=3, warmup=1, cost_repeats=3),
    "dry": dict(num_prompts=2, max_new_tokens=8, repeats=2, warmup=1, cost_repeats=1),
}

NOISE = 0.0  # init_from_target alone: the EAGLE-3 head accepts a few drafts (noise on top accepted none)
FLOPS_NOTE = ("FLOPs per token estimated as 6 x parameters (forward 2N + backward 4N, tied embedding counted once; "
              "the SSM scan's own FLOPs left out)")


def recipe_values(base: dict, size: dict, tokenizer: str, corpus: str, out_dir: str) -> dict:
    """recipes/pretrain.yaml with offline data and a short, eval-free, export-free run of bf16 steps."""
    model = {"arch": base["model"]["arch"], "size": size["size"] or base["model"]["size"], "tokenizer": tokenizer}
    return {"task": base.get("task", "pretrain"), "output_dir": out_dir, "model": model,
            "data": {"sources": [corpus], "eval_fraction": 0.0},
            "optim": {**base.get("optim", {}), "warmup_steps": 2},
            "train": {"max_steps": size["steps"], "global_batch_size": size["micro_batch"] * size["accum"],
                      "micro_batch_size": size["micro_batch"], "block_size": size["block"], "precision": "bf16",
                      "eval_every": 0, "save_every": 0, "log_every": 1000, "trackers": [], "export": False}}


def train_step(ctx) -> dict:
    """Step 4: median tokens/s over whole short runs, and the MFU that gives on a known GPU."""
    import torch
    import yaml
    from transformers import AutoTokenizer

    from benchmarks.gpu.env import peak_bf16_flops
    from draftforge.recipe import recipe_from_dict
    from draftforge.testbed import train_tokenizer, write_corpus_jsonl
    from draftforge.train import run
    from draftforge.train.lm import build_model

    size = ctx.size(TRAIN)
    tok_dir = ctx.work / "tokenizer"
    train_tokenizer(tok_dir, vocab_size=size["vocab"], max_files=size["files"])
    corpus = write_corpus_jsonl(ctx.work / "corpus.jsonl", "train", max_files=size["files"])
    values = recipe_values(yaml.safe_load(RECIPE.read_text()), size, str(tok_dir), str(corpus),
                           str(ctx.work / "train-run"))
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    params = sum(p.numel() for p in build_model(recipe_from_dict(copy.deepcopy(values)), tokenizer).parameters())
    if ctx.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    runs = []
    for r in range(size["repeats"]):
        result = run(recipe_from_dict(copy.deepcopy(values)), overwrite=True)
        runs.append({"tokens_per_s": result.tokens_per_s, "final_loss": result.final_loss, "steps": result.step})
        ctx.say(f"  training repeat {r + 1}/{size['repeats']}: {result.tokens_per_s:,.0f} tokens/s")
    tps = statistics.median(x["tokens_per_s"] for x in runs)
    name = torch.cuda.get_device_name(0) if ctx.device == "cuda" else "cpu"
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if ctx.device == "cuda" else None
    peak, peak_note = peak_bf16_flops(name)
    mfu = tps * 6 * params / peak if peak else None
    model = f"mamba2 {values['model']['size']} ({params / 1e6:.1f} M params, vocab {len(tokenizer)})"
    summary = f"{tps:,.0f} tokens/s, MFU " + (f"{mfu:.1%}" if mfu is not None else "null")
    tokens_per_step = size["micro_batch"] * size["accum"] * size["block"]
    spread = [x["tokens_per_s"] for x in runs]
    return {"recipe": str(RECIPE.relative_to(REPO)), "values": values, "params": params, "device_name": name,
            "tokens_per_s": tps, "runs": runs, "flops_per_token": 6 * params, "flops_note": FLOPS_NOTE,
            "peak_bf16_flops": peak, "peak_note": peak_note, "mfu": mfu, "peak_memory_gib": peak_gib,
            "mfu_reason": None if mfu is not None else peak_note, "summary": summary,
            "notes": [f"{model}; {size['steps']} steps x {tokens_per_step:,} tokens (micro-batch {size['micro_batch']} "
                      f"x {size['accum']} accumulation x block {size['block']}), bf16 autocast, median of "
                      f"{size['repeats']} runs, each without its first step", FLOPS_NOTE, f"peak: {peak_note}"],
            "table": {"headers": ["model", "tokens/s (median)", "min-max", "FLOPs/token", "peak bf16 FLOP/s", "MFU"],
                      "rows": [[model, f"{tps:,.0f}", f"{min(spread):,.0f}-{max(spread):,.0f}", f"{6 * params:.3g}",
                                "-" if peak is None else f"{peak:.3g}",
                                "null" if mfu is None else f"{mfu:.2%}"]]}}


def eval_step(ctx) -> dict:
    """Step 5: run_eval with ar, chain and tree at T=0; tokens/s, speedup, τ and the self-check per method."""
    from benchmarks.common import versus_ar_cell
    from benchmarks.decoding.spec_decode import save_random_models, write_random_prompts
    from draftforge.eval.runner import EvalConfig, run_eval

    size = ctx.size(EVAL)
    paths = save_random_models(ctx.work / "eval-models")
    bench = write_random_prompts(ctx.work / "eval-prompts.jsonl", size["num_prompts"])
    cfg = EvalConfig(target=paths["target"], drafter=paths["mamba_drafter"], bench=bench,
                     methods=("ar", "chain", "tree"), baselines=("ar",), max_new_tokens=size["max_new_tokens"],
                     num_prompts=size["num_prompts"], repeats=size["repeats"], warmup=size["warmup"],
                     cost_repeats=size["cost_repeats"], ignore_eos=True, device=ctx.device, dtype="auto",
                     out_dir=str(ctx.out / "eval"), plots=False, command="python -m benchmarks.gpu.check",
                     extra_manifest={"benchmark": "gpu/check"})
    report = run_eval(cfg)
    rows = [{"method": r["method"], "tokens_per_s": r["tokens_per_s"], "speedup": r["speedup"], "tau": r["tau"],
             "self_check": r["self_check"]} for r in report["results"]]
    cells = {r["method"]: "-" if r["self_check"] is None else versus_ar_cell(r["self_check"]) for r in rows}
    summary = "; ".join(f"{r['method']} {_num(r['tokens_per_s'])} tok/s" for r in rows)
    summary += "; self-check " + ", ".join(f"{m} {c}" for m, c in cells.items() if c != "-")
    manifest = report["manifest"]
    table = [[r["method"], _num(r["tokens_per_s"]), _num(r["speedup"], ".2f", "x"), _num(r["tau"], ".2f"),
              cells[r["method"]]] for r in rows]
    return {"rows": rows, "dtype": manifest.get("dtype"), "report": report["files"].get("json"),
            "summary": summary,
            "notes": [f"{size['num_prompts']} random prompts x {size['max_new_tokens']} tokens, T=0, "
                      f"{size['repeats']} rotated repeats after warm-up, dtype {manifest.get('dtype')}; tiny random "
                      "Llama target + Mamba drafter (τ near 1 by construction)"],
            "table": {"headers": ["method", "tokens/s", "speedup", "τ", "self-check vs AR"], "rows": table}}


def feature_eval_step(ctx) -> dict:
    """Step 6: the drafters that read the target's hidden states (an EAGLE-3 head and the feature-conditioned
    Mamba2 drafter) through run_eval: chain, tree and EAGLE-2 at T=0 with the self-check against AR, and the
    drafter's state bytes. Heads are started from the tiny random target (draftforge's own init_from_target) and,
    so a few drafts are accepted (EAGLE-2 τ 1.3-1.6 on CPU) and the rollback paths run."""
    import torch
    from transformers import AutoConfig

    from draftforge.loading import load_causal_lm

    from benchmarks.common import versus_ar_cell
    from benchmarks.decoding.spec_decode import save_random_models, write_random_prompts
    from draftforge.eval.runner import EvalConfig, run_eval
    from draftforge.models import eagle3, feature_mamba
    from draftforge.models.eagle3_export import save_head

    size = ctx.size(EVAL)
    paths = save_random_models(ctx.work / "feature-models")
    bench = write_random_prompts(ctx.work / "feature-prompts.jsonl", size["num_prompts"])
    target = load_causal_lm(paths["target"], what="target").eval()
    config = AutoConfig.from_pretrained(paths["target"])
    torch.manual_seed(0)
    heads = {"eagle3": eagle3.Eagle3Head(eagle3.Eagle3Config.from_target(config)),
             "feature_mamba2": feature_mamba.FeatureMamba2Head(
                 feature_mamba.FeatureMambaConfig.from_target(config, head_dim=16, state_size=8))}
    eagle3.init_from_target(heads["eagle3"], target)
    feature_mamba.init_from_target(heads["feature_mamba2"], target)
    with torch.no_grad():
        for p in heads["eagle3"].parameters():
            p.add_(NOISE * torch.randn_like(p))
    rows, table = [], []
    for kind, head in heads.items():
        export = save_head(head, config, None, ctx.work / f"head-{kind}", {"target": paths["target"]})
        cfg = EvalConfig(target=paths["target"], drafter=str(export), bench=bench,
                         methods=("ar", "chain", "tree", "eagle2"), baselines=("ar",),
                         max_new_tokens=size["max_new_tokens"], num_prompts=size["num_prompts"],
                         repeats=size["repeats"], warmup=size["warmup"], cost_repeats=size["cost_repeats"],
                         ignore_eos=True, device=ctx.device, dtype="auto", out_dir=str(ctx.out / f"eval-{kind}"),
                         plots=False, command="python -m benchmarks.gpu.check",
                         extra_manifest={"benchmark": "gpu/check", "drafter_kind": kind})
        report = run_eval(cfg)
        for r in report["results"]:
            if r["method"] == "ar":
                continue
            cell = "-" if r["self_check"] is None else versus_ar_cell(r["self_check"])
            rows.append({"drafter": kind, "method": r["method"], "tokens_per_s": r["tokens_per_s"],
                         "speedup": r["speedup"], "tau": r["tau"], "self_check": r["self_check"]})
            table.append([kind, r["method"], _num(r["tokens_per_s"]), _num(r["speedup"], ".2f", "x"),
                          _num(r["tau"], ".2f"), cell])
        ctx.say(f"  {kind}: " + "; ".join(f"{row[1]} τ {row[4]} self-check {row[5]}" for row in table
                                          if row[0] == kind))
    summary = "; ".join(f"{r[0]} {r[1]} {r[5]}" for r in table)
    return {"rows": rows, "summary": summary,
            "notes": [f"{size['num_prompts']} random prompts x {size['max_new_tokens']} tokens, T=0, dtype auto; "
                      "tiny random Llama target; heads from init_from_target, unperturbed"],
            "table": {"headers": ["drafter", "method", "tokens/s", "speedup", "τ", "self-check vs AR"],
                      "rows": table}}


def _num(value, fmt: str = ",.0f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"
