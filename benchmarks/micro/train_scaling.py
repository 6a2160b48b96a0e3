"""Training throughput on 1 vs 2 CPU processes (DDP over gloo) for the tiny pre-training recipe.

    OMP_NUM_THREADS=1 python -m benchmarks.micro.train_scaling                 # self-contained corpus + tokenizer
    OMP_NUM_THREADS=1 python -m benchmarks.micro.train_scaling --recipe recipes/tiny/pretrain.yaml  # after the demo

Both launches train the same recipe (same global batch; 1 process accumulates 2 micro-batches where 2
processes take one each) for --steps steps. Tokens/s is the loop's own figure (first step excluded as
warm-up), median over --repeats runs, alternating 1 and 2 processes so background load hits both alike.
Scaling efficiency = tokens/s(2) / (2 x tokens/s(1)). On a shared 2-core machine the 2-process figure is
noisy and capped by the cores; read it as "does DDP cost much", not as a cluster prediction.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import yaml

from benchmarks.common import REPO, checked_args, positive_int, print_table, write_json

TINY = REPO / "recipes" / "tiny" / "pretrain.yaml"


def self_contained_recipe(root: Path) -> dict:
    """The tiny pre-training recipe's model and batch shape on a local corpus (Python stdlib sources)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="ignore") for p in sorted(stdlib.glob("*.py"))[:80]]
    corpus = root / "corpus"
    corpus.mkdir()
    for i, text in enumerate(texts):
        (corpus / f"doc{i:03d}.txt").write_text(text)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=1024, special_tokens=["<pad>", "<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(root / "tokenizer")
    values = yaml.safe_load(TINY.read_text())
    values["model"] = {"arch": "mamba2", "size": "tiny", "tokenizer": str(root / "tokenizer")}
    values["data"] = {"sources": [str(corpus)], "eval_fraction": 0.0}
    return values


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


THREADS = 1  # torch threads of every process: 2 processes on 2 cores, one core each


def run_once(recipe: Path, out: Path, procs: int, steps: int, micro: int) -> float:
    args = ["-m", "draftforge", "train", str(recipe), "--overwrite", "--set", f"output_dir={out}",
            "--set", f"train.max_steps={steps}", "--set", f"train.micro_batch_size={micro}",
            "--set", "train.save_every=0", "--set", "train.eval_every=0", "--set", "train.export=false",
            "--set", "train.trackers=[]"]
    if procs > 1:
        args = ["-m", "accelerate.commands.launch", "--config_file", str(REPO / "launch" / "multi_cpu.yaml"),
                "--num_processes", str(procs), "--main_process_port", str(free_port()), *args]
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{procs}-process run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    done = re.search(r"done: .*?([\d,]+) tokens/s", proc.stdout)
    return float(done.group(1).replace(",", ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", help="a pretrain recipe (default: the tiny recipe's shape on a local corpus)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--out", default="benchmarks/results/train_scaling.json")
    args = checked_args(ap)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.recipe:
            values = yaml.safe_load(Path(args.recipe).read_text())
        else:
            values = self_contained_recipe(root)
        values.setdefault("train", {})["trackers"] = []
        recipe = root / "recipe.yaml"
        recipe.write_text(yaml.safe_dump(values))
        G = values["train"]["global_batch_size"]
        micro = G // 2  # 1 process: 2 micro-batches accumulated; 2 processes: one each (same global batch)
        runs = {1: [], 2: []}
        run_once(recipe, root / "warm", 1, 2, micro)  # warm the datasets cache and the page cache
        for r in range(args.repeats):
            for procs in ((1, 2), (2, 1))[r % 2]:  # alternated, and rotated so neither always runs first
                runs[procs].append(run_once(recipe, root / f"run{procs}", procs, args.steps, micro))
    tok_s = {p: statistics.median(v) for p, v in runs.items()}
    eff = tok_s[2] / (2 * tok_s[1])
    rows = [(p, tok_s[p], tok_s[p] / p, ", ".join(f"{x:,.0f}" for x in runs[p])) for p in (1, 2)]
    print(f"tiny pre-training recipe: global batch {G} x {values['train']['block_size']} tokens, "
          f"{args.steps} steps, median of {args.repeats}; {THREADS} torch thread per process (OMP_NUM_THREADS); "
          f"cores on this machine: {os.cpu_count()}")
    print_table(["processes", "tokens/s", "tokens/s/process", "runs"],
                [[p, f"{t:,.0f}", f"{tp:,.0f}", all_runs] for p, t, tp, all_runs in rows], right={0, 1, 2})
    print(f"scaling efficiency (2 vs 1): {eff:.2f}  (1.00 = perfect; CPU cores shared, noisy)")
    result = {"recipe": args.recipe or "tiny pretrain shape, self-contained corpus", "steps": args.steps,
              "repeats": args.repeats, "global_batch": G, "cpu_count": os.cpu_count(), "threads_per_process": THREADS,
              "tokens_per_s": {str(p): tok_s[p] for p in tok_s}, "runs": {str(p): runs[p] for p in runs},
              "tokens_per_s_per_process": {str(p): tok_s[p] / p for p in tok_s}, "scaling_efficiency": eff}
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
