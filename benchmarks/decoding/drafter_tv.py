"""Why does one drafter accept less than another at T>0? Total variation between q and p, per position.

At temperature T, speculative sampling accepts a drafted token with probability 1 - TV(p, q)
(Leviathan et al. 2023, Thm 3.5), where p is the target's and q the drafter's distribution after
the same warping. For each prompt the target *samples* a continuation at T; both models then read
prompt + continuation teacher-forced and we report, over continuation positions: mean α = 1 - TV,
top-1 agreement, entropies H(p), H(q), and the drafter temperature scale s that would minimise TV
(q ∝ softmax(logits / (s·T)); s < 1 = the drafter is under-confident). Chain τ from mean α uses
(1 - α^(γ+1)) / (1 - α) (Leviathan et al. 2023, Eq. 1). "top-1 greedy" is the same agreement along the target's
*greedy* continuation of the same prompts: the contexts a T = 0 decode drafts in (one draft's greedy acceptance).

Both models run at --dtype (default auto: bf16 where the CPU computes it natively, as `draftforge eval` runs
them; `--dtype float32` for the tables measured before the flag existed). It also checks the harness: the Mamba
drafter's q from its decode path (lean single-token step after a multi-token prompt encode) must equal q from one
full forward over the same tokens.

    python -m benchmarks.decoding.drafter_tv --target /tmp/h1dl/cache/smollm2 --drafter runs/smollm2/mamba2-sft/export \
        --drafter runs/smollm2/llama-sft/export --bench instructions --num-prompts 8 --temperature 1
Legend: T = positions, V = target vocab.
"""

from __future__ import annotations


import torch

from benchmarks.common import (add_dtype_flag, add_flags, checked_args, chosen_dtype, drafters_parser, print_drafters,
                               write_json)

SCALES = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0)


def entropy(probs_TV: torch.Tensor) -> torch.Tensor:
    return -(probs_TV * probs_TV.clamp_min(1e-30).log()).sum(-1)


def tv(p_TV: torch.Tensor, q_TV: torch.Tensor) -> torch.Tensor:
    return 0.5 * (p_TV - q_TV).abs().sum(-1)


@torch.inference_mode()
def drafter_logits(drafter, seq: list[int], start: int) -> torch.Tensor:
    """Drafter logits over the target vocab predicting seq[start:], one full forward."""
    from draftforge.decode.sampling import match_vocab

    logits_TV = drafter.model(input_ids=torch.tensor([seq])).logits[0, start - 1: -1].float()
    return match_vocab(logits_TV, drafter.vocab_size, drafter.d2t)


@torch.inference_mode()
def stepped_logits(drafter, seq: list[int], start: int) -> torch.Tensor | None:
    """The same logits through the harness's decode path (Mamba: prompt encode + lean steps)."""
    from draftforge.decode.sampling import match_vocab

    if not hasattr(drafter, "_sync"):
        return None
    drafter.reset()
    rows = [drafter._sync(seq[:i]).float() for i in range(start, len(seq))]
    return match_vocab(torch.stack(rows), drafter.vocab_size, drafter.d2t)


def position_stats(p_TV, logits_TV, temperature: float) -> dict:
    q_TV = (logits_TV / temperature).softmax(-1)
    by_scale = {s: float((1 - tv(p_TV, (logits_TV / (s * temperature)).softmax(-1))).mean()) for s in SCALES}
    best = max(by_scale, key=by_scale.get)
    return {"alpha": float((1 - tv(p_TV, q_TV)).mean()), "top1": float((p_TV.argmax(-1) == q_TV.argmax(-1)).float().mean()),
            "H_p": float(entropy(p_TV).mean()), "H_q": float(entropy(q_TV).mean()),
            "best_scale": best, "alpha_at_best_scale": by_scale[best], "alpha_by_scale": by_scale}


