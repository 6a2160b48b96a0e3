"""`draftforge eval`'s settings: `EvalConfig` (each flag of the command is one of its settings, declared once with
`options.option`; eval/command.py generates the flags), and `validate`, which checks them once and resolves every
running method's options before any model loads. The runner (eval/runner.py) reads only a validated config.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, replace
from pathlib import Path
from typing import Literal

from draftforge.argcheck import (EVAL_DEFAULTS, check_eval_settings, check_prefill_chunk, check_token_count,
                                 repeated, temperature_list)
from draftforge.data.prompts import BENCHES
from draftforge.decode import methods as method_registry
from draftforge.decode.drafters.cuda_graphs import use_cuda_graphs
from draftforge.errors import RecipeError
from draftforge.eval.output import check_out
from draftforge.options import check_fields, option
from draftforge.runtime import PRECISIONS, check_device


def comma_list(text: str) -> tuple[str, ...]:
    """'ar,chain' -> ('ar', 'chain'): a repeatable flag's comma list."""
    return tuple(p.strip() for p in str(text).split(",") if p.strip())


D = EVAL_DEFAULTS  # the defaults the light precheck (draftforge/argcheck.py) assumes for the same flags
DTYPE_HELP = ("auto = bfloat16 where the device computes it natively (CUDA with bf16, CPUs with AVX512-BF16 or "
              "AMX), else float32; fp32 / bf16 / fp16 are the same words as train.precision")


