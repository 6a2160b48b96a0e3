"""`draftforge generate`: a target's own responses as token rows for `data.format: tokens` (SFT data).

  draftforge generate --target DIR --prompts FILE --out rows.jsonl [--temperature 0 1] [--max-new-tokens 256]
  draftforge generate --target DIR --random-starts 1000 --out rows.jsonl      (base targets, EESD §3.2)
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass

from draftforge.argcheck import temperature_list
from draftforge.options import add_flags, check_fields, option, positive_int, values_from_args
from draftforge.runtime import PRECISIONS, announce, check_device, resolve_dtype


@dataclass(frozen=True, kw_only=True)
class GenerateJob:
    """`draftforge generate`: its flags are these settings."""

    target: str = option(MISSING, "target model directory (or HF id)")
    prompts: str | None = option(None, "JSONL of prompts ({messages} or {prompt}, e.g. from `draftforge target "
                                 "prompts`) or a named bench", group="source")
    random_starts: int | None = option(None, "base targets: N prompts of one random token each (EESD / LLM-QAT "
                                       "recipe)", group="source", check=positive_int)
    out: str = option(MISSING, "JSONL file the rows are appended to (resumed if it exists)", metavar="FILE")
    temperature: tuple[float, ...] = option((0.0, 1.0), "answer every prompt once per temperature; 0 = greedy",
                                            repeat=True, parse=temperature_list, metavar="T")
    max_new_tokens: int = option(256, "new tokens per answer at most")
    batch_size: int = option(8, "prompts per left-padded generate() call")
    num_prompts: int | None = option(None, "use only the first N prompts of --prompts", aliases=("-n",),
                                     check=positive_int)
    seed: int = option(0, "sampling seed")
    dtype: PRECISIONS = option("auto", "target dtype: auto = bfloat16 where the device computes it natively, else "
                               "float32; the rows hold the answers of that dtype")
    device: str | None = option(None, "torch device (default: cuda if available, else cpu)")
    threads: int | None = option(None, "torch intra-op threads on CPU (default: torch's own, one per core, or "
                                 "OMP_NUM_THREADS; use 1 when another job keeps a core busy)", check=positive_int)

    def __post_init__(self):
        check_fields(self)


def configure(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Answer prompts with the target ({messages} rows through its chat template when it has one, {prompt} rows "
        "as plain text) or, for a base target, continue random "
        "start tokens (greedy for 3-5 tokens, then sampled: EESD §3.2). Rows {input_ids, prompt_len, prompt_id, "
        "temperature} are appended to --out; rerunning the same command resumes a killed run. A resume must "
        "keep --max-new-tokens, --seed, --batch-size and --dtype (recorded in FILE.meta.json; other values are "
        "refused, as is a prompt whose tokens changed); more prompts on the same --out are answered too, with a "
        "notice that the file then equals no single uninterrupted run. A file at --out that is not generate's "
        "rows is never cut or appended to.")
    add_flags(p, GenerateJob)


def _context(config) -> int:
    return int(getattr(config, "max_position_embeddings", None) or 1 << 30)


def _config_or_none(target: str):
    """The target's config, read without its weights; None where it cannot be (the model load then says why)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(target)
    except (OSError, ValueError):
        return None


def _without_tokenizer(target: str) -> bool:
    """A local target directory with no tokenizer files: random starts and {input_ids} prompts need none."""
    from pathlib import Path

    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tiktoken.model")
    return Path(target).is_dir() and not any((Path(target) / f).exists() for f in files)


def run(args) -> int:
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from pathlib import Path

    from draftforge.data.generate import (check_settings, chat_jobs, generate_rows, random_start_jobs, row_settings,
                                          rows_problem, summary_lines)
    from draftforge.errors import DataError
    from draftforge.fsutil import output_problem
    from draftforge.loading import load_causal_lm

    args = GenerateJob(**values_from_args(args, GenerateJob))  # every value checked before the model loads
    check_settings(list(args.temperature), args.max_new_tokens, args.batch_size)
    problem = output_problem(args.out, "file")
    if problem:
        raise DataError(f"--out {args.out}: {problem}; give --out the JSONL file the rows go to")
    if args.threads:
        torch.set_num_threads(args.threads)
    check_device(args.device)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(args.dtype, device)
    settings = row_settings(args.max_new_tokens, args.seed, args.batch_size, dtype.name)
    problem = rows_problem(Path(args.out), settings, Path(args.prompts) if args.prompts else None)
    if problem:  # before the model loads: a user's file at --out, or a resume with other settings
        raise DataError(problem)
    from draftforge.errors import CheckpointError, first_line
    from draftforge.loading import local_model_dir

    local_model_dir(args.target, "target")  # a missing directory or a file: one line, before anything loads
    try:
        tokenizer = None if _without_tokenizer(args.target) else AutoTokenizer.from_pretrained(args.target)
    except (OSError, ValueError) as e:  # a Hub id offline, a broken tokenizer file
        where = "" if Path(args.target).exists() else "no such local directory; tried it as a Hugging Face Hub id: "
        raise CheckpointError(f"--target {args.target}: cannot read its tokenizer ({where}{first_line(e)})") from None
    config = _config_or_none(args.target) if args.prompts else None
    jobs = None
    if config is not None:  # a bad prompt file is refused before the weights load, not a minute later
        jobs = chat_jobs(args.prompts, tokenizer, _context(config), args.max_new_tokens, args.num_prompts)
    announce(dtype, "target")
    model = load_causal_lm(args.target, what="target", dtype=dtype.torch_dtype).to(device).eval()
    if args.prompts:
        if jobs is None:
            jobs = chat_jobs(args.prompts, tokenizer, _context(model.config), args.max_new_tokens, args.num_prompts)
        if args.num_prompts and len(jobs) < args.num_prompts:
            print(f"generate: -n {args.num_prompts} asked for more prompts than {args.prompts} holds; "
                  f"answering all {len(jobs)}")
    else:
        specials = set(tokenizer.all_special_ids) if tokenizer is not None else set()
        # the ids the tokenizer has: an embedding table padded past them (Qwen2.5: 151,936 rows, 151,665 ids)
        # holds rows no text ever trained
        vocab = model.config.vocab_size if tokenizer is None else min(model.config.vocab_size, len(tokenizer))
        jobs = random_start_jobs(args.random_starts, vocab, args.seed, specials)
    total = len(jobs) * len(args.temperature)
    print(f"generate: {len(jobs)} prompts x temperatures {args.temperature} = {total} rows, "
          f"up to {args.max_new_tokens} new tokens each, batches of {args.batch_size} on {device}, {dtype.name}, "
          f"{torch.get_num_threads()} torch threads")
    bars = []  # opened at the first finished batch, so an error before it is a line of its own

    def progress(new_rows: int, tokens_per_s: float, rows_there: int) -> None:
        # The first batch written opens the bar at the rows now there (a resumed file's kept rows with it), so
        # its rows/s and ETA count only the batches generated after it, never the rows skipped at once.
        if not bars:
            bars.append(tqdm(total=total, initial=rows_there, unit="row", dynamic_ncols=True))
        else:
            bars[0].update(new_rows)
        bars[0].set_postfix_str(f"{tokens_per_s:.1f} tok/s")

    stats = generate_rows(model, tokenizer, jobs, args.out, temperatures=list(args.temperature),
                          max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
                          progress=progress, target=args.target, dtype=dtype.name)
    for bar in bars:
        bar.close()
    print("\n".join(summary_lines(stats, args.out, total)))
    return 0
