"""An untrained EAGLE-3 export of a target, for checking the serving path before a trained head exists.

    python -m benchmarks.serving.eagle3_init_export --target ~/.cache/draftforge/smollm2 --out /tmp/eagle3-init \
        [--draft-vocab 8192] [--steps 3] [--fit-prompts 40]

The head is `Eagle3Config.from_target` started by `init_from_target` (the target's last layer reading the highest
aux state through fc, the target's norm and head rows). Untrained, it drafts the token it has just consumed (its
step 0 computes the target's prediction for position t + 1, where EAGLE-3 asks for t + 2), so nearly nothing is
accepted. `--fit-prompts N` gives it a signal without EAGLE-3 training: the target's greedy answers to the last N
prompts of `--fit-bench` (disjoint from the first prompts vllm_compare.py measures on) are encoded, and the LM head
alone is refitted by ridge regression from the head's step-0 states (after `norm`) to the one-hot token two ahead.
That is a linear probe, not a trained drafter: it exists so that the two engines' acceptance can be compared at a
rate well above zero. The draft vocabulary is the target's first N ids (`--draft-vocab N`; a byte-level BPE's ids
follow its merge order, roughly its frequency order) or the whole vocabulary (`--draft-vocab 0`); a reduced one
exercises the d2t / t2d maps vLLM reads. Runs in draftforge's environment; the export is the one vLLM and
draftforge's harness both load.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def fit_lm_head(head, target, sequences: list[list[int]], ridge: float = 1e-3) -> dict:
    """Refit head.lm_head so that norm(step-0 output at anchor t) predicts x_{t+2} (least squares to one-hot
    rows over the draft vocabulary, ridge `ridge` x the mean diagonal). Returns what was fitted, for the metadata."""
    import torch

    from draftforge.models.eagle3 import aux_states

    c = head.config
    rows = torch.full((c.vocab_size,), -1, dtype=torch.long)  # target id -> head row
    ids = torch.arange(c.vocab_size) if c.draft_vocab is None else torch.tensor(c.draft_vocab)
    rows[ids] = torch.arange(len(ids))
    gram = torch.zeros(c.hidden_size, c.hidden_size, dtype=torch.float64)
    cross = torch.zeros(c.hidden_size, c.head_rows, dtype=torch.float64)
    used = total = 0
    with torch.no_grad():
        for seq in sequences:
            x = torch.tensor([seq])
            states = target(input_ids=x, output_hidden_states=True).hidden_states
            aux = aux_states(states, c.aux_layers)[:, :-1]  # anchors t = 0..S-2
            out = head.ttt_forward(x[:, 1:], aux, 1)[0][0, :-1]  # anchors 0..S-3, each predicting x_{t+2}
            feats, labels = head.norm(out).double(), rows[x[0, 2:]]
            keep = labels >= 0
            total += len(labels)
            used += int(keep.sum())
            feats, labels = feats[keep], labels[keep]
            gram += feats.T @ feats
            cross.index_add_(1, labels, feats.T)
        lam = ridge * gram.diagonal().mean()
        weight = torch.linalg.solve(gram + lam * torch.eye(c.hidden_size, dtype=torch.float64), cross)
        head.lm_head.weight.copy_(weight.T.to(head.lm_head.weight.dtype))
    return {"lm_head": "ridge fit to the token two ahead", "sequences": len(sequences), "positions": used,
            "positions_outside_draft_vocab": total - used, "ridge": ridge}


def greedy_answers(target, prompts: list[list[int]], new_tokens: int, eos) -> list[list[int]]:
    import torch

    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False,
                                eos_token_id=eos, pad_token_id=eos)
            out.append(y[0].tolist())
    return out


def spread_ids(vocab: int, draft_vocab: int) -> list[int]:
    """`draft_vocab` ids spaced evenly over 0..vocab-1 (always 0, and past the first draft_vocab where any is)."""
    return [(i * vocab) // draft_vocab for i in range(draft_vocab)]


def build(target_dir: str, out_dir: str, draft_vocab: int = 8192, steps: int = 3, overwrite: bool = False,
          fit_prompts: int = 0, fit_bench: str = "instructions", fit_new_tokens: int = 64,
          aux_layers: list[int] | None = None, spread: bool = False) -> Path:
    """`spread`: the draft vocabulary leaves out vocab - draft_vocab ids spread over the whole vocabulary instead of
    its tail, so d2t's offsets are not all 0 (with the first N ids they are, and an engine that dropped the map
    would draft the same: a test of the map needs the spread)."""
    import torch
    from transformers import AutoTokenizer

    from draftforge.loading import load_causal_lm
    from draftforge.models.eagle3 import Eagle3Config, Eagle3Head, init_from_target
    from draftforge.models.eagle3_export import save_head

    target = load_causal_lm(target_dir, what="target", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    vocab = target.config.vocab_size
    if not 0 <= draft_vocab <= vocab:
        raise SystemExit(f"--draft-vocab {draft_vocab}: give 0 (the whole vocabulary) or 1..{vocab}")
    ids = None if draft_vocab in (0, vocab) else list(range(draft_vocab))
    if ids is not None and spread:  # evenly spaced (leaving out every other id past half the vocabulary kept
        # only the first N: every d2t offset 0, the map untested, while the metadata said "spread")
        ids = spread_ids(vocab, draft_vocab)
    head = Eagle3Head(Eagle3Config.from_target(target.config, aux_layers=aux_layers, draft_vocab=ids))
    how = init_from_target(head, target)
    recipe = "untrained (init_from_target)"
    if fit_prompts:
        from draftforge.data.prompts import load_prompt_rows, encode_prompts

        head.use_embedding(target.get_input_embeddings())
        rows = load_prompt_rows(fit_bench)[-fit_prompts:]
        prompts = [p.input_ids for p in encode_prompts(rows, tokenizer, source=fit_bench)]
        sequences = greedy_answers(target, prompts, fit_new_tokens, tokenizer.eos_token_id)
        how = {**how, "fit": {**fit_lm_head(head, target, sequences), "bench": fit_bench,
                              "prompts": f"last {len(rows)}", "new_tokens": fit_new_tokens}}
        recipe = "init_from_target + ridge-fitted lm_head (a probe, not EAGLE-3 training)"
    metadata = {"target": str(Path(target_dir).expanduser().resolve()), "recipe": recipe,
                "init": how, "draft_vocab": "whole" if ids is None else f"{'spread' if spread else 'first'} "
                                                                             f"{len(ids)} ids"}
    return save_head(head.eval(), target.config, tokenizer, out_dir, metadata, steps=steps, overwrite=overwrite)


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="a local HF Llama-family target directory")
    p.add_argument("--out", required=True)
    p.add_argument("--draft-vocab", type=int, default=8192, help="the target's first N ids; 0: the whole vocabulary")
    p.add_argument("--spread-draft-vocab", action="store_true", help="leave out ids spread over the vocabulary, not "
                                                                      "its tail (d2t offsets not all 0)")
    p.add_argument("--steps", type=int, default=3, help="speculative tokens the export's config proposes")
    p.add_argument("--fit-prompts", type=int, default=0, help="refit the LM head on the target's answers to the "
                                                                "last N prompts of --fit-bench (0: no fit)")
    p.add_argument("--fit-bench", default="instructions")
    p.add_argument("--fit-new-tokens", type=int, default=64)
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    out = build(str(Path(args.target).expanduser()), args.out, args.draft_vocab, args.steps, args.overwrite,
                args.fit_prompts, args.fit_bench, args.fit_new_tokens, spread=args.spread_draft_vocab)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
