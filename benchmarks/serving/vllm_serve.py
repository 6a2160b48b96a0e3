"""vLLM's side of benchmarks/serving/vllm_compare.py: runs INSIDE the vLLM environment (benchmarks/serving/
setup_vllm.sh builds it; nothing of draftforge is imported here), serves one target with each speculative setting
one prompt at a time, and writes what it generated and vLLM's own speculative counters as JSON.

    $VLLM_PYTHON benchmarks/serving/vllm_serve.py --target DIR --prompts ids.json --out vllm.json \
        --setting plain --setting ngram:3 --setting draft:DRAFTER_DIR:3

A setting is `plain`, `ngram:K` (prompt lookup, K speculative tokens), `draft:DIR:K` (a Transformer draft model),
`mamba:DIR:K` (a Mamba / Mamba2 drafter through benchmarks/serving/mamba_proposer.py) or `eagle3:DIR:K` (an EAGLE-3
export, vLLM's own "eagle3" method reading the speculators checkpoint). Each runs in a fresh engine (enforce_eager,
VLLM_CPU_KVCACHE_SPACE=2 unless set), greedy, one warm-up prompt, then every prompt alone; tokens/s over the timed
prompts; acceptance length = 1 + accepted draft tokens / drafts, and the acceptance rate at each draft position
(accepted at position j / drafts), from vLLM's counters.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def parse_setting(text: str) -> tuple[str, dict | None]:
    kind, *rest = text.split(":")
    if kind == "plain" and not rest:
        return "plain", None
    if kind == "ngram" and len(rest) == 1:
        return f"ngram-{rest[0]}", {"method": "ngram", "num_speculative_tokens": int(rest[0]),
                                    "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    if kind == "draft" and len(rest) == 2:
        # method named: a relative directory such as drafter.v1 would read as a proposer class path to vLLM
        return f"draft-{rest[1]}", {"model": rest[0], "method": "draft_model", "num_speculative_tokens": int(rest[1])}
    if kind == "eagle3" and len(rest) == 2:  # a speculators-format EAGLE-3 checkpoint (models/eagle3_export.py)
        return f"eagle3-{rest[1]}", {"model": rest[0], "method": "eagle3", "num_speculative_tokens": int(rest[1])}
    if kind == "mamba" and len(rest) == 2:  # a draftforge Mamba drafter through vLLM's custom_class proposer
        os.environ["DRAFTFORGE_MAMBA_DRAFTER"] = rest[0]  # read by the proposer in vLLM's worker process
        return f"mamba-{rest[1]}", {"method": "custom_class", "num_speculative_tokens": int(rest[1]),
                                    "model": "benchmarks.serving.mamba_proposer.MambaProposer"}
    raise SystemExit(f"--setting {text!r}: give plain, ngram:K, draft:DIR:K, mamba:DIR:K or eagle3:DIR:K")


def counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_pos"] = list(getattr(m, "values", None) or [])
        elif m.name.startswith("vllm:spec_decode_num_"):
            out[m.name.removeprefix("vllm:spec_decode_")] = getattr(m, "value", None)
    return out


def difference(after: dict, before: dict) -> dict:
    """The counters' growth over the timed prompts (per-position counts element by element)."""
    out = {}
    for key, value in after.items():
        if isinstance(value, list):
            old = before.get(key) or []
            out[key] = [v - (old[i] if i < len(old) else 0) for i, v in enumerate(value)]
        else:
            out[key] = (value or 0) - (before.get(key) or 0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    p.add_argument("--setting", action="append", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    names = [parse_setting(text)[0] for text in args.setting]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # results are keyed kind-K: the second would replace the first's
        p.error(f"two settings are both {twice[0]}; serve them in two runs (--out each)")
    # vLLM's worker imports the Mamba proposer as benchmarks.serving.mamba_proposer: the repository root on its path
    # (run as a script, this file's own folder is on sys.path, not the root)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (root, os.environ.get("PYTHONPATH")) if x)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    prompts = json.load(open(args.prompts))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    results = {}
    for text in args.setting:
        name, spec = parse_setting(text)
        llm = LLM(model=args.target, dtype=args.dtype, enforce_eager=True, speculative_config=spec,
                  disable_log_stats=False)
        llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm-up
        before = counters(llm)
        tokens, seconds, per_prompt, last = [], 0.0, [], before
        for ids in prompts:
            t0 = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
            seconds += time.perf_counter() - t0
            tokens.append(list(out[0].outputs[0].token_ids))
            now = counters(llm)
            per_prompt.append(difference(now, last))  # one prompt at a time: its own drafts and acceptances
            last = now
        after = counters(llm)
        spec_counts = difference(after, before)
        drafts, accepted = spec_counts.get("num_drafts") or 0, spec_counts.get("num_accepted_tokens") or 0
        results[name] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": sum(map(len, tokens)) / seconds,
                         "spec": spec_counts, "spec_per_prompt": per_prompt if spec else None,
                         "acceptance_length": 1 + accepted / drafts if drafts else None,
                         "acceptance_per_pos": [a / drafts for a in spec_counts.get("accepted_per_pos", [])]
                         if drafts else None}
        print(f"{name}: {results[name]['tokens_per_s']:.1f} tok/s, acceptance length "
              f"{results[name]['acceptance_length']}", flush=True)
        del llm
    json.dump({"target": args.target, "dtype": args.dtype, "results": results}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
