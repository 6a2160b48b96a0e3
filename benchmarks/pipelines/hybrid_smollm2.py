"""A hybrid target from SmolLM2 (MambaInLlama style): convert, then measure how close it is to SmolLM2.

    python -m benchmarks.pipelines.hybrid_smollm2 convert --share 0.1 --out runs/hybrid/smollm2-init
    draftforge train recipes/hybrid/smollm2_hybrid.yaml            # KL distillation of the new mixers
    python -m benchmarks.pipelines.hybrid_smollm2 compare runs/hybrid/smollm2-init runs/hybrid/smollm2/export

`compare` reports, on held-out text (files of the stdlib not in the training corpus) and prompts: the
mean per-token KL(SmolLM2 ‖ hybrid), top-1 agreement, and greedy continuations' agreement (tokens equal
before the first divergence). Progress on stderr, a JSON summary on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

import torch

from draftforge.smollm2 import smollm2_dir

TRAIN_FILES = 48  # the first N stdlib .py files (sorted) make the training corpus; the next ones are held out


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if 2_000 < p.stat().st_size < 60_000)


def write_corpus(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for i, path in enumerate(stdlib_files()[:TRAIN_FILES]):
        (out / f"{i:03d}_{path.name}").write_text(path.read_text(errors="replace"))
    return out


def convert(args) -> dict:
    from transformers import AutoTokenizer

    from draftforge.loading import load_causal_lm
    from draftforge.models.hybrid_from_llama import every_other, llama_to_hybrid

    llama = load_causal_lm(args.smollm2, what="SmolLM2").eval()
    layers = every_other(llama.config.num_hidden_layers, args.share)
    print(f"replacing {len(layers)} of {llama.config.num_hidden_layers} attention layers: {layers}", file=sys.stderr)
    hybrid = llama_to_hybrid(llama, layers)
    hybrid.save_pretrained(args.out)
    AutoTokenizer.from_pretrained(args.smollm2).save_pretrained(args.out)
    write_corpus(Path(args.corpus))
    return {"out": args.out, "mamba_layers": layers, "corpus": args.corpus}


@torch.no_grad()
def closeness(teacher, student, blocks, prompts, new_tokens: int) -> dict:
    kl_sum = agree = n = 0
    for ids in blocks:
        t_logp = teacher(ids).logits.float().log_softmax(-1)
        s_logp = student(ids).logits.float().log_softmax(-1)
        kl_sum += float((t_logp.exp() * (t_logp - s_logp)).sum())
        agree += int((t_logp.argmax(-1) == s_logp.argmax(-1)).sum())
        n += ids.numel()
    prefix = []
    for ids in prompts:
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
        a = teacher.generate(ids, **kw)[0, ids.shape[1]:].tolist()
        b = student.generate(ids, **kw)[0, ids.shape[1]:].tolist()
        prefix.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return {"kl_per_token": kl_sum / n, "top1_agreement": agree / n, "greedy_equal_prefix_mean": sum(prefix) / len(prefix),
            "greedy_equal_prefix": prefix}


def compare(args) -> dict:
    from transformers import AutoTokenizer

    from draftforge.loading import load_causal_lm

    tok = AutoTokenizer.from_pretrained(args.smollm2)
    teacher = load_causal_lm(args.smollm2, what="SmolLM2").eval()
    held = stdlib_files()[TRAIN_FILES : TRAIN_FILES + args.blocks]
    blocks = [tok(p.read_text(errors="replace"), return_tensors="pt").input_ids[:, : args.block_size] for p in held]
    prompts = [tok(p.read_text(errors="replace")[:400], return_tensors="pt").input_ids for p in held[: args.prompts]]
    out = {"held_out_files": [p.name for p in held], "block_size": args.block_size}
    for path in args.hybrids:
        t0 = time.perf_counter()
        student = load_causal_lm(path, what="hybrid").eval()
        out[path] = closeness(teacher, student, blocks, prompts, args.new_tokens)
        print(f"{path}: {out[path]} ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smollm2", default=str(smollm2_dir()),
                   help="converted SmolLM2 directory (default: draftforge target smollm2's, %(default)s)")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="write the attention-initialised hybrid and the training corpus")
    c.add_argument("--share", type=float, default=0.1, help="share of attention layers replaced by Mamba2")
    c.add_argument("--out", default="runs/hybrid/smollm2-init")
    c.add_argument("--corpus", default="runs/hybrid/corpus", help="where the training corpus files go")
    m = sub.add_parser("compare", help="KL, top-1 and greedy agreement of hybrids against SmolLM2")
    m.add_argument("hybrids", nargs="+")
    m.add_argument("--blocks", type=int, default=8, help="held-out files, one block each")
    m.add_argument("--block-size", type=int, default=256)
    m.add_argument("--prompts", type=int, default=4)
    m.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    print(json.dumps(convert(args) if args.cmd == "convert" else compare(args), indent=1))


if __name__ == "__main__":
    main()