@dataclass
class EvalConfig:
    """What `draftforge eval` runs: every flag of the command is one of these settings (eval/command.py generates
    the flags from them), and `run_eval(EvalConfig(...))` takes the same from Python. `validate` checks them once
    and returns the config with each method's options resolved."""

    target: str = option(MISSING, "target model: HF id or local path (the model being sped up)")
    bench: str = option(MISSING, f"a named prompt set ({', '.join(BENCHES)}) or a prompt file: Spec-Bench/MT-bench "
                        "question.jsonl ('turns'), or JSONL with 'prompt'/'text'/'messages'/'input_ids'")
    drafter: str | None = option(None, "drafter: an exported draftforge checkpoint, an HF Mamba or small causal LM, "
                                 "or prompt-lookup (n-gram copying from the prompt, no model); every method but ar, "
                                 "lookup and hf_prompt_lookup needs one")
    temperatures: tuple[float, ...] = option(
        (0.0,), "sampling temperature; repeat or give a comma list to run several in one process (0 = greedy)",
        flag="--temperature", repeat=True, parse=temperature_list, metavar="T")
    max_new_tokens: int = option(D["max_new_tokens"], "tokens generated per prompt")
    methods: tuple[str, ...] = option(
        ("ar", "chain", "tree"), "decoding methods, comma list or repeated (ar always runs as the baseline): the "
        "methods are listed below, and in docs/evaluation.md", repeat=True, parse=comma_list, metavar="M")
    baselines: tuple[str, ...] | None = option(
        None, "extra baselines, comma list or repeated: ar, hf_assisted (default: ar, plus hf_assisted when "
        "transformers can run the drafter as its assistant: a Transformer, or from transformers 5.25 a Mamba)",
        flag="--baseline", repeat=True, parse=comma_list, metavar="B")
    # method -> its options: the method's options dataclass (decode/methods/__init__.py), or a dict of values by option
    # name, e.g. {"tree": {"tree": "stree13"}, "chain": ChainOptions(chain_length=3)}; a method not named here runs
    # with its defaults. `validate` resolves every running method's to its dataclass (unknown names: "did you mean").
    method_options: dict = option({}, "each method's options", cli=False)
    top_p: float = option(D["top_p"], "nucleus sampling mass for T > 0")
    top_k: int = option(D["top_k"], "top-k sampling for T > 0, 0 = off")
    tree_draws: Literal["distinct", "iid"] = option(
        "distinct", "how a tree's sibling drafts are drawn at T > 0: distinct (without replacement, verified by "
        "recursive rejection sampling; STree's, default) or iid (with replacement, SpecInfer's multi-step "
        "speculative sampling). Both are exact; distinct siblings are never duplicates")
    num_prompts: int | None = option(None, "use only the first N prompts (default: all; fewer when the bench has "
                                     "fewer, as the log's prompt count says)")
    repeats: int = option(1, "timed passes over all prompts, methods rotated; the report gives min/median/max "
                          "tok/s (the command's default is 3, a measurement; from Python 1, a quick call)")
    warmup: int = option(D["warmup"], "prompts run untimed per method and temperature before timing")
    ignore_eos: bool = option(False, "always generate --max-new-tokens tokens (fixed-length benchmarks)")
    chat_template: Literal["auto", "always", "never"] = option(
        "auto", "auto: chat prompts ('turns'/'messages') use the target's chat template if it has one")
    device: str = option("cpu", "cpu, cuda or cuda:N")
    dtype: PRECISIONS = option("auto", "model dtype: " + DTYPE_HELP + ". The T=0 self-check is bitwise in float32; "
                               "in reduced precision a difference must be a measured near-tie")
    drafter_dtype: PRECISIONS | None = option(None, "the drafter's dtype (default: as --dtype)")
    threads: int | None = option(None, "torch intra-op threads on CPU (default 1, or OMP_NUM_THREADS when set: "
                                 "batch-1 decoding gains little from more and loses several-fold when another "
                                 "process keeps a core busy)")
    cost_repeats: int = option(D["cost_repeats"], "timed passes per verification size for the report's cost model "
                               "(0 = skip)")
    tune_chain_length: bool = option(
        False, "before timing, run chain at --chain-length on the warm-up prompts (untimed), predict every shorter "
        "length from those rounds with the cost model, and time chain at the best one, per temperature (the "
        "report lists the predictions; needs --cost-repeats > 0)")
    allow_vocab_mismatch: bool = option(False, "run a drafter whose tokenizer differs from the target's")
    lookup_first: str | None = option(
        None, "prompt lookup first: each round, where the text's last n tokens occurred earlier (n >= min_ngram, 2 "
        "unless given) lookup drafts what followed, and the drafter drafts the other rounds (at most drafter_tokens "
        "deep when given); a prompt-lookup spec, e.g. prompt-lookup or prompt-lookup:min_ngram=3,drafter_tokens=2 "
        "(chain, tree and ucb; not eagle2 / c2t)", metavar="SPEC")
    head_window: int | None = option(
        None, "an EAGLE-3 head attends to the last N committed tokens only (default: every token): a long prompt "
        "is encoded as its last N tokens and the head's cache holds N rows at any context. Lossless either way (the "
        "target verifies); acceptance is what it changes, so measure it. A head trained on blocks of B tokens has "
        "never attended to more than B", metavar="N")
    cuda_graphs: Literal["auto", "on", "off"] = option(
        "auto", "capture the Mamba drafter's per-batch-size decode steps in CUDA graphs: auto = on when --device is "
        "CUDA, on = require CUDA, off = eager")
    pack_weights: Literal["auto", "on", "off"] = option(
        "auto", "lay the target's and drafter's linear weights out once for oneDNN (CPU, bf16/fp16; each layer "
        "only where its product stays bitwise equal, so no output changes; +the linears' bytes in memory): auto = "
        "when it applies, off = plain torch linears (the speed every earlier draftforge number was measured at)")
    decode_attention: Literal["auto", "on", "off"] = option(
        "auto", "CPU bf16/fp16 Llama-family target and drafter: attention of a decoding step / verified draft (up to "
        "64 query rows) without copying the KV cache per query head, by float32 matmul-softmax-matmul or torch's "
        "flash kernel with query heads packed per KV head, whichever a probe at load finds faster on this CPU for "
        "each row count (DRAFTFORGE_FLASH_ROWS=N fixes it; the report names the choice; bf16 outputs may part from "
        "sdpa's at near-ties, which the self-check classifies; fp32 untouched): auto = when it applies, off = "
        "transformers' sdpa")
    lean_forward: Literal["auto", "on", "off"] = option(
        "auto", "CPU or GPU Llama target and drafter: decoding steps (up to 64 tokens) through draftforge's lean "
        "forward, the model's tensor operations without transformers' per-layer Python and with q/k/v and gate/up "
        "fused where the weights are packed; used only where a probe decode at load is bitwise equal to the "
        "model's own forward, so no output changes: auto = when it applies, off = the model's own forward")
    prefill_chunk: int | None = option(
        None, "encode each prompt in forwards of N tokens, each continuing the K/V cache (and an SSM / hybrid "
        "target's conv and SSM states; default: one forward). "
        "Bounds the prefill's attention scores to N x context instead of context x context; logits equal one "
        "forward's within the dtype's rounding (not always bitwise: CPU GEMM sums may depend on the row count). In "
        "bf16 that rounding can change greedy text (SmolLM2, chunks of 256: from the 13th token of a long "
        "question): compare runs encoded the same way",
        metavar="N")
    seed: int = option(0, "sampling seed; prompt i uses seed + i")
    out_dir: str = option("eval_out", "directory for report.json, report.md and PNG plots, checked before any "
                          "model loads", flag="--out", metavar="DIR")
    answers: str | None = option(
        None, "also write Spec-Bench answer files into this directory: one JSONL per method and temperature "
        "(<target>-<method>-<dtype>-temp-<T>.jsonl, Spec-Bench's model_answer layout, every turn of a multi-turn "
        "question), for Spec-Bench's evaluation/speed.py and equal.py; files of the same name are replaced",
        metavar="DIR")
    plots: bool = option(True, "skip the PNG plots", flag="--no-plots")
    component_memory: bool = option(
        True, "skip the memory-by-component decode (after the timed runs, one untimed decode of each context "
        "length's first prompt per method, metering the target's and the drafter's calls apart)",
        flag="--no-component-memory")
    self_check: Literal["classify", "identity"] = option(
        "classify", "T=0 self-check against AR: classify = each output that differs from AR's is classified as a "
        "near-tie or a defect (one float32 and two plain forwards over its prefix, and AR's tokens checked by one "
        "teacher-forced forward per prompt: at 8k tokens of context as much work as the timed passes); identity = "
        "count identical outputs only, differences left unclassified (fp32 still fails on any)", flag="--self-check")
    strict_selfcheck: bool = option(True, "report, instead of failing on, what the self-check flags: any greedy "
                                    "output that differs from AR in fp32, a defect in any dtype",
                                    flag="--no-strict-selfcheck")
    command: str | None = option(None, "recorded in the manifest (default: sys.argv)", cli=False)
    quiet: bool = option(False, "no progress lines on stderr", cli=False)
    extra_manifest: dict = option({}, "more keys for the manifest", cli=False)


