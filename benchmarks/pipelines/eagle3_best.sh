#!/usr/bin/env bash
# The best EAGLE-3 head draftforge has trained on SmolLM2-135M-Instruct, from nothing, the way it was trained:
# `eagle3-j`, held-out α 0.617 / top-1 0.678 (docs/results/eagle3.md §2), the head behind every headline number of
# eagle3.md §3 and serving.md. It was not one run but seven, each started from the last one's export, with rows
# added between them; this script replays that lineage with the settings eagle3.md records, then measures the
# final head in the three suites of its headline numbers.
#
#   bash benchmarks/pipelines/eagle3_best.sh
#   PROMPTS=24 FIRST=12 HELDOUT=8 GEN_TOKENS=32 SCALE=100 EVAL_PROMPTS=1 NEW_TOKENS=16 REPEATS=1 \
#     OUT=/tmp/e3best bash benchmarks/pipelines/eagle3_best.sh        # the plumbing in a few minutes (no use as a head)
#
# Rows (`draftforge generate`, 2 threads, 192 new tokens at most; OUT/):
#   sft_rows.jsonl         greedy answers to the first FIRST training prompts, bf16 where native, batch 32 (the same
#                          command and file as eagle3_smollm2.sh, so either pipeline resumes the other's)
#   e3_rows_rest.jsonl     greedy answers to the other training prompts, fp32, batch 64
#   e3_heldout_rows.jsonl  greedy answers to the first HELDOUT prompts of the held-out split (modules no training
#                          prompt uses), fp32: every run's held-out α, top-1 and simulated τ
#   e3_rows_t1.jsonl       T = 1 answers to every training prompt, fp32, batch 64, seed 1
# Training (`draftforge train recipes/smollm2/eagle3.yaml`, fp32, 2 threads; each run from the previous export):
#   run        steps  peak lr  warm-up  seed  rows
#   eagle3-d    600   1e-3     20       0     sft_rows + the first 1,408 rows of e3_rows_rest (the documented run's
#                                             answers stopped there; its draft vocabulary is counted on sft_rows)
#   eagle3-e    250   4e-4     20       0     sft_rows + e3_rows_rest (every greedy answer)
#   eagle3-f    300   4e-4     10       0     + the first 2,240 rows of e3_rows_t1 (likewise stopped there)
#   eagle3-g    500   4e-4     10       0     + all of e3_rows_t1
#   eagle3-h    300   2e-4     10       1     the same rows; each seed reads the blocks in another order
#   eagle3-i    500   3e-4     10       2
#   eagle3-j    500   3e-4     10       3
# Eval (1 thread, 3 rotated repeats, each suite with its own AR): the head capped at 2 drafts behind prompt lookup,
# and prompt lookup alone, on the held-out instructions at T = 0 and 1 and HumanEval at T = 0 (out
# OUT/eval-<run>-lf2-{instructions-t0,humaneval-t0,instructions-t1}-r3).
#
# What comes out is a head of the same lineage, not the same bytes: the rows are the target's answers on this
# machine (bf16 and fp32 kernels differ between CPUs, so some greedy answers part at near-ties), and the documented
# `eagle3-d` to `-j` also shared the CPU at times. Expect held-out α near 0.617, not equal to it.
#
# Resumes from whatever is left, and says so: a row file is continued row by row (`generate` resumes), a training
# run with a recipe.yaml and no export continues from its latest checkpoint (`--resume`), a finished run (its
# export/draftforge.json) and a finished report are kept; delete one to redo it. Nothing else is deleted or
# overwritten.
#
# CPU budget, measured on a 2-core Intel Xeon VM (avx512_bf16, no AMX; docs/results/eagle3.md §2): rows ≈ 2.2 h
# wall (fp32 at ~220 new tokens/s greedy and ~175 at T = 1, 1.4M new tokens in all), training ≈ 5 h wall (≈ 600
# CPU-minutes: 62, 26, 31, 51, 29, 49 and 51 minutes for d to j, ~6 s a step), the three suites ≈ 25 min: ≈ 7.5 h.
#
# Environment (defaults in brackets): CACHE [~/.cache/draftforge]; OUT [runs/smollm2]; PROMPTS [all 4,388] training
# prompts answered; FIRST [1000] of them into sft_rows.jsonl; HELDOUT [128]; GEN_TOKENS [192]; D_REST_ROWS [1408]
# and F_T1_ROWS [2240], the partial row counts of eagle3-d and -f; SCALE [1] divides every run's steps and eval
# cadence (a smoke run); EVAL_PROMPTS [6]; NEW_TOKENS [128]; REPEATS [3].
source "$(dirname "$0")/common.sh"  # strict mode, cd to the repository root, OMP_NUM_THREADS=1, phase
CACHE="${CACHE:-$HOME/.cache/draftforge}"; OUT="${OUT:-runs/smollm2}"; PROMPTS="${PROMPTS:-}"; FIRST="${FIRST:-1000}"
HELDOUT="${HELDOUT:-128}"; GEN_TOKENS="${GEN_TOKENS:-192}"; D_REST_ROWS="${D_REST_ROWS:-1408}"
F_T1_ROWS="${F_T1_ROWS:-2240}"; SCALE="${SCALE:-1}"; EVAL_PROMPTS="${EVAL_PROMPTS:-6}"; NEW_TOKENS="${NEW_TOKENS:-128}"
REPEATS="${REPEATS:-3}"
TARGET="$CACHE/smollm2"
mkdir -p "$OUT"
kept() { echo "   kept: $1 (delete it to redo it)"; }

