"""Self-distillation rows for task `eesd` from a chat target: its own greedy answers to prompts (EESD §3.2).

A stand-in until `draftforge generate` lands: batched greedy `model.generate` (left padding), output as
`format: tokens` rows {"input_ids": prompt + answer, "prompt_len": n} (loss on the answer only).
Resumable: prompts already in --out are skipped.

    python -m benchmarks.pipelines.eesd_selfdistill --target DIR --prompts train.jsonl --out rows.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.common import add_flags


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="HF directory of the (chat) target")
    p.add_argument("--prompts", required=True, help="JSONL of {prompt_id, messages} (draftforge target prompts)")
    p.add_argument("--out", required=True, help="token-row JSONL to append to")
    add_flags(p, max_new_tokens=128, batch_size=16)
    p.add_argument("-n", type=int, default=None, help="at most this many prompts")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from draftforge.loading import load_causal_lm

    tok = AutoTokenizer.from_pretrained(args.target)
    tok.padding_side = "left"
    model = load_causal_lm(args.target, what="target", dtype=torch.float32).eval()
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()][: args.n]
    out = Path(args.out)
    done = {json.loads(line).get("prompt_id") for line in out.read_text().splitlines()} if out.exists() else set()
    todo = [r for r in rows if r["prompt_id"] not in done]
    print(f"[selfdistill] {len(todo)} of {len(rows)} prompts to answer ({len(done)} done)", flush=True)
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    t0, n_tokens = time.perf_counter(), 0
    with out.open("a") as f:
        for i in range(0, len(todo), args.batch_size):
            batch = todo[i : i + args.batch_size]
            prompts = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False) for r in batch]
            enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.inference_mode():
                gen = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False,
                                     pad_token_id=tok.pad_token_id or 0)
            width = enc["input_ids"].shape[1]
            for r, ids, mask, new in zip(batch, enc["input_ids"], enc["attention_mask"], gen[:, width:]):
                prompt = ids[mask.bool()].tolist()
                answer = new.tolist()
                cut = next((j for j, t in enumerate(answer) if t in eos), None)
                answer = answer[: cut + 1] if cut is not None else answer
                n_tokens += len(answer)
                f.write(json.dumps({"prompt_id": r["prompt_id"], "input_ids": prompt + answer,
                                    "prompt_len": len(prompt)}) + "\n")
            f.flush()
            rate = n_tokens / (time.perf_counter() - t0)
            print(f"[selfdistill] {min(i + args.batch_size, len(todo))}/{len(todo)} prompts, {n_tokens:,} answer "
                  f"tokens, {rate:.0f} tok/s", flush=True)
    print(f"[selfdistill] done: {out}", flush=True)


if __name__ == "__main__":
    main()