def run(target_dir, drafter_dirs, bench, num_prompts, max_new_tokens, temperature, gamma, seed=0, dtype=None) -> dict:
    """dtype: the torch dtype both models run in (None: each checkpoint's own)."""
    from draftforge.decode.loading import load_drafter, load_target
    from draftforge.data.prompts import load_prompts

    target = load_target(target_dir, dtype=dtype)
    tok = target.tokenizer
    prompts = [p.input_ids for p in load_prompts(bench, tok, num_prompts=num_prompts)]
    torch.manual_seed(seed)
    seqs, pad = [], getattr(tok, "pad_token_id", None)  # no tokenizer: prompts given as ids
    with torch.inference_mode():
        for ids in prompts:
            out = target.model.generate(torch.tensor([ids]), do_sample=True, temperature=temperature, top_k=0,
                                        top_p=1.0, max_new_tokens=max_new_tokens, pad_token_id=pad)
            seqs.append(out[0].tolist())
        p_rows = [(target.model(input_ids=torch.tensor([s])).logits[0, len(ids) - 1: -1].float() / temperature)
                  .softmax(-1) for ids, s in zip(prompts, seqs)]
        greedy = [target.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens,
                                        pad_token_id=pad)[0].tolist() for ids in prompts]
    p_TV = torch.cat(p_rows)
    result = {"target": target_dir, "bench": bench, "num_prompts": len(prompts), "positions": p_TV.shape[0],
              "dtype": str(target.model.dtype).removeprefix("torch."),
              "temperature": temperature, "gamma": gamma, "drafters": {}}
    for d in drafter_dirs:
        drafter = load_drafter(d, target, dtype=dtype)
        logits_TV = torch.cat([drafter_logits(drafter, s, len(ids)) for ids, s in zip(prompts, seqs)])
        stats = position_stats(p_TV, logits_TV, temperature)
        hits = [(drafter_logits(drafter, s, len(ids)).argmax(-1) == torch.tensor(s[len(ids):])).float()
                for ids, s in zip(prompts, greedy)]
        stats["top1_greedy"] = float(torch.cat(hits).mean())
        a = stats["alpha"]
        stats["chain_tau_from_alpha"] = (1 - a ** (gamma + 1)) / (1 - a) if a < 1 else gamma + 1.0
        stepped = [stepped_logits(drafter, s, len(ids)) for ids, s in zip(prompts[:2], seqs[:2])]
        if stepped[0] is not None:
            full = [drafter_logits(drafter, s, len(ids)) for ids, s in zip(prompts[:2], seqs[:2])]
            stats["decode_path_max_abs_logit_diff"] = max(float((x - y).abs().nan_to_num(0.0, 0.0, 0.0).max())
                                                          for x, y in zip(stepped, full))
        result["drafters"][d] = stats
    return result


def main(argv=None) -> dict:
    p = drafters_parser(__doc__, bench="instructions", num_prompts=8)
    add_flags(p, temperature=1.0)
    p.add_argument("--chain-length", type=int, default=5, help="γ for the τ estimate")
    p.add_argument("--out", default="benchmarks/results/drafter_tv.json")
    add_dtype_flag(p)
    a = checked_args(p, argv)
    if a.temperature <= 0:
        p.error("--temperature must be > 0 (TV between distributions)")
    result = run(a.target, a.drafter, a.bench, a.num_prompts, a.max_new_tokens, a.temperature, a.chain_length,
                 dtype=chosen_dtype(a))
    print(f"{result['num_prompts']} prompts, {result['positions']} sampled target positions at T={a.temperature}")
    print_drafters(result, ["α=1-TV", "top-1", "top-1 greedy", "H(p)", "H(q)", "best s", "α at best s",
                            f"τ(γ={a.chain_length})", "decode-path Δlogit"],
                   lambda s: [f"{s['alpha']:.3f}", f"{s['top1']:.3f}", f"{s['top1_greedy']:.3f}", f"{s['H_p']:.2f}",
                              f"{s['H_q']:.2f}", f"{s['best_scale']:.2f}", f"{s['alpha_at_best_scale']:.3f}",
                              f"{s['chain_tau_from_alpha']:.2f}",
                              f"{s.get('decode_path_max_abs_logit_diff', float('nan')):.1e}"])
    return write_json(a.out, result)


if __name__ == "__main__":
    main()
