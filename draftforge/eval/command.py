"""The `draftforge eval` subcommand: flags → EvalConfig → run_eval → Markdown table on stdout."""

from __future__ import annotations

import argparse

from draftforge.argcheck import EVAL_DEFAULTS, floats
from draftforge.decode import methods as method_registry
from draftforge.decode.sampling import TREE_DRAWS
from draftforge.errors import RecipeError
from draftforge.data.prompts import BENCHES
from draftforge.eval.runner import EvalConfig, run_eval
from draftforge.runtime import DTYPE_CHOICES, add_device_flag, add_dtype_flag


parse_floats = floats  # one reader of --temperature 0,1 for the light precheck and the command


def _first_sentence(text: str, limit: int = 96) -> str:
    """A method's help on one line of the --help listing, cut at a word (the whole text: docs/evaluation.md)."""
    if len(text) <= limit:
        return text
    return text[: limit - 1].rsplit(" ", 1)[0].rstrip(",;:(") + " …"


def parse_list(values: list[str] | None) -> tuple[str, ...]:
    return tuple(p.strip() for v in values or [] for p in v.split(",") if p.strip())


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `draftforge eval` flags to parser."""
    p, D = parser, EVAL_DEFAULTS  # the defaults the light precheck (draftforge/argcheck.py) assumes too
    p.add_argument("--target", required=True, help="target model: HF id or local path (the model being sped up)")
    p.add_argument("--drafter", help="drafter: an exported draftforge checkpoint, an HF Mamba or small causal LM, "
                                     "or prompt-lookup (n-gram copying from the prompt, no model)")
    p.add_argument("--bench", required=True,
                   help=f"a named prompt set ({', '.join(BENCHES)}) or a prompt file: Spec-Bench/MT-bench "
                        "question.jsonl ('turns'), or JSONL with 'prompt'/'text'/'messages'/'input_ids'")
    p.add_argument("--temperature", action="append", metavar="T",
                   help="sampling temperature; repeat or give a comma list to run several (default 0 = greedy)")
    p.add_argument("--max-new-tokens", type=int, default=D["max_new_tokens"],
                   help=f"tokens generated per prompt (default {D['max_new_tokens']})")
    p.add_argument("--methods", action="append", metavar="M",
                   help="decoding methods, comma list or repeated (default ar,chain,tree; ar always runs as the "
                        "baseline): the methods are listed below, and in docs/evaluation.md")
    width = max(len(m.name) for m in method_registry.METHODS.values())
    p.epilog = "methods (--methods):\n" + "\n".join(
        f"  {m.name:<{width}}  {_first_sentence(m.help)}" for m in method_registry.METHODS.values())
    for option in method_registry.OPTIONS.values():  # each method's options dataclass, as registered
        used_by = ", ".join(method_registry.readers(option.name))
        choices = method_registry.literal_choices(option.type)  # a Literal field: argparse lists its values
        p.add_argument(option.flag, dest=option.name, action="append" if option.repeat else "store",
                       choices=choices, metavar=None if choices else "VALUE", help=f"[{used_by}] {option.help}")
    p.add_argument("--baseline", action="append", metavar="B",
                   help="extra baselines, comma list or repeated: ar, hf_assisted (default: ar, plus "
                        "hf_assisted when the drafter is a Transformer)")
    p.add_argument("--top-p", type=float, default=D["top_p"], help="nucleus sampling mass for T > 0 (default 1.0)")
    p.add_argument("--top-k", type=int, default=D["top_k"], help="top-k sampling for T > 0, 0 = off (default)")
    p.add_argument("--tree-draws", choices=TREE_DRAWS, default="distinct",
                   help="how a tree's sibling drafts are drawn at T > 0: distinct (without replacement, verified by "
                        "recursive rejection sampling; STree's, default) or iid (with replacement, SpecInfer's "
                        "multi-step speculative sampling). Both are exact; distinct siblings are never duplicates")
    p.add_argument("--num-prompts", type=int, help="use only the first N prompts (default: all)")
    p.add_argument("--repeats", type=int, default=D["repeats"],
                   help=f"timed passes, methods rotated; the report gives min/median/max tok/s (default {D['repeats']})")
    p.add_argument("--warmup", type=int, default=D["warmup"],
                   help=f"prompts run untimed per method before timing (default {D['warmup']})")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--chat-template", choices=("auto", "always", "never"), default="auto",
                   help="auto: chat prompts ('turns'/'messages') use the target's chat template if it has one")
    p.add_argument("--out", default="eval_out",
                   help="directory for report.json, report.md and PNG plots, checked before any model loads "
                        "(default eval_out)")
    p.add_argument("--answers", metavar="DIR",
                   help="also write Spec-Bench answer files into DIR: one JSONL per method and temperature "
                        "(<target>-<method>-<dtype>-temp-<T>.jsonl, Spec-Bench's model_answer layout, every turn of "
                        "a multi-turn question), for Spec-Bench's evaluation/speed.py and equal.py; files of the "
                        "same name are replaced")
    add_device_flag(p)
    add_dtype_flag(p, ". The T=0 self-check is bitwise in float32; in reduced precision a difference must be a "
                      "measured near-tie")
    p.add_argument("--drafter-dtype", choices=DTYPE_CHOICES, help="the drafter's dtype (default: as --dtype)")
    p.add_argument("--threads", type=int,
                   help="torch intra-op threads on CPU (default 1, or OMP_NUM_THREADS when set: batch-1 decoding "
                        "gains little from more and loses several-fold when another process keeps a core busy)")
    p.add_argument("--cost-repeats", type=int, default=D["cost_repeats"],
                   help="timed passes per verification size for the report's cost model (default 5; 0 = skip)")
    p.add_argument("--tune-chain-length", action="store_true",
                   help="before timing, run chain at --chain-length on the warm-up prompts (untimed), predict "
                        "every shorter length from those rounds with the cost model, and time chain at the best "
                        "one, per temperature (the report lists the predictions; needs --cost-repeats > 0)")
    p.add_argument("--allow-vocab-mismatch", action="store_true",
                   help="run a drafter whose tokenizer differs from the target's (see draftforge.decode docs)")
    p.add_argument("--cuda-graphs", choices=("auto", "on", "off"), default="auto",
                   help="capture the Mamba drafter's per-batch-size decode steps in CUDA graphs: auto = on "
                        "when --device is CUDA (default), on = require CUDA, off = eager")
    p.add_argument("--seed", type=int, default=0, help="sampling seed; prompt i uses seed + i (default 0)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-strict-selfcheck", action="store_true",
                   help="report, instead of failing on, fp32 greedy outputs that differ from AR")
    return p


def method_options_from_args(args: argparse.Namespace) -> dict:
    """Each option flag given, parsed (checked when EvalConfig is validated), by option name."""
    given = {}
    for option in method_registry.OPTIONS.values():
        raw = getattr(args, option.name, None)
        if raw is not None:
            given[option.name] = tuple(option.parse(r) for r in raw) if option.repeat else option.parse(raw)
    return given


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    methods = parse_list(args.methods) or ("ar", "chain", "tree")
    baselines = parse_list(args.baseline) or None
    asked = set(methods) | set(baselines or ()) | {m.name for m in method_registry.METHODS.values() if m.baseline}
    # a flag read by several methods (--chain-length: chain and eesd) goes to each of them that runs
    options, unread = method_registry.per_method(method_options_from_args(args), asked)
    if unread:
        flags = ", ".join(method_registry.OPTIONS[n].flag for n in unread)
        readers = ", ".join(sorted({m for n in unread for m in method_registry.readers(n)}))
        raise RecipeError(f"{flags} given, but no method of this run reads it (read by {readers}); add the method "
                          f"to --methods (running: {', '.join(dict.fromkeys(('ar',) + methods))})")
    return EvalConfig(
        target=args.target, bench=args.bench, drafter=args.drafter,
        temperatures=parse_floats(args.temperature, "--temperature") or (0.0,),
        max_new_tokens=args.max_new_tokens, methods=methods, baselines=baselines,
        method_options=options,
        top_p=args.top_p, top_k=args.top_k, tree_draws=args.tree_draws,
        num_prompts=args.num_prompts, repeats=args.repeats, warmup=args.warmup, ignore_eos=args.ignore_eos,
        chat_template=args.chat_template, device=args.device, dtype=args.dtype, drafter_dtype=args.drafter_dtype,
        threads=args.threads, cost_repeats=args.cost_repeats, tune_chain_length=args.tune_chain_length,
        allow_vocab_mismatch=args.allow_vocab_mismatch, cuda_graphs=args.cuda_graphs, seed=args.seed,
        out_dir=args.out, answers=args.answers, plots=not args.no_plots, strict_selfcheck=not args.no_strict_selfcheck,
    )


def run(args: argparse.Namespace) -> int:
    """Run the eval and print the table and the report paths; user errors propagate as DraftforgeError."""
    from draftforge.eval.report import markdown_table

    report = run_eval(config_from_args(args))
    print(markdown_table(report))
    print()
    for kind, path in report["files"].items():
        print(f"{kind}: {path}")
    if report.get("pace_warning"):
        print(f"warning: {report['pace_warning']}")
    return 0
