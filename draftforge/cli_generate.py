"""`draftforge generate`: a target's own responses as token rows for `data.format: tokens` (SFT data).

  draftforge generate --target DIR --prompts FILE --out rows.jsonl [--temperature 0 1] [--max-new-tokens 256]
  draftforge generate --target DIR --random-starts 1000 --out rows.jsonl      (base targets, EESD §3.2)
"""

from __future__ import annotations

import argparse

from draftforge.runtime import add_device_flag, add_dtype_flag, announce, resolve_dtype


def configure(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Answer prompts with the target (chat template when it has one) or, for a base target, continue random "
        "start tokens (greedy for 3-5 tokens, then sampled: EESD §3.2). Rows {input_ids, prompt_len, prompt_id, "
        "temperature} are appended to --out; rerunning the same command resumes a killed run.")
    p.add_argument("--target", required=True, help="target model directory (or HF id)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", help="JSONL of prompts ({messages} or {prompt}, e.g. from `draftforge target "
                                       "prompts`) or a named bench")
    src.add_argument("--random-starts", type=int, metavar="N",
                     help="base targets: N prompts of one random token each (EESD / LLM-QAT recipe)")
    p.add_argument("--out", required=True, help="JSONL file the rows are appended to (resumed if it exists)")
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0],
                   help="answer every prompt once per temperature; 0 = greedy (default: 0 1)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="new tokens per answer at most (default 256)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per left-padded generate() call (default 8)")
    p.add_argument("-n", "--num-prompts", type=int, help="use only the first N prompts of --prompts")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    add_dtype_flag(p, "; the rows hold the answers of that dtype", what="target dtype")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=int, help="torch intra-op threads on CPU (default: torch's own, one per core, "
                                                "or OMP_NUM_THREADS; use 1 when another job keeps a core busy)")


def _context(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", None) or 1 << 30)


def run(args) -> int:
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from draftforge.data.generate import check_settings, chat_jobs, generate_rows, random_start_jobs, summary_lines
    from draftforge.errors import DataError
    from draftforge.fsutil import output_problem
    from draftforge.loading import load_causal_lm

    check_settings(args.temperature, args.max_new_tokens, args.batch_size)  # seconds before the model loads
    problem = output_problem(args.out, "file")
    if problem:
        raise DataError(f"--out {args.out}: {problem}; give --out the JSONL file the rows go to")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(args.dtype, device)
    announce(dtype, "target")
    model = load_causal_lm(args.target, what="target", dtype=dtype.torch_dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    if args.prompts:
        jobs = chat_jobs(args.prompts, tokenizer, _context(model), args.max_new_tokens, args.num_prompts)
    else:
        specials = set(tokenizer.all_special_ids) if tokenizer is not None else set()
        jobs = random_start_jobs(args.random_starts, model.config.vocab_size, args.seed, specials)
    total = len(jobs) * len(args.temperature)
    print(f"generate: {len(jobs)} prompts x temperatures {args.temperature} = {total} rows, "
          f"up to {args.max_new_tokens} new tokens each, batches of {args.batch_size} on {device}, {dtype.name}, "
          f"{torch.get_num_threads()} torch threads")
    bars = []  # opened at the first finished batch, so an error before it is a line of its own

    def progress(n_rows: int, tokens_per_s: float) -> None:
        if not bars:
            bars.append(tqdm(total=total, unit="row", dynamic_ncols=True))
        bars[0].update(n_rows)
        bars[0].set_postfix_str(f"{tokens_per_s:.1f} tok/s")

    stats = generate_rows(model, tokenizer, jobs, args.out, temperatures=args.temperature,
                          max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
                          progress=progress, target=args.target)
    for bar in bars:
        bar.close()
    print("\n".join(summary_lines(stats, args.out, total)))
    return 0
