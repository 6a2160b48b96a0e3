"""Loss-curve digest of tiny pretrain, sft, distill, eesd and eagle3 runs: the proof a refactor moved nothing.

Runs recipes/tiny/pretrain.yaml then recipes/tiny/sft.yaml, then recipes/tiny/distill.yaml twice (the teacher
on the fly, then on a logits cache harvested here), an eesd run and an eagle3 head, all shortened, on a small
stdlib corpus, tokenizer and random Llama target this script builds, fp32 on CPU with 1 thread. It writes every
logged loss, the eval losses, metrics.jsonl (train and eval metrics, distill's acceptance among them), and of each
export every file's sha256 plus its JSON files (draftforge.json with distill's held-out acceptance, config.json) with
the run's temporary path and creation time taken out. Run it on two checkouts and compare:

    python -m benchmarks.regression.loss_digest --out /tmp/new.json
    cp benchmarks/regression/loss_digest.py /tmp/loss_digest.py
    (cd OLD_CHECKOUT && PYTHONPATH=.:NEW_CHECKOUT python /tmp/loss_digest.py --out /tmp/old.json)
    python -m benchmarks.regression.loss_digest --compare /tmp/old.json /tmp/new.json

In the old checkout its own `draftforge` trains (the script prints which one it imported); run this file by
path there, since `-m` would pick an older checkout's own, shorter digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.common import digest_cli, read_digest, write_digest


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

    out = {"pretrain_losses": r1.losses, "pretrain_eval": r1.eval_loss, "sft_losses": r2.losses,
           "sft_eval": r2.eval_loss, "pretrain_metrics": (work / "pre" / "metrics.jsonl").read_text(),
           "sft_metrics": (work / "sft" / "metrics.jsonl").read_text(),
           "pretrain_weights": sha(work / "pre" / "export" / "model.safetensors"),
           "sft_weights": sha(work / "sft" / "export" / "model.safetensors")}
    out.update(distill_and_eesd(work, tok_dir, corpus, common))
    return out


def save_target(path: Path, tok_dir: Path) -> Path:
    """A seeded random 4-layer Llama over the tokenizer's vocabulary, saved with it (teacher and eesd target)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # a peaky teacher, so a top-8 cache leaves a tail that matters
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def short_rows(corpus: Path, tok_dir: Path, out: Path, n: int = 48) -> Path:
    """Token rows of 40-60 ids (one per 64-token block), a loss after a 6-token prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    rows = []
    for i, line in enumerate(corpus.read_text().splitlines()):
        ids = tok(json.loads(line)["text"])["input_ids"]
        if len(ids) >= 60:
            rows.append({"input_ids": ids[:40 + i % 21], "prompt_len": 6})
    out.write_text("".join(json.dumps(r) + "\n" for r in rows[:n]))
    return out


def export_digest(export: Path, work: Path) -> dict:
    """{file: sha256} of an export, and its JSON files with the temporary path, the creation time and the export's
    random export_id (in draftforge.json and custom_generate/generate.py) taken out."""
    hashes, docs = {}, {}
    meta = export / "draftforge.json"
    export_id = json.loads(meta.read_text()).get("export_id") if meta.is_file() else None
    for f in sorted(p for p in export.rglob("*") if p.is_file()):
        name = str(f.relative_to(export))
        text = f.read_bytes().replace(str(work).encode(), b"<work>").replace(str(work.resolve()).encode(), b"<work>")
        if export_id:
            text = text.replace(export_id.encode(), b"<export_id>")
        if f.suffix == ".json" and f.name.startswith(("draftforge", "config")):
            record = json.loads(text)
            record.pop("created", None)
            docs[name] = json.dumps(record, sort_keys=True)
            text = docs[name].encode()
        hashes[name] = hashlib.sha256(text).hexdigest()
    return {"files": json.dumps(hashes, sort_keys=True), **{f"json {k}": v for k, v in docs.items()}}


def distill_and_eesd(work: Path, tok_dir: Path, corpus: Path, common: list[str]) -> dict:
    """distill on the fly, distill on a logits cache (exporting its best eval's weights), eesd and an eagle3 head,
    on one tiny random target."""
    from draftforge.data.harvest_logits import harvest_logits
    from draftforge.recipe import load_recipe, recipe_from_dict
    from draftforge.train import run

    target = save_target(work / "target", tok_dir)
    rows = short_rows(corpus, tok_dir, work / "rows.jsonl")
    small = ["model.overrides={hidden_size: 32, num_hidden_layers: 2, head_dim: 16, state_size: 8}"]
    steps = ["train.max_steps=8", "train.save_every=8", "train.eval_every=4", "train.micro_batch_size=4",
             "train.eval_batches=3", "data.eval_fraction=0.2", f"model.target={target}"]
    fly = load_recipe("recipes/tiny/distill.yaml", common + small + steps + [
        f"output_dir={work / 'distill'}", f"data.sources=[{corpus}]"])
    runs = {"distill": run(fly, overwrite=True)}
    harvest_logits(str(target), str(rows), str(work / "cache"), top_k=8, max_len=64, batch_size=4, shard_rows=16,
                   dtype="float32", progress=False)
    cached = load_recipe("recipes/tiny/distill.yaml", common + small + steps + [
        f"output_dir={work / 'distill_cached'}", f"data.sources=[{rows}]", "data.format=tokens",
        f"distill.logits_cache={work / 'cache'}", "distill.loss=mix", "distill.temperature=1.0",
        "train.keep_best=tvd"])  # lowest TVD (before 5e855ce: highest, so step 4's weights were exported)
    runs["distill_cached"] = run(cached, overwrite=True)
    eesd = recipe_from_dict({
        "task": "eesd", "output_dir": str(work / "eesd"), "model": {"target": str(target), "tokenizer": str(tok_dir)},
        "data": {"sources": [str(rows)], "format": "tokens", "eval_fraction": 0.2},
        "eesd": {"exit_after_layer": 2, "open_sources": [str(corpus)]},
        "optim": {"lr": 3e-3, "warmup_steps": 0, "weight_decay": 0.0},
        "train": {"max_steps": 8, "global_batch_size": 8, "micro_batch_size": 4, "block_size": 64, "eval_every": 4,
                  "save_every": 8, "log_every": 1, "eval_batches": 3, "trackers": [], "precision": "fp32"}})
    runs["eesd"] = run(eesd, overwrite=True)
    eagle3 = recipe_from_dict({  # a reduced draft vocabulary, so the loss reads the teacher at the draft ids
        "task": "eagle3", "output_dir": str(work / "eagle3"),
        "model": {"target": str(target), "tokenizer": str(tok_dir), "draft_vocab": 64, "draft_vocab_from": str(rows)},
        "data": {"sources": [str(rows)], "format": "tokens", "eval_fraction": 0.2},
        "eagle3": {"steps": 3, "loss": "mix"},
        "optim": {"lr": 3e-3, "warmup_steps": 0, "weight_decay": 0.0},
        "train": {"max_steps": 6, "global_batch_size": 8, "micro_batch_size": 4, "block_size": 64, "eval_every": 3,
                  "save_every": 6, "log_every": 1, "eval_batches": 3, "trackers": [], "precision": "fp32"}})
    runs["eagle3"] = run(eagle3, overwrite=True)
    out = {}
    for name, r in runs.items():
        out.update({f"{name}_losses": r.losses, f"{name}_eval": r.eval_loss,
                    f"{name}_metrics": (work / name / "metrics.jsonl").read_text()})
        out.update({f"{name}_export {k}": v for k, v in export_digest(work / name / "export", work).items()})
    return out


def compare(a_path: str, b_path: str) -> int:
    a, b = (read_digest(x) for x in (a_path, b_path))
    print("| item | result |\n|---|---|")
    same = bool(a)  # a digest of nothing proves nothing
    for key in a:
        if key not in b:
            print(f"| {key} | missing from {b_path} |")
            same = False
            continue
        if a[key] == b[key]:
            print(f"| {key} | bitwise identical |")
            continue
        same = False
        x, y = a[key], b[key]
        if isinstance(x, list) and isinstance(y, list) and len(x) != len(y):
            print(f"| {key} | differs: {len(x)} values vs {len(y)} |")
        elif isinstance(x, list) and isinstance(y, list) and all(isinstance(v, (int, float)) for v in x + y):
            rel = max(abs(u - v) / max(abs(u), 1e-12) for u, v in zip(x, y))
            print(f"| {key} | differs, max relative difference {rel:.2e} |")
        elif isinstance(x, float) and isinstance(y, float):
            print(f"| {key} | differs: {x!r} vs {y!r} |")
        else:
            print(f"| {key} | differs |")
    for key in (k for k in b if k not in a):
        print(f"| {key} | only in {b_path} (added since, not compared) |")
    if not a:
        print(f"{a_path} holds no items: nothing was compared")
    return 0 if same else 1


def write(out: str) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    import draftforge

    print(f"[loss_digest] draftforge from {draftforge.__file__}", file=sys.stderr)  # which checkout trains
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        result = digest(Path(tmp))
    write_digest(out, result, indent=1)
    print(json.dumps({k: v for k, v in result.items() if "metrics" not in k}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(digest_cli(__doc__, write, compare))