phase "target and prompts (the training split, the held-out split)"
python -m draftforge target smollm2 --cache "$CACHE"
[ -s "$OUT/train_prompts.jsonl" ] || python -m draftforge target prompts --split train --out "$OUT/train_prompts.jsonl"
[ -s "$OUT/heldout_prompts.jsonl" ] || python -m draftforge target prompts --split heldout --out "$OUT/heldout_prompts.jsonl"
TOTAL=$(wc -l < "$OUT/train_prompts.jsonl"); PROMPTS="${PROMPTS:-$TOTAL}"
[ "$FIRST" -le "$PROMPTS" ] || FIRST="$PROMPTS"

phase "rows: greedy answers to the first $FIRST training prompts (bf16 where native), resumable"
python -m draftforge generate --target "$TARGET" --prompts "$OUT/train_prompts.jsonl" --max-new-tokens "$GEN_TOKENS" \
  --batch-size 32 --threads 2 --out "$OUT/sft_rows.jsonl" -n "$FIRST" --temperature 0

phase "rows: greedy answers to the other $((PROMPTS - FIRST)) training prompts and $HELDOUT held-out ones (fp32), resumable"
python -m benchmarks.pipelines.prompts_left "$OUT/train_prompts.jsonl" "$OUT/sft_rows.jsonl" "$OUT/train_prompts_rest.jsonl"
python -m draftforge generate --target "$TARGET" --prompts "$OUT/heldout_prompts.jsonl" -n "$HELDOUT" --temperature 0 \
  --max-new-tokens "$GEN_TOKENS" --batch-size 64 --dtype float32 --threads 2 --out "$OUT/e3_heldout_rows.jsonl"
python -m draftforge generate --target "$TARGET" --prompts "$OUT/train_prompts_rest.jsonl" -n "$((PROMPTS - FIRST))" \
  --temperature 0 --max-new-tokens "$GEN_TOKENS" --batch-size 64 --dtype float32 --threads 2 --out "$OUT/e3_rows_rest.jsonl"

phase "rows: T = 1 answers to $PROMPTS training prompts (fp32, seed 1), resumable"
python -m draftforge generate --target "$TARGET" --prompts "$OUT/train_prompts.jsonl" -n "$PROMPTS" --temperature 1 \
  --max-new-tokens "$GEN_TOKENS" --batch-size 64 --dtype float32 --threads 2 --seed 1 --out "$OUT/e3_rows_t1.jsonl"

# the two partial row sets the documented runs trained on, whose generation was stopped after N rows: generate
# writes a file batch by batch in a fixed order (prompts sorted by length, a seed per batch), so its first N rows are
# what that run had; each named by its count, rewritten from the full files each time (the same rows once they exist)
head -n "$D_REST_ROWS" "$OUT/e3_rows_rest.jsonl" > "$OUT/e3_rows_rest_first$D_REST_ROWS.jsonl"
head -n "$F_T1_ROWS" "$OUT/e3_rows_t1.jsonl" > "$OUT/e3_rows_t1_first$F_T1_ROWS.jsonl"