def validate(cfg: EvalConfig) -> EvalConfig:
    """Reject impossible settings before any model is loaded; return the config with every running method's
    options resolved to its checked dataclass (what the runner reads: it resolves nothing again)."""
    check_eval_settings(cfg.temperatures, cfg.max_new_tokens, cfg.repeats, cfg.warmup, cfg.num_prompts, cfg.top_p,
                        cfg.top_k, cfg.threads, cfg.cost_repeats)  # the rules the CLI also checks before importing
    check_fields(cfg)  # the Literal settings: dtype, tree_draws, chat_template, cuda_graphs, ...
    check_prefill_chunk(cfg.prefill_chunk, "--prefill-chunk")
    if cfg.tune_chain_length and ("chain" not in cfg.methods or not cfg.cost_repeats):
        raise RecipeError("--tune-chain-length picks chain's draft length with the cost model: run the chain method "
                          f"(--methods ...,chain) with --cost-repeats > 0 (methods: {', '.join(cfg.methods)}, "
                          f"--cost-repeats {cfg.cost_repeats})")
    if not isinstance(cfg.seed, int) or not 0 <= cfg.seed < 2**32:  # prompt i samples with seed + i
        raise RecipeError(f"--seed must be an integer in [0, 2**32), got {cfg.seed}")
    check_device(cfg.device)
    # "on" without CUDA fails here, before minutes of target loading (resolution needs no GPU).
    use_cuda_graphs(cfg.cuda_graphs, cfg.device)
    twice = repeated(cfg.methods)
    if twice is not None:  # a method runs once per temperature, with one set of options: a second listing was lost
        raise RecipeError(f"--methods names {twice} twice; give each method once (its options are flags such as "
                          "--chain-length, or method_options from Python)")
    for m in tuple(cfg.methods) + tuple(cfg.baselines or ()):
        if m not in method_registry.METHODS:
            raise RecipeError(f"unknown method {m!r}; {method_registry.suggest(m)}")
        if cfg.drafter is None and method_registry.METHODS[m].needs_drafter:
            raise RecipeError(f"speculative methods need --drafter ({m!r} does); give one or use --methods ar")
    if cfg.lookup_first is not None:
        check_lookup_first(cfg)
    if cfg.head_window is not None:
        check_token_count(cfg.head_window, "--head-window")
        from draftforge.decode.loading import lookup_options

        if cfg.drafter is None or lookup_options(cfg.drafter) is not None:
            raise RecipeError("--head-window applies to a --drafter that is an EAGLE-3 head, not to "
                              f"{cfg.drafter or 'no drafter'}")
    return replace(cfg, method_options=resolve_method_options(cfg))  # every option checked here, once


