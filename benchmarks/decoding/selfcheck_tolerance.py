"""How far correct computations of a target's logits stray from float32: the numbers behind the self-check's
ceiling (draftforge/eval/selfcheck.py, CEILING_STEPS).

    python -m benchmarks.decoding.selfcheck_tolerance --target ~/.cache/draftforge/smollm2 --bench instructions \
        --num-prompts 4 --max-new-tokens 64 --every 8

For each prompt, AR's greedy text is generated in the run's dtype; at every `--every`-th position the prefix goes
through the self-check's evidence: the fp32 reference r (the model's own forward on a float32 copy), the model's
own forward in the run dtype (one-shot and cached step: the "noise"), and the harness's AR row and multi-row
verifications (rows 1, 2, 4, 8 and the whole prefix). Each distance is reported in rounding steps of the dtype at
the logits' scale (2 eps max |r|), so the ceiling can be read against them. `--break-state` drops the SSM state
in the hybrid tree forward (what transformers 5.24's rename did) to show where a wrong harness lands.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.common import add_dtype_flag, add_flags, chosen_dtype, parse_timed, print_table, write_json


def main(argv=None) -> dict:
    from draftforge.data.prompts import load_prompts
    from draftforge.decode import build_decoder, load_target
    from draftforge.eval import selfcheck

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--bench", default="instructions")
    p.add_argument("--every", type=int, default=8, help="probe every N-th generated position (default 8)")
    p.add_argument("--break-state", action="store_true",
                   help="hybrid/SSM targets: the tree forward reads no SSM state (the bug the ceiling must catch)")
    add_dtype_flag(p)
    add_flags(p, num_prompts=4, max_new_tokens=64)
    p.add_argument("--out", default="runs/bench/selfcheck_tolerance.json")
    args = parse_timed(p, argv)
    dtype = chosen_dtype(args)
    target = load_target(args.target, dtype=dtype)
    if args.break_state:
        from draftforge.decode.targets import hybrid as hybrid_target

        hybrid_target.cache_states = lambda cache, layer_idx: (None, None)
    prompts = load_prompts(args.bench, target.tokenizer, num_prompts=args.num_prompts)
    ar = build_decoder("ar", target)
    rows, samples = [], {"noise": [], "harness": []}
    for prompt in prompts:
        ids = list(prompt.input_ids)
        gen = ar.generate(ids, max_new_tokens=args.max_new_tokens).tokens
        for i in range(0, len(gen), args.every):
            prefix = ids + gen[:i]
            ref = selfcheck.reference(target, prefix)
            step = ref["ceiling"] / selfcheck.CEILING_STEPS  # the ceiling's unit (float16's step in fp32)
            harness = [selfcheck.ar_logits(target, ids, gen[:i])] + [
                selfcheck.logits_after(target, prefix, n) for n in (2, 4, 8, len(prefix))]
            dev = max(float((x - ref["r_V"]).abs().max()) for x in harness)
            samples["noise"].append(ref["noise"] / step)
            samples["harness"].append(dev / step)
            rows.append({"prompt_id": prompt.prompt_id, "position": i, "max_abs_r": float(ref["r_V"].abs().max()),
                         "noise": ref["noise"], "harness_deviation": dev, "step": step})
    summary = {k: {"median_steps": statistics.median(v), "max_steps": max(v)} for k, v in samples.items()}
    print(f"{args.target} in {dtype}: {len(rows)} positions over {len(prompts)} prompts; "
          f"ceiling = {selfcheck.CEILING_STEPS} steps" + (" (SSM state dropped)" if args.break_state else ""))
    print_table(["distance from fp32", "median (steps)", "max (steps)"],
                [[k, f"{s['median_steps']:.2f}", f"{s['max_steps']:.2f}"] for k, s in summary.items()], {1, 2})
    result = {"target": args.target, "dtype": str(dtype), "ceiling_steps": selfcheck.CEILING_STEPS,
              "break_state": args.break_state, "summary": summary, "positions": rows}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
