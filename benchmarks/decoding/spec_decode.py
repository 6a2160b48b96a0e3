"""Speculative decoding benchmark: AR vs chain vs static tree vs UCB tree (Mamba drafter), chain/tree with a
Transformer drafter, and HF assisted generation, at temperatures 0 and 1. Prints tables, writes JSON.

    OMP_NUM_THREADS=1 python -m benchmarks.decoding.spec_decode --target T --mamba-drafter M --transformer-drafter D
    OMP_NUM_THREADS=1 python -m benchmarks.decoding.spec_decode --random-models   # smoke run on tiny random models

Each drafter gets its own run_eval (same prompts, AR measured again in that run, after warm-up, median of
repeats), so every speedup is against an AR baseline timed in the same process minutes apart.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from benchmarks.common import add_flags, number_list, one_line_errors
from draftforge.decode import parse_tree
from draftforge.decode.methods import per_method
from draftforge.eval.manifest import command_line
from draftforge.eval.report import atomic_write_text, markdown_table
from draftforge.eval.runner import EvalConfig, run_eval


def save_random_models(root: Path, vocab: int = 128, seed: int = 0) -> dict[str, str]:
    """Tiny random Llama target, Llama drafter and Mamba drafter (same vocab) saved as HF checkpoints."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MambaConfig, MambaForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    target = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=512, **common))
    drafter = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1,
                                           max_position_embeddings=512, **common))
    mamba = MambaForCausalLM(MambaConfig(hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                                         conv_kernel=4, **common))
    paths = {}
    for name, model in (("target", target), ("transformer_drafter", drafter), ("mamba_drafter", mamba)):
        paths[name] = str(root / name)
        model.save_pretrained(paths[name])
    return paths


def write_random_prompts(path: Path, n: int, vocab: int = 128, seed: int = 0) -> str:
    import random

    rng = random.Random(seed)
    rows = [{"input_ids": [rng.randrange(2, vocab) for _ in range(rng.randrange(4, 24))]} for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", help="target checkpoint (e.g. the testbed's tiny target)")
    p.add_argument("--mamba-drafter", help="Mamba/Mamba2 drafter checkpoint")
    p.add_argument("--transformer-drafter", help="small Transformer drafter checkpoint (also used for HF assisted)")
    p.add_argument("--random-models", action="store_true", help="build tiny random models instead (smoke run)")
    p.add_argument("--bench", default="testbed", help="prompt file, or 'testbed' (default)")
    add_flags(p, num_prompts=8, max_new_tokens=64, repeats=3)
    p.add_argument("--temperatures", type=number_list(float, 0), default="0,1", help="comma list (default 0,1)")
    p.add_argument("--chain-length", type=int, default=5)
    p.add_argument("--tree", default="3,2,2,1", help="static tree: widths like 3,2,2,1, parent lists per layer like "
                   "parents:0,0,0/0,0,1/0,0,1/0,0,0, or stree13 (STree's 13-token tree)")
    p.add_argument("--tree-draws", choices=("distinct", "iid"), default="distinct",
                   help="sibling drafts at T > 0: without replacement (default) or i.i.d. (before 2026-11-22)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="auto (default): bfloat16 where the device computes it natively, else float32")
    p.add_argument("--threads", type=int, help="torch threads (default 1, or OMP_NUM_THREADS)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="fixed-length outputs: every method, hf_assisted included, runs past EOS")
    p.add_argument("--out", default="bench_out/spec_decode")
    return p.parse_args(argv)


def run_suite(args, target: str, drafters: dict[str, str | None], bench: str) -> dict:
    temps = tuple(args.temperatures)
    tree = parse_tree(args.tree)
    plan = {
        "mamba": (drafters.get("mamba"), ("ar", "chain", "tree", "ucb"), ("ar",)),
        "transformer": (drafters.get("transformer"), ("ar", "chain", "tree"), ("ar", "hf_assisted")),
    }
    reports = {}
    for name, (drafter, methods, baselines) in plan.items():
        if drafter is None:
            print(f"[bench] no {name} drafter given; skipping", file=sys.stderr)
            continue
        cfg = EvalConfig(target=target, drafter=drafter, bench=bench, temperatures=temps, methods=methods,
                         baselines=baselines, max_new_tokens=args.max_new_tokens, num_prompts=args.num_prompts,
                         repeats=args.repeats, device=args.device,
                         method_options=per_method({"chain_length": args.chain_length, "tree": tree}, methods)[0],
                         dtype=args.dtype, threads=args.threads, ignore_eos=args.ignore_eos, out_dir=str(Path(args.out) / name),
                         tree_draws=args.tree_draws,
                         command=command_line(), extra_manifest={"benchmark": f"spec_decode/{name}"})
        reports[name] = run_eval(cfg)
        print(f"\n## {name} drafter ({drafter})\n\n{markdown_table(reports[name])}\n")
    return reports


@one_line_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.random_models:
            paths = save_random_models(Path(tmp))
            target = paths["target"]
            drafters = {"mamba": paths["mamba_drafter"], "transformer": paths["transformer_drafter"]}
            bench = write_random_prompts(Path(tmp) / "prompts.jsonl", args.num_prompts)
        else:
            if not args.target:
                raise SystemExit("give --target (and drafters), or --random-models for a smoke run")
            target, bench = args.target, args.bench
            drafters = {"mamba": args.mamba_drafter, "transformer": args.transformer_drafter}
        reports = run_suite(args, target, drafters, bench)
    summary = {name: {"results": [{k: r[k] for k in ("method", "temperature", "tau", "tau_no_bonus",
                                                      "tokens_per_s", "tokens_per_s_spread", "speedup",
                                                      "acceptance_rate", "self_check")} for r in rep["results"]],
                      "manifest": rep["manifest"], "report": rep["files"]["json"]}
               for name, rep in reports.items()}
    out = Path(args.out) / "spec_decode.json"
    atomic_write_text(out, json.dumps(summary, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