def check_lookup_first(cfg: EvalConfig) -> None:
    """--lookup-first: a prompt-lookup spec, a trained drafter to fall back on, no dynamic-tree method."""
    from draftforge.decode.loading import LOOKUP_FIRST_KEYS, LOOKUP_FORM, lookup_options

    if lookup_options(cfg.lookup_first, LOOKUP_FIRST_KEYS) is None:
        raise RecipeError(f"--lookup-first {cfg.lookup_first!r} is not a prompt-lookup spec; give {LOOKUP_FORM}")
    if cfg.drafter is None or lookup_options(cfg.drafter) is not None:
        raise RecipeError("--lookup-first falls back on a trained drafter: give --drafter a checkpoint, not "
                          f"{cfg.drafter or 'nothing'}")
    dynamic = [m for m in cfg.methods if method_registry.METHODS[m].dynamic_trees]
    if dynamic:
        raise RecipeError(f"--lookup-first drafts static trees and chains; {', '.join(dynamic)} build dynamic trees "
                          "(run them in another eval without --lookup-first)")


def check_paths(cfg: EvalConfig) -> None:
    """A --target / --drafter that names a missing local directory, or an --out that cannot take the report,
    fails before any model loads."""
    from draftforge.decode.loading import check_local_models

    check_out(cfg.out_dir)
    check_local_models(cfg.target, cfg.drafter)
    if cfg.head_window is not None and isinstance(cfg.drafter, str):
        check_head_window_export(cfg.drafter)


def check_head_window_export(path) -> None:
    """--head-window on an export that is not an EAGLE-3 attention head, refused from its metadata before the
    target loads (the drafter loader says the same after loading; a Hub id or a directory without draftforge's
    metadata is left to it)."""
    from draftforge.export import METADATA_FILE, read_export_metadata
    from draftforge.models.eagle3 import HEAD_KIND
    from draftforge.models.feature_mamba import BODY as MAMBA_BODY, head_window_refusal

    path = Path(path).expanduser()
    if not (path / METADATA_FILE).is_file():
        return
    meta = read_export_metadata(path)
    head = meta.get("head")
    if meta.get("task") != HEAD_KIND:
        raise RecipeError(f"--head-window keeps the last N keys of an EAGLE-3 head; {path} is a {meta.get('task')!r} "
                          "export (drop --head-window)")
    if isinstance(head, dict) and head.get("body") == MAMBA_BODY:
        raise RecipeError(head_window_refusal("--head-window", str(path)))


def resolve_method_options(cfg: EvalConfig) -> dict[str, method_registry.MethodOptions]:
    """Every method this run may build -> its options dataclass, each value checked once. Options given for a
    method the run does not run are refused (a flag nobody reads would be silently ignored)."""
    required, optional = method_order(cfg)
    running = required + optional
    for m, given in cfg.method_options.items():
        if m not in running:
            names = given if isinstance(given, dict) else {}
            flags = ", ".join(method_registry.OPTIONS[k].flag for k in names if k in method_registry.OPTIONS)
            raise RecipeError(f"options given for method {m!r} ({flags or 'its options'}), which this run does not "
                              f"run; add it to --methods (running: {', '.join(running)})")
    return {m: method_registry.resolve_options(m, cfg.method_options.get(m)) for m in running}


def method_order(cfg: EvalConfig) -> tuple[list[str], list[str]]:
    """(methods that must build, optional baselines that may be skipped), AR first, no duplicates."""
    required = ["ar"] + [m for m in cfg.methods if m != "ar"]
    if cfg.baselines is None:  # external baselines run when they can (hf_assisted: HF drafters)
        optional = [m for m, info in method_registry.METHODS.items() if info.baseline] if cfg.drafter else []
    else:
        required += list(cfg.baselines)
        optional = []
    required = list(dict.fromkeys(required))
    return required, [m for m in optional if m not in required]


def resolved_options(cfg: EvalConfig) -> dict[str, method_registry.MethodOptions]:
    """The options of a validated config (validate's return), by method; a config not validated is refused."""
    options = cfg.method_options
    if not all(isinstance(options.get(m), method_registry.MethodOptions) for m in sum(method_order(cfg), [])):
        raise TypeError("pass the config through validate(cfg) first: it resolves each method's options once")
    return options
