"""Where one EAGLE-3 training step spends its time: the frozen target's forward, then the head's unrolled forward,
its loss and the backward, that part in two forms side by side.

The step is task eagle3's (train/eagle3.py): B blocks of T tokens, `--ttt-steps` unrolled drafting steps, a head
over a `--draft-vocab` subset of the target's vocabulary, the first `--prompt` positions of each block without a
loss (as SFT rows' prompts). "head + loss + backward" is timed for
- `draftforge`: the head's norm and LM head on the rows a loss reads only (kept_by_step), the teacher's logits
  at the draft ids, log-normaliser and top-1 taken once per batch, the terms in 16 MiB chunks of positions
  (train/eagle3.py, train/divergences.py full_terms);
- `before`: the form before those changes, kept here as the reference: logits for every anchor, each unrolled
  step copying the teacher's [positions, V] rows to fp32 and taking every term over all positions at once (its
  per-step metric sums and top-1 argmax over [positions, V] left out, so the old step was slower than this form).
Both give the same loss bitwise (checked here, and in tests/train/test_loss_chunks.py; the gradients are the same
sums less the zero rows of unscored anchors). Tokens are random (the cost does not depend on them). Per precision:
the target in that dtype, the head under bf16 autocast or in fp32, as `train.precision` runs them. Each repeat
times the target once and the two forms in alternating order; medians over repeats after one warm-up repeat.

    python -m benchmarks.micro.eagle3_step --target ~/.cache/draftforge/smollm2 --threads 2 --repeats 3 \\
        --precision bf16 fp32 --out runs/bench/eagle3_step.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from benchmarks.common import add_flags, checked_args, print_table, write_json


def before(head, tokens_BT, aux_BTA, ttt_steps, teacher_BTV, next_BT, d2t, decay: float):
    """The reference form: logits for every anchor; for each step, the teacher's rows copied to fp32 over the
    whole vocabulary and every term taken over all kept positions at once (train/eagle3.py before 2026-11-26)."""
    from draftforge.train.divergences import _full_terms
    from draftforge.train.eagle3 import unrolled_anchors

    logits_by_step = head(tokens_BT, aux_BTA, ttt_steps, unrolled_anchors(next_BT, ttt_steps))
    total, t_len = 0.0, next_BT.shape[1]
    for k, s_BTS in enumerate(logits_by_step):
        span = t_len - 1 - k
        keep_BT = next_BT[:, 1 + k :] != -100
        s_PS = s_BTS[:, :span][keep_BT].float()
        t_PV = teacher_BTV[:, 1 + k :][keep_BT].float()
        terms = _full_terms(s_PS, t_PV[:, d2t], 1.0, t_PV.logsumexp(-1))
        total = total + decay**k * terms["kl"].sum()
    return total


def draftforge_form(head, tokens_BT, aux_BTA, ttt_steps, teacher_BTV, next_BT, d2t, cfg):
    """What task eagle3's loss runs (train/eagle3.py ttt_loss, after the target's forward)."""
    from draftforge.train.eagle3 import kept_by_step, step_losses, unrolled_anchors

    logits_by_step = head(tokens_BT, aux_BTA, ttt_steps, unrolled_anchors(next_BT, ttt_steps),
                          kept_by_step(next_BT, ttt_steps))
    return step_losses(logits_by_step, teacher_BTV, next_BT, cfg, cfg.weights(), d2t, evaluating=False)[0]


FORMS = ("before", "draftforge")


def measure(target_dir: str, precision: str, batch: int, block: int, prompt: int, ttt_steps: int, draft_vocab: int,
            repeats: int, body: str = "attention") -> dict:
    from draftforge.loading import load_causal_lm
    from draftforge.train.eagle3 import Eagle3TaskConfig, kept_by_step, make_head, unrolled_anchors

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    target = load_causal_lm(target_dir, what="target", dtype=dtype).eval().requires_grad_(False)
    vocab = target.config.vocab_size
    d2t = list(range(min(draft_vocab, vocab)))
    cfg = Eagle3TaskConfig(steps=ttt_steps, body=body)
    head, config = make_head(cfg, target, d2t, seed=0)
    d2t_N = torch.tensor(d2t)
    ids_BT = torch.randint(0, vocab, (batch, block), generator=torch.Generator().manual_seed(0))
    next_BT = torch.nn.functional.pad(ids_BT[:, 2:], (0, 2), value=-100)  # the label after each position
    next_BT[:, : max(0, prompt - 1)] = -100  # the prompt's positions carry no loss
    tokens_BT = torch.nn.functional.pad(ids_BT[:, 1:], (0, 1), value=0)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16" else contextlib.nullcontext
    forms = {"before": lambda aux, teacher: before(head, tokens_BT, aux, ttt_steps, teacher, next_BT, d2t_N,
                                                   cfg.step_decay),
             "draftforge": lambda aux, teacher: draftforge_form(head, tokens_BT, aux, ttt_steps, teacher, next_BT,
                                                                d2t_N, cfg)}
    times: dict[str, list[float]] = {}
    losses = {}

    def clock(name, fn):
        t0 = time.perf_counter()
        out = fn()
        times.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
        return out

    for r in range(repeats + 1):  # repeat 0 warms up and is dropped
        with autocast():
            with torch.no_grad():
                out = clock("target forward", lambda: target(input_ids=ids_BT, output_hidden_states=True))
            aux = torch.cat([out.hidden_states[i] for i in config.aux_layers], -1)
            teacher = out.logits
            for name in (FORMS if r % 2 == 0 else FORMS[::-1]):
                head.zero_grad(set_to_none=True)

                def step():
                    loss = forms[name](aux, teacher)
                    loss.backward()
                    return loss

                losses[name] = float(clock(f"head + loss + backward: {name}", step).detach())
            if r == repeats:  # after the timings: the head's logits at the scored anchors, the same rows bitwise?
                with torch.no_grad():
                    full = head(tokens_BT, aux, ttt_steps, unrolled_anchors(next_BT, ttt_steps))
                    keep = kept_by_step(next_BT, ttt_steps)
                    kept = head(tokens_BT, aux, ttt_steps, unrolled_anchors(next_BT, ttt_steps), keep)
                    same_logits = all(torch.equal(f[:, : k.shape[1]][k], p) for f, p, k in zip(full, kept, keep))
                del full, kept
        del out, aux, teacher
    med = {name: statistics.median(v[1:]) for name, v in times.items()}
    return {"precision": precision, "body": body, "ms": med, "ms_all": times, "losses": losses,
            "same_logits": same_logits,
            "ratio": med["head + loss + backward: before"] / med["head + loss + backward: draftforge"],
            "step_ms": med["target forward"] + med["head + loss + backward: draftforge"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="a Llama-family target directory (draftforge target smollm2)")
    parser.add_argument("--precision", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"],
                        help="train.precision forms to time (bf16: the target in bf16, the head under autocast)")
    parser.add_argument("--body", default="attention", choices=["attention", "mamba2"],
                        help="the head's body (eagle3.body): EAGLE-3's decoder layer or the feature Mamba2 drafter's")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    add_flags(parser, batch=8, block=256, prompt=64, ttt_steps=5, draft_vocab=8192, repeats=3, threads=1)
    args = checked_args(parser, argv)
    torch.set_num_threads(args.threads)
    results = []
    for precision in args.precision:
        print(f"[eagle3_step] {args.body} head, {precision}: {args.batch} x {args.block} tokens "
              f"({args.prompt} without a loss), "
              f"{args.ttt_steps} unrolled steps, {args.draft_vocab:,}-id head, {args.threads} thread(s), "
              f"{args.repeats} repeats", flush=True)
        results.append(measure(args.target, precision, args.batch, args.block, args.prompt, args.ttt_steps,
                               args.draft_vocab, args.repeats, args.body))
    rows = [[r["precision"], f"{r['ms']['target forward']:.0f}", f"{r['ms']['head + loss + backward: before']:.0f}",
             f"{r['ms']['head + loss + backward: draftforge']:.0f}", f"{r['ratio']:.2f}x",
             f"{r['step_ms'] / 1e3:.2f}"] for r in results]
    print_table(["precision", "target fwd ms", "head + loss + bwd ms (before)", "head + loss + bwd ms (draftforge)",
                 "ratio", "step s (draftforge)"], rows, right={1, 2, 3, 4, 5})
    same = all(r["losses"]["draftforge"] == r["losses"]["before"] for r in results)
    print(f"the two forms gave {'the same loss bitwise' if same else 'DIFFERENT losses'} in every precision")
    rounded = [r["precision"] for r in results if not r["same_logits"]]
    print("the head's logits at the scored anchors: " + (f"rounded differently in {', '.join(rounded)} (a product "
          "over fewer rows)" if rounded else "the same bitwise as every anchor's, indexed, in every precision"))
    if args.out:
        write_json(args.out, {"body": args.body, "threads": args.threads, "batch": args.batch, "block": args.block,
                              "prompt": args.prompt, "ttt_steps": args.ttt_steps, "draft_vocab": args.draft_vocab,
                              "results": results})
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
