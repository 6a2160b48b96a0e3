"""`draftforge harvest trees|theta|logits`: training data harvested from a target (+ drafter).

  draftforge harvest trees --target T --drafter D --bench PROMPTS --out DIR [--resume]   # C2T: EAGLE-2 trees
  draftforge harvest theta --target T --drafter D --data ROWS --out DIR [--resume]      # Cali-TS: χ labels
  draftforge harvest logits --target T --data ROWS --out DIR [--resume]                 # distill: top-k teacher

One parquet shard per prompt in DIR (see draftforge.data.harvest); train on it with task `c2t`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftforge.runtime import add_device_flag, add_dtype_flag, announce, resolve_dtype


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="what", metavar="WHAT", required=True)
    t = sub.add_parser("trees", help="full EAGLE-2 trees (no rerank), one row per node: P, H, d, accepted label",
                       description="Grow the whole EAGLE-2 pool T1 at every step of each prompt's greedy "
                                   "continuation and label each node (1 = on the path the target accepts). "
                                   "Labels are exact under greedy decoding: they come from the target's own "
                                   "greedy continuation (C2T spec §7), with no tree verification.")
    t.add_argument("--target", required=True, help="target model dir (HF decoder-only Transformer)")
    t.add_argument("--drafter", required=True, help="drafter dir (Mamba, Mamba2 or Transformer)")
    t.add_argument("--bench", required=True, help="prompt file or named set (testbed, humaneval, instructions); "
                                                  "use training prompts, disjoint from the ones you evaluate on")
    t.add_argument("--out", required=True, help="harvest directory (harvest.json + parquet shards)")
    t.add_argument("--num-prompts", type=int, help="use only the first N prompts (default: all)")
    t.add_argument("--max-new-tokens", type=int, default=128, help="greedy tokens per prompt (default 128)")
    t.add_argument("--top-k", type=int, default=10, help="EAGLE-2 k: children per node and frontier width (default 10)")
    t.add_argument("--depth", type=int, default=10,
                   help="EAGLE-2 code depth: draft layers = depth + 1 (default 10, the paper's dmax 11)")
    t.add_argument("--top-m", type=int, default=1000, help="entropy over the parent's top-M tokens (default 1000)")
    t.add_argument("--chat-template", choices=("auto", "always", "never"), default="auto",
                   help="auto: chat prompts use the target's chat template if it has one; always / never "
                        "force it on or off (default auto)")
    t.add_argument("--ignore-eos", action="store_true",
                   help="always generate --max-new-tokens tokens (default: stop at the target's eos)")
    add_device_flag(t)
    add_dtype_flag(t, "; recorded in harvest.json, and a resume must use the same")
    t.add_argument("--resume", action="store_true",
                   help="continue a harvest in --out (same target, drafter, settings); finished prompts are skipped")
    from draftforge.data import harvest_theta

    th = sub.add_parser("theta", help="χ labels + hidden states for the Cali-TS θ predictor (task theta)",
                        formatter_class=argparse.RawDescriptionHelpFormatter)  # configure sets the user's text
    harvest_theta.configure(th)
    from draftforge.data import harvest_logits

    lg = sub.add_parser("logits", help="a target's top-k log-probabilities over token rows, so distill needs no "
                                       "teacher forward (distill.logits_cache)",
                        formatter_class=argparse.RawDescriptionHelpFormatter)  # configure sets the user's text
    harvest_logits.configure(lg)
    for sp in (t, th, lg):
        sp.add_argument("--threads", type=int, help="torch intra-op threads on CPU (default 1, or OMP_NUM_THREADS: "
                                                    "batch-1 model passes lose several-fold when a core is busy)")


def run(args) -> int:
    from draftforge.errors import RecipeError
    from draftforge.fsutil import output_problem
    from draftforge.runtime import choose_threads

    if args.threads is not None and args.threads < 1:
        raise RecipeError(f"--threads must be >= 1, got {args.threads}")
    problem = output_problem(args.out, "dir")
    if problem:  # before minutes of model loading and harvesting
        raise RecipeError(f"--out {args.out}: {problem}; give --out a directory for the harvest")
    print(f"[draftforge] {choose_threads(args.threads)}", file=sys.stderr)
    if args.what == "theta":
        from draftforge.data import harvest_theta

        return harvest_theta.run(args)
    if args.what == "logits":
        from draftforge.data import harvest_logits

        return harvest_logits.run(args)

    for flag in ("top_k", "depth", "top_m", "max_new_tokens"):
        if getattr(args, flag) < 1:
            raise RecipeError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise RecipeError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    summary = harvest_trees(args)
    print(f"harvest: {summary['prompts']} prompts, {summary['trees']} trees, {summary['rows']} nodes, "
          f"{summary['positives']} accepted ({summary['positive_rate']:.3%}), τ {summary['tau']:.2f} accepted "
          f"drafts per tree; in {args.out}")
    return 0


def harvest_trees(args) -> dict:
    from tqdm import tqdm

    from draftforge.data import harvest as hv
    from draftforge.decode import load_drafter, load_target
    from draftforge.decode.eagle2 import check_eagle2
    from draftforge.data.prompts import load_prompts

    dtype = resolve_dtype(args.dtype, args.device)
    announce(dtype, "target and drafter")
    target = load_target(args.target, device=args.device, dtype=dtype.torch_dtype)
    drafter = load_drafter(args.drafter, target, device=args.device, dtype=dtype.torch_dtype)
    check_eagle2(args.top_k, args.depth, 2, target, drafter)
    settings = hv.HarvestSettings(args.top_k, args.depth, args.top_m, args.max_new_tokens)
    prompts = load_prompts(args.bench, target.tokenizer, num_prompts=args.num_prompts, chat=args.chat_template,
                           context_length=target.max_context, max_new_tokens=args.max_new_tokens)
    out = Path(args.out)
    meta = {**hv.harvest_meta(target, drafter, settings, str(args.bench)), "dtype": dtype.name}
    hv.open_harvest(out, meta, args.resume)
    fingerprints, eos = (meta["target"], meta["drafter"]), ([] if args.ignore_eos else None)
    done = sum(hv.shard_path(out, i).is_file() for i in range(len(prompts)))
    totals = {"trees": 0, "rows": 0, "positives": 0}
    bar = tqdm(total=len(prompts), initial=done, desc="harvest trees", file=sys.stderr, dynamic_ncols=True)
    for i, prompt in enumerate(prompts):
        shard = hv.shard_path(out, i)
        if shard.is_file():
            continue
        rows = hv.harvest_prompt(target, drafter, list(prompt.input_ids), str(prompt.prompt_id), settings,
                                 fingerprints, eos)
        hv.write_shard(rows, shard)
        totals["trees"] += len(set(rows["tree_id"]))
        totals["rows"] += len(rows["label"])
        totals["positives"] += sum(rows["label"])
        bar.update(1)
        bar.set_postfix(trees=totals["trees"], tau=f"{totals['positives'] / max(totals['trees'], 1):.2f}")
    bar.close()
    return {"prompts": len(prompts), **hv.summarize(hv.load_harvest([out]))}
