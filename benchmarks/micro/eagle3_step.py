"""Where one EAGLE-3 training step spends its time: the frozen target's forward, the head's unrolled forward, and
the loss with its backward, the loss in two forms side by side.

The step is task eagle3's (train/eagle3.py): B blocks of T tokens, `--ttt-steps` unrolled drafting steps, a head
over a `--draft-vocab` subset of the target's vocabulary. "loss + backward" is timed for
- `draftforge`: the teacher's logits at the draft ids, log-normaliser and top-1 taken once per batch, the terms
  in 16 MiB chunks of positions (train/eagle3.py full_teacher, train/divergences.py full_terms);
- `per step, whole batch`: the form before that, kept here as the reference: each unrolled step copies the
  teacher's [positions, V] rows to fp32 and takes every term over all positions at once.
Both give the same loss bitwise (tests/train/test_loss_chunks.py); this says what the difference costs. Tokens
are random (the cost does not depend on them; every position carries a loss). Per precision: the target in that
dtype, the head under bf16 autocast or in fp32, as `train.precision` runs them. Each repeat times every part once,
the two loss forms in alternating order; medians over repeats after one warm-up step.

    python -m benchmarks.micro.eagle3_step --target ~/.cache/draftforge/smollm2 --threads 2 --repeats 3 \\
        --precision bf16 fp32 --out runs/bench/eagle3_step.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from benchmarks.common import add_flags, print_table, write_json


def per_step_whole_batch(logits_by_step, teacher_BTV, next_BT, d2t, decay: float):
    """The reference form: for each step, the teacher's rows copied to fp32 over the whole vocabulary, every term
    over all kept positions at once (what train/eagle3.py did before taking the teacher once per batch)."""
    from draftforge.train.divergences import _full_terms

    total, t_len = 0.0, next_BT.shape[1]
    for k, s_BTS in enumerate(logits_by_step):
        span = t_len - 1 - k
        keep_BT = next_BT[:, 1 + k :] != -100
        s_PS = s_BTS[:, :span][keep_BT].float()
        t_PV = teacher_BTV[:, 1 + k :][keep_BT].float()
        terms = _full_terms(s_PS, t_PV[:, d2t], 1.0, t_PV.logsumexp(-1))
        total = total + decay**k * terms["kl"].sum()
    return total


def draftforge_form(logits_by_step, teacher_BTV, next_BT, d2t, cfg):
    from draftforge.train.eagle3 import step_losses

    return step_losses(logits_by_step, teacher_BTV, next_BT, cfg, cfg.weights(), d2t, evaluating=False)[0]


def measure(target_dir: str, precision: str, batch: int, block: int, ttt_steps: int, draft_vocab: int,
            repeats: int) -> dict:
    from draftforge.loading import load_causal_lm
    from draftforge.train.eagle3 import Eagle3TaskConfig, make_head, unrolled_anchors

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    target = load_causal_lm(target_dir, what="target", dtype=dtype).eval().requires_grad_(False)
    vocab = target.config.vocab_size
    d2t = list(range(min(draft_vocab, vocab)))
    cfg = Eagle3TaskConfig(steps=ttt_steps)
    head, config = make_head(cfg, target, d2t, seed=0)
    d2t_N = torch.tensor(d2t)
    ids_BT = torch.randint(0, vocab, (batch, block), generator=torch.Generator().manual_seed(0))
    next_BT = torch.nn.functional.pad(ids_BT[:, 2:], (0, 2), value=-100)  # the label after each position
    tokens_BT = torch.nn.functional.pad(ids_BT[:, 1:], (0, 1), value=0)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16" else contextlib.nullcontext
    forms = {"draftforge": lambda logits, teacher: draftforge_form(logits, teacher, next_BT, d2t_N, cfg),
             "per step, whole batch": lambda logits, teacher: per_step_whole_batch(logits, teacher, next_BT, d2t_N,
                                                                                   cfg.step_decay)}
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
            order = list(forms) if r % 2 == 0 else list(forms)[::-1]
            for name in order:
                head.zero_grad(set_to_none=True)
                logits = clock("head forward", lambda: head(tokens_BT, aux, ttt_steps,
                                                            unrolled_anchors(next_BT, ttt_steps)))

                def loss_and_backward():
                    loss = forms[name](logits, teacher)
                    loss.backward()
                    return loss

                losses[name] = float(clock(f"loss + backward: {name}", loss_and_backward).detach())
        del out, aux, teacher, logits
    med = {name: statistics.median(v[2 if name == "head forward" else 1:]) for name, v in times.items()}
    return {"precision": precision, "ms": med, "ms_all": times, "losses": losses,
            "ratio_loss_backward": med["loss + backward: per step, whole batch"] / med["loss + backward: draftforge"],
            "step_ms": med["target forward"] + med["head forward"] + med["loss + backward: draftforge"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="a Llama-family target directory (draftforge target smollm2)")
    parser.add_argument("--precision", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"],
                        help="train.precision forms to time (bf16: the target in bf16, the head under autocast)")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    add_flags(parser, batch=8, block=256, ttt_steps=5, draft_vocab=8192, repeats=3, threads=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    for precision in args.precision:
        print(f"[eagle3_step] {precision}: {args.batch} x {args.block} tokens, {args.ttt_steps} unrolled steps, "
              f"{args.draft_vocab:,}-id head, {args.threads} thread(s), {args.repeats} repeats", flush=True)
        results.append(measure(args.target, precision, args.batch, args.block, args.ttt_steps, args.draft_vocab,
                               args.repeats))
    rows = [[r["precision"], f"{r['ms']['target forward']:.0f}", f"{r['ms']['head forward']:.0f}",
             f"{r['ms']['loss + backward: per step, whole batch']:.0f}", f"{r['ms']['loss + backward: draftforge']:.0f}",
             f"{r['ratio_loss_backward']:.2f}x", f"{r['step_ms'] / 1e3:.2f}"] for r in results]
    print_table(["precision", "target fwd ms", "head fwd ms", "loss+bwd ms (per step, whole batch)",
                 "loss+bwd ms (draftforge)", "ratio", "step s (draftforge)"], rows, right={1, 2, 3, 4, 5, 6})
    same = all(r["losses"]["draftforge"] == r["losses"]["per step, whole batch"] for r in results)
    print(f"the two loss forms gave {'the same loss bitwise' if same else 'DIFFERENT losses'} in every precision")
    if args.out:
        write_json(args.out, {"threads": args.threads, "batch": args.batch, "block": args.block,
                              "ttt_steps": args.ttt_steps, "draft_vocab": args.draft_vocab, "results": results})
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
