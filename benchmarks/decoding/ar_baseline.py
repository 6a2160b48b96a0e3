"""Is the harness's AR a fair baseline? Its tokens/s against transformers' own greedy `generate()`, per dtype.

    python -m benchmarks.decoding.ar_baseline --target ~/.cache/draftforge/smollm2 --bench instructions \
        --dtype bfloat16 --dtype float32 --num-prompts 4 --max-new-tokens 128 --repeats 3

Same prompts, same number of new tokens (EOS ignored), 1 torch thread unless --threads; every (dtype,
decoder) pair is timed once per repeat in a rotating order after one untimed prompt; medians over repeats.
Prints the table and writes JSON: harness/generate per dtype (a fair baseline is >= 0.95) and, with
several dtypes, each dtype's AR against the first one's. Greedy tokens are compared too (harness = generate).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import add_flags, parse_timed, print_table, write_json


def hf_generate(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    # EOS ignored as the harness ignores it (eos_token_id=[]): min_new_tokens would instead forbid EOS, another
    # greedy path wherever the model's argmax is EOS, and one more logits processor to time
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, eos_token_id=[], do_sample=False,
                         pad_token_id=0)
    return out[0, len(ids):].tolist()


def main(argv=None) -> dict:
    from draftforge.decode import build_decoder, load_target
    from draftforge.data.prompts import load_prompts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--bench", default="instructions")
    p.add_argument("--dtype", action="append", choices=["float32", "bfloat16", "float16"])
    add_flags(p, num_prompts=4, max_new_tokens=128, repeats=3)
    p.add_argument("--out", default="runs/bench/ar_baseline.json")
    args = parse_timed(p, argv)
    dtypes = args.dtype or ["bfloat16"]
    targets = {d: load_target(args.target, dtype=getattr(torch, d)) for d in dtypes}
    prompts = load_prompts(args.bench, targets[dtypes[0]].tokenizer, num_prompts=args.num_prompts)
    ids = [list(pr.input_ids) for pr in prompts]
    n = args.max_new_tokens
    runners = {}
    for d, target in targets.items():
        ar = build_decoder("ar", target)
        runners[(d, "harness")] = lambda x, ar=ar: ar.generate(x, max_new_tokens=n, eos_token_id=[]).tokens
        runners[(d, "generate")] = lambda x, m=target.model: hf_generate(m, x, n)
    secs = {k: [] for k in runners}
    tokens = {}
    keys = list(runners)
    for k in keys:  # warm-up
        runners[k](ids[0])
    for rep in range(args.repeats):
        for k in keys[rep % len(keys):] + keys[: rep % len(keys)]:
            t0 = time.perf_counter()
            tokens[k] = [runners[k](x) for x in ids]
            secs[k].append(time.perf_counter() - t0)
            print(f"repeat {rep + 1}/{args.repeats} {k[0]} {k[1]}: {len(ids) * n / secs[k][-1]:.1f} tok/s", flush=True)
    tps = {k: len(ids) * n / statistics.median(v) for k, v in secs.items()}
    rows, result = [], {"config": vars(args), "threads": torch.get_num_threads(), "tokens_per_s": {}, "ratios": {}}
    base = tps[(dtypes[0], "harness")]
    for d in dtypes:
        ratio = tps[(d, "harness")] / tps[(d, "generate")]
        same = sum(a == b for a, b in zip(tokens[(d, "harness")], tokens[(d, "generate")]))
        result["tokens_per_s"][d] = {"harness": tps[(d, "harness")], "generate": tps[(d, "generate")]}
        result["ratios"][d] = {"harness_over_generate": ratio, "ar_over_first_dtype": tps[(d, "harness")] / base,
                               "identical_prompts": same}
        rows.append([d, f"{tps[(d, 'harness')]:.1f}", f"{tps[(d, 'generate')]:.1f}", f"{ratio:.3f}",
                     f"{tps[(d, 'harness')] / base:.2f}", f"{same}/{len(ids)}"])
    print_table(["dtype", "harness AR tok/s", "generate() tok/s", "harness / generate",
                 f"AR vs {dtypes[0]}", "same tokens"], rows)
    return write_json(args.out, result)


if __name__ == "__main__":
    main()
