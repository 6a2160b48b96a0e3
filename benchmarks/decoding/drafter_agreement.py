"""How often does a drafter's top-k contain the target's greedy next token, and what chain τ follows?

For each held-out prompt (encoded exactly as `draftforge eval` encodes it) the target greedily
continues it; the drafter then reads prompt + continuation teacher-forced, and at every
continuation position we check whether the target's token is the drafter's top-1 / top-k.
Greedy chain speculation accepts draft token j only if drafts 1..j-1 were accepted, and while
they are, the drafter's context *is* the target's continuation; so the teacher-forced top-1
hits give the exact greedy chain τ (tokens per target forward, bonus counted; Leviathan et
al. 2023 §3) for a chain of length γ without running the harness.

It also counts how many continuations survive decode -> re-tokenize unchanged (the old demo
stored distillation rows as text), which says whether text rows teach ids the target never emits.

    python -m benchmarks.decoding.drafter_agreement --target runs/demo/testbed/target \
        --drafter runs/demo/drafter-sft/export [--drafter other/export ...] --out agreement.json
Legend: T = sequence length, V = vocab.
"""

from __future__ import annotations


import torch

from benchmarks.common import checked_args, drafters_parser, print_drafters, write_json


def chain_tau(hits: list[bool], gamma: int) -> float:
    """Greedy chain τ from per-position top-1 hits: each round accepts the run of hits (<= γ) + 1 token."""
    pos, rounds = 0, 0
    while pos < len(hits):
        run = 0
        while run < gamma and pos + run < len(hits) and hits[pos + run]:
            run += 1
        pos, rounds = pos + run + 1, rounds + 1
    return len(hits) / rounds if rounds else 0.0


@torch.inference_mode()
def target_continuations(target, prompts: list[list[int]], max_new_tokens: int, eos_id) -> list[list[int]]:
    out = []
    for ids in prompts:
        gen = target.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                              pad_token_id=eos_id, eos_token_id=eos_id)
        out.append(gen[0, len(ids):].tolist())
    return out


@torch.inference_mode()
def drafter_agreement(drafter, prompts, continuations, gamma: int, top_ks=(1, 3, 5)) -> dict:
    hits_k = {k: 0 for k in top_ks}
    n, taus = 0, []
    for ids, cont in zip(prompts, continuations):
        seq_T = torch.tensor([ids + cont])
        logits_TV = drafter(input_ids=seq_T).logits[0, len(ids) - 1: -1]  # predicts each continuation token
        want_T = torch.tensor(cont)
        topk_TK = logits_TV.topk(max(top_ks), dim=-1).indices
        for k in top_ks:
            hits_k[k] += int((topk_TK[:, :k] == want_T[:, None]).any(-1).sum())
        taus.append((chain_tau((topk_TK[:, 0] == want_T).tolist(), gamma), len(cont)))
        n += len(cont)
    # τ over all prompts as the harness reports it: total tokens / total rounds.
    rounds = sum(length / tau for tau, length in taus if tau)
    return {"positions": n, **{f"top{k}": hits_k[k] / n for k in top_ks},
            "chain_tau": n / rounds if rounds else 0.0}


def retokenize_stats(tokenizer, prompts, continuations) -> dict:
    """Rows where decode(continuation) re-tokenized after its prompt text gives other ids than the target's.

    Also the share of the commonest continuation token: a weak target repeats itself (e.g. runs of
    "\n"), which makes drafting easy once the drafter has learnt the right ids.
    """
    from collections import Counter

    flat = [t for cont in continuations for t in cont]
    token, count = Counter(flat).most_common(1)[0] if flat else (None, 0)
    changed = 0
    for ids, cont in zip(prompts, continuations):
        text = tokenizer.decode(ids) + tokenizer.decode(cont, skip_special_tokens=True)
        if tokenizer(text, add_special_tokens=False)["input_ids"] != ids + [t for t in cont
                                                                            if t not in tokenizer.all_special_ids]:
            changed += 1
    return {"rows": len(prompts), "retokenized_differently": changed,
            "commonest_token": tokenizer.decode([token]) if token is not None else None,
            "commonest_token_share": count / len(flat) if flat else 0.0}


def run(target_dir: str, drafter_dirs: list[str], bench: str, num_prompts: int, max_new_tokens: int,
        gamma: int) -> dict:
    from transformers import AutoTokenizer

    from draftforge.loading import load_causal_lm
    from draftforge.data.prompts import load_prompts

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = load_causal_lm(target_dir, what="target").eval()
    prompts = [p.input_ids for p in load_prompts(bench, tokenizer, num_prompts=num_prompts)]
    conts = target_continuations(target, prompts, max_new_tokens, tokenizer.eos_token_id)
    result = {"target": target_dir, "bench": bench, "num_prompts": len(prompts), "max_new_tokens": max_new_tokens,
              "gamma": gamma, "retokenize": retokenize_stats(tokenizer, prompts, conts), "drafters": {}}
    for d in drafter_dirs:
        drafter = load_causal_lm(d, what="drafter").eval()
        result["drafters"][d] = drafter_agreement(drafter, prompts, conts, gamma)
    return result


def main(argv=None) -> dict:
    p = drafters_parser(__doc__, bench="testbed", num_prompts=20)
    p.add_argument("--chain-length", type=int, default=5, help="γ, draft tokens per chain round")
    p.add_argument("--out", default="benchmarks/results/drafter_agreement.json")
    a = checked_args(p, argv)
    result = run(a.target, a.drafter, a.bench, a.num_prompts, a.max_new_tokens, a.chain_length)
    r = result["retokenize"]
    print(f"{result['num_prompts']} prompts x <= {a.max_new_tokens} target tokens; "
          f"{r['retokenized_differently']}/{r['rows']} continuations re-tokenize to other ids; "
          f"commonest target token {r['commonest_token']!r} is {r['commonest_token_share']:.0%} of them")
    print_drafters(result, ["top-1", "top-3", "top-5", f"chain τ (γ={a.chain_length})"],
                   lambda s: [f"{s['top1']:.3f}", f"{s['top3']:.3f}", f"{s['top5']:.3f}", f"{s['chain_tau']:.2f}"])
    return write_json(a.out, result)


if __name__ == "__main__":
    main()
