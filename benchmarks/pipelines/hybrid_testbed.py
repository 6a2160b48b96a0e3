r"""A tiny hybrid testbed for CPU speed runs: a small Bamba target (Mamba2 + attention, 1.3M parameters)
briefly trained on stdlib code, a 512-token BPE tokenizer, held-out prompts, and a distill recipe for
its Mamba2 drafter; with --target/--drafter, the AR vs chain vs STree vs UCB measurement on any saved
hybrid target and Mamba drafter.

    python -m benchmarks.pipelines.hybrid_testbed --out runs/hybrid-testbed
    draftforge train runs/hybrid-testbed/pretrain.yaml        # the target: a few minutes of CE on code
    draftforge train runs/hybrid-testbed/distill.yaml         # its drafter: KL against the trained target
    python -m benchmarks.pipelines.hybrid_testbed --target runs/hybrid-testbed/target-run/export \
        --drafter runs/hybrid-testbed/drafter/export --bench runs/hybrid-testbed/prompts.jsonl \
        --tree stree13 --eval-out runs/hybrid-testbed/eval-stree13

The measurement is `draftforge eval` with the settings of docs/results/hybrid-stree.md §1 (methods
ar,chain,tree,ucb, a chain of 4 drafts, T = 0 and 1, 6 prompts x 64 tokens past EOS, 3 rotated repeats);
--tree takes widths (3,1,1,1), parent lists per layer (parents:0,0,0/0,0,1/0,0,1/0,0,0) or stree13,
STree's 13-token config A (Fig. 4a).

No hub weights are reachable, so the target is tiny and under-trained: its text is repetitive and
easy to draft. Numbers measured on it say how the harness behaves, not how a real hybrid would.
(`--sharpen` > 1 instead scales a random head for peaked but unlearnable distributions.)
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

import torch

from benchmarks.common import add_dtype_flag, number_list, positive_int
from tests.fixtures.tokenizers import testbed_bpe


def stdlib_texts(start: int, n: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if 2_000 < p.stat().st_size < 60_000)
    return [p.read_text(errors="replace") for p in files[start : start + n]]


def make_target(vocab: int, sharpen: float, seed: int):
    from transformers import BambaConfig, BambaForCausalLM

    torch.manual_seed(seed)
    config = BambaConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[2, 5], mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=1,
        mamba_d_state=32, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64, max_position_embeddings=2048,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    model = BambaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    model.generation_config.eos_token_id = 2
    return model


def measure(args) -> dict:
    """AR vs chain vs the static tree vs UCB on a saved target + drafter (one run_eval, one AR baseline)."""
    from draftforge.decode import parse_tree
    from draftforge.decode.methods import per_method
    from draftforge.eval.manifest import command_line
    from draftforge.eval.report import markdown_table
    from draftforge.eval.runner import EvalConfig, run_eval

    if not args.drafter or not args.bench:
        raise SystemExit("--target needs --drafter (a Mamba/Mamba2 drafter) and --bench (a prompt file or 'humaneval')")
    shape = parse_tree(args.tree)
    methods = tuple(args.methods.split(","))
    print(f"[hybrid_testbed] tree {shape.name}: {shape.size} drafts + root, depth {shape.depth}, "
          f"parents {shape.parents}", file=sys.stderr)
    out = args.eval_out or f"runs/hybrid-eval/{shape.name.replace('/', '_').replace(':', '_')}"
    report = run_eval(EvalConfig(
        target=args.target, drafter=args.drafter, bench=args.bench, methods=methods,
        temperatures=tuple(args.temperatures),
        method_options=per_method({"chain_length": args.chain_length, "tree": shape}, methods)[0], num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
        ignore_eos=args.ignore_eos, device=args.device, dtype=args.dtype, out_dir=out, command=command_line(),
        tree_draws=args.tree_draws,
        extra_manifest={"benchmark": "hybrid_testbed", "tree_name": shape.name, "tree_parents": shape.parents}))
    print(markdown_table(report))
    for kind, path in report["files"].items():
        print(f"{kind}: {path}")
    return report


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/hybrid-testbed", help="build: where the testbed is written")
    p.add_argument("--sharpen", type=float, default=1.0, help="scale of the random head (peakier distributions)")
    p.add_argument("--steps", type=int, default=200, help="max_steps of the written pretrain and distill recipes")
    p.add_argument("--seed", type=int, default=0)
    m = p.add_argument_group("measure (given --target): draftforge eval with the README's settings")
    m.add_argument("--target", help="a saved hybrid (or Mamba2) target directory, e.g. a train export")
    m.add_argument("--drafter", help="its Mamba/Mamba2 drafter directory (e.g. a distill export)")
    m.add_argument("--bench", help="prompt file (JSONL with 'prompt'/'text'/'messages'/'input_ids') or 'humaneval'")
    m.add_argument("--tree", default="stree13",
                   help="static tree: stree13 (default: STree's 13-token config A), parent lists per layer like "
                        "parents:0,0,0/0,0,1/0,0,1/0,0,0, or widths like 3,1,1,1")
    m.add_argument("--methods", default="ar,chain,tree,ucb", help="comma list (default ar,chain,tree,ucb)")
    m.add_argument("--chain-length", type=int, default=4, help="drafts per chain round (default 4, the paper's)")
    m.add_argument("--temperatures", type=number_list(float, 0), default="0,1", help="comma list (default 0,1)")
    m.add_argument("--tree-draws", choices=("distinct", "iid"), default="distinct",
                   help="sibling drafts at T > 0: without replacement (default, STree's) or i.i.d.")
    m.add_argument("--num-prompts", type=int, default=6, help="first N prompts (default 6)")
    m.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    m.add_argument("--repeats", type=positive_int, default=3, help="timed passes, method order rotated (default 3)")
    m.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="fixed-length outputs (default on)")
    m.add_argument("--device", default="cpu")
    add_dtype_flag(m)
    m.add_argument("--eval-out", help="report directory (default runs/hybrid-eval/<tree>)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.target:
        measure(args)
        return
    out = Path(args.out).resolve()
    (out / "corpus").mkdir(parents=True, exist_ok=True)
    train_texts, held = stdlib_texts(0, 48), stdlib_texts(48, 12)
    tok = testbed_bpe(train_texts, out / "target")
    target = make_target(len(tok), args.sharpen, args.seed)
    target.save_pretrained(out / "target")
    for i, text in enumerate(train_texts):
        (out / "corpus" / f"{i:03d}.py").write_text(text)
    with open(out / "prompts.jsonl", "w") as f:
        for text in held:
            f.write(json.dumps({"prompt": text[:300]}) + "\n")
    train = {"global_batch_size": 8, "micro_batch_size": 8, "block_size": 128, "eval_every": 0, "log_every": 20}
    data = {"sources": [str(out / "corpus")], "eval_fraction": 0.02}
    pretrain = {"task": "pretrain", "output_dir": str(out / "target-run"), "model": {"init_from": str(out / "target")},
                "data": data, "optim": {"lr": 3e-3, "warmup_steps": 20},
                "train": {**train, "max_steps": args.steps, "save_every": args.steps}}
    recipe = {
        "task": "distill", "output_dir": str(out / "drafter"),
        "model": {"arch": "mamba2", "size": "tiny", "target": str(out / "target-run" / "export"),
                  "overrides": {"hidden_size": 64, "num_hidden_layers": 2, "head_dim": 32, "state_size": 32}},
        "data": data, "distill": {"temperature": 1.0, "ce_weight": 0.0},
        "optim": {"lr": 3e-3, "warmup_steps": 20},
        "train": {**train, "max_steps": args.steps, "save_every": args.steps},
    }
    import yaml

    (out / "pretrain.yaml").write_text(yaml.safe_dump(pretrain, sort_keys=False))
    (out / "distill.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    print(json.dumps({"target": str(out / "target"), "recipe": str(out / "distill.yaml"),
                      "prompts": str(out / "prompts.jsonl"),
                      "target_params": sum(p.numel() for p in target.parameters())}, indent=1))


if __name__ == "__main__":
    main()
