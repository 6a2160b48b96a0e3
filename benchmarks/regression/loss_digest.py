"""Loss-curve digest of the tiny pretrain + sft recipes: the proof a refactor moved nothing.

Runs recipes/tiny/pretrain.yaml then recipes/tiny/sft.yaml (shortened, on a small stdlib corpus and
tokenizer this script builds), fp32 on CPU with 1 thread, and writes every logged loss, the eval
losses, metrics.jsonl and the exported weights' sha256. Run it on two checkouts and compare:

    python -m benchmarks.regression.loss_digest --out /tmp/new.json
    (cd OLD_CHECKOUT && PYTHONPATH=.:NEW_CHECKOUT python -m benchmarks.regression.loss_digest --out /tmp/old.json)
    python -m benchmarks.regression.loss_digest --compare /tmp/old.json /tmp/new.json

In the old checkout its own `draftforge` trains; where that checkout has no `benchmarks/regression/`, Python
takes this package from NEW_CHECKOUT.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.common import digest_cli


def build_inputs(work: Path) -> tuple[Path, Path, Path]:
    from transformers import AutoTokenizer

    from draftforge.testbed import train_tokenizer, write_corpus_jsonl

    tok_dir, corpus, sft = work / "tok", work / "corpus.jsonl", work / "sft.jsonl"
    train_tokenizer(tok_dir, vocab_size=512, max_files=40)
    write_corpus_jsonl(corpus, "train", max_files=60)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    rows = []
    for line in corpus.read_text().splitlines():
        ids = tok(json.loads(line)["text"])["input_ids"][:200]
        if len(ids) > 40:
            rows.append({"input_ids": ids, "prompt_len": 20})
    sft.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tok_dir, corpus, sft


def digest(work: Path) -> dict:
    from draftforge.recipe import load_recipe
    from draftforge.train import run

    tok_dir, corpus, sft = build_inputs(work)
    common = [f"model.tokenizer={tok_dir}", "model.target=null", "train.trackers=[]", "train.block_size=64",
              "train.log_every=1", "train.global_batch_size=8",
              "train.precision=fp32"]  # the bitwise proof is fp32's (auto is bf16 autocast where native)
    pre = load_recipe("recipes/tiny/pretrain.yaml", common + [
        f"output_dir={work / 'pre'}", f"data.sources=[{corpus}]", "train.max_steps=12", "train.save_every=6",
        "train.eval_every=6", "train.micro_batch_size=4"])
    r1 = run(pre, overwrite=True)
    tuned = load_recipe("recipes/tiny/sft.yaml", common + [
        f"output_dir={work / 'sft'}", f"model.init_from={work / 'pre'}", f"data.sources=[{sft}]",
        "train.max_steps=8", "train.save_every=4", "train.eval_every=4", "train.micro_batch_size=2"])
    r2 = run(tuned, overwrite=True)

    def sha(p: Path) -> str:
        return hashlib.sha256(p.read_bytes()).hexdigest()

    return {"pretrain_losses": r1.losses, "pretrain_eval": r1.eval_loss, "sft_losses": r2.losses,
            "sft_eval": r2.eval_loss, "pretrain_metrics": (work / "pre" / "metrics.jsonl").read_text(),
            "sft_metrics": (work / "sft" / "metrics.jsonl").read_text(),
            "pretrain_weights": sha(work / "pre" / "export" / "model.safetensors"),
            "sft_weights": sha(work / "sft" / "export" / "model.safetensors")}


def compare(a_path: str, b_path: str) -> int:
    a, b = json.loads(Path(a_path).read_text()), json.loads(Path(b_path).read_text())
    print("| item | result |\n|---|---|")
    same = True
    for key in a:
        if a[key] == b.get(key):
            print(f"| {key} | bitwise identical |")
            continue
        same = False
        if isinstance(a[key], list):
            rel = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a[key], b[key]))
            print(f"| {key} | differs, max relative difference {rel:.2e} |")
        elif isinstance(a[key], float):
            print(f"| {key} | differs: {a[key]!r} vs {b[key]!r} |")
        else:
            print(f"| {key} | differs |")
    return 0 if same else 1


def write(out: str) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        result = digest(Path(tmp))
    Path(out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if "metrics" not in k}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(digest_cli(__doc__, write, compare))