GREEDY="$OUT/sft_rows.jsonl,$OUT/e3_rows_rest.jsonl"
train() {  # run, init (none or a run), steps, lr, warm-up, seed, eval_every, sources
  local run="$1" init="$2" steps=$(( $3 / SCALE > 0 ? $3 / SCALE : 1 )) lr="$4" warmup="$5" seed="$6"
  local every=$(( $7 / SCALE > 0 ? $7 / SCALE : 1 )) sources="$8" from="$OUT/$2/export" start
  if [ -f "$OUT/$run/export/draftforge.json" ]; then kept "$OUT/$run/export"; return; fi
  if [ "$init" = none ]; then from="the recipe's start"; start=(--set model.draft_vocab_from="$OUT/sft_rows.jsonl")
  else start=(--set model.init_from="$OUT/$init/export" --set model.draft_vocab=null --set model.draft_vocab_from=null); fi
  phase "train: $run, $steps steps at peak lr $lr (seed $seed) from $from, log $OUT/$run.log"
  OMP_NUM_THREADS=2 python -m draftforge train recipes/smollm2/eagle3.yaml --set output_dir="$OUT/$run" "${start[@]}" \
    --set "data.sources=[$sources]" --set "data.eval_sources=[$OUT/e3_heldout_rows.jsonl]" \
    --set train.precision=fp32 --set optim.lr="$lr" --set optim.warmup_steps="$warmup" --set train.seed="$seed" \
    --set train.max_steps="$steps" --set train.eval_every="$every" --set train.eval_batches=16 \
    --set train.save_every=25 --set train.eval_at_start=false $(resume_flag "$OUT/$run") >> "$OUT/$run.log" 2>&1
  grep -ao "\[draftforge\] eagle3: held-out .*" "$OUT/$run.log" | tail -1 | sed 's/^/   /'
}
train eagle3-d none 600 1e-3 20 0 100 "$OUT/sft_rows.jsonl,$OUT/e3_rows_rest_first$D_REST_ROWS.jsonl"
train eagle3-e eagle3-d 250 4e-4 20 0 125 "$GREEDY"
train eagle3-f eagle3-e 300 4e-4 10 0 150 "$GREEDY,$OUT/e3_rows_t1_first$F_T1_ROWS.jsonl"
train eagle3-g eagle3-f 500 4e-4 10 0 250 "$GREEDY,$OUT/e3_rows_t1.jsonl"
train eagle3-h eagle3-g 300 2e-4 10 1 300 "$GREEDY,$OUT/e3_rows_t1.jsonl"
train eagle3-i eagle3-h 500 3e-4 10 2 250 "$GREEDY,$OUT/e3_rows_t1.jsonl"
train eagle3-j eagle3-i 500 3e-4 10 3 250 "$GREEDY,$OUT/e3_rows_t1.jsonl"

suite() {  # name, bench, temperature
  local out="$OUT/eval-eagle3-j-lf2-$1-r$REPEATS"
  if [ -f "$out/report.json" ]; then kept "$out"
  else
    phase "eval: $2 at T = $3, the head capped at 2 behind prompt lookup and lookup alone, $REPEATS repeats, 1 thread"
    python -m draftforge eval --target "$TARGET" --drafter "$OUT/eagle3-j/export" --bench "$2" --temperature "$3" \
      --methods chain,lookup --lookup-first prompt-lookup:drafter_tokens=2 --num-prompts "$EVAL_PROMPTS" \
      --max-new-tokens "$NEW_TOKENS" --repeats "$REPEATS" --threads 1 --no-plots --out "$out" > "$out.log" 2>&1
  fi
  grep '^|' "$out/report.md" | head -8
}
suite instructions-t0 instructions 0
suite humaneval-t0 humaneval 0
suite instructions-t1 instructions 1
phase "done: the head is $OUT/eagle3-j/export (a speculators checkpoint vLLM serves as method eagle3)"
