#!/usr/bin/env bash
# The EAGLE-3 head on more of the target's answers (docs/results/eagle3.md, "More rows"): every training prompt
# answered (4,388; eagle3_smollm2.sh answers PROMPTS of them), 128 prompts of the held-out split answered as a
# fixed eval set (`data.eval_sources`: modules no training prompt uses, and the same documents for every run however
# many rows it trains on), and a fine-tune of an existing head (HEAD) on all the rows, scored before its first step
# (`train.eval_at_start`: the head as it was, on the same held-out rows) and every EVAL_EVERY steps, keeping the
# best simulated τ. Then `draftforge eval` of the new head on the instructions (T = 0 and 1) and HumanEval (T = 0),
# alone and behind prompt lookup (`--lookup-first`), chains cut to the cost model's best length, and prompt lookup
# alone (the `lookup` method) in the lookup-first suites as the peer.
#
#   bash benchmarks/pipelines/eagle3_more_rows.sh
#
# Environment (defaults in brackets): CACHE [~/.cache/draftforge]; HEAD [runs/smollm2/eagle3-b/export], an
# exported head to start from, or `none` to train one from the recipe's start (its learning rate 1e-3 and warm-up
# 20 instead of the fine-tune's 4e-4 and 10); ROWS [runs/smollm2/e3_rows.jsonl], rows already answered (read, never
# written); the other prompts' answers go to ROWS_MORE [runs/smollm2/e3_rows_c.jsonl] (resumable row by row); RUN
# [eagle3-c]; STEPS [600]; EVAL_EVERY [100]; EVAL_PROMPTS [6]; NEW_TOKENS [128]; GEN_DTYPE [auto] and GEN_BATCH
# [32] for `generate`; PRECISION [auto] for training (`train.precision`). On a CPU without AMX, fp32 can be the
# faster choice for both: on a 2-core Intel Xeon VM (CPU model 207, avx512_bf16), generate at batch 64 ran 242
# new tokens/s in fp32 against 181 in bf16 at batch 32, and a training step 5.3 s against 8.6
# (docs/training.md, "Speed on a CPU"); time both before a long run.
# CPU budget on a 2-core Zen 5 (2 threads): generating 3,281 answers ~40 min (~300-500 new tokens/s at batch 32),
# the fine-tune ~4-7 s a step plus ~2 min per eval of the 128 held-out rows, each eval suite 5-10 min at 1 thread.
# A finished run or report is kept (delete it to redo it).
source "$(dirname "$0")/common.sh"  # strict mode, cd to the repository root, OMP_NUM_THREADS=1, phase
CACHE="${CACHE:-$HOME/.cache/draftforge}"; HEAD="${HEAD:-runs/smollm2/eagle3-b/export}"
ROWS="${ROWS:-runs/smollm2/e3_rows.jsonl}"; ROWS_MORE="${ROWS_MORE:-runs/smollm2/e3_rows_c.jsonl}"
RUN="${RUN:-eagle3-c}"; STEPS="${STEPS:-600}"; EVAL_EVERY="${EVAL_EVERY:-100}"
GEN_DTYPE="${GEN_DTYPE:-auto}"; GEN_BATCH="${GEN_BATCH:-32}"; PRECISION="${PRECISION:-auto}"
EVAL_PROMPTS="${EVAL_PROMPTS:-6}"; NEW_TOKENS="${NEW_TOKENS:-128}"
TARGET="$CACHE/smollm2"; OUT=runs/smollm2
mkdir -p "$OUT"

phase "prompts: the training split, the ones $ROWS has not answered, and the held-out split"
python -m draftforge target smollm2 --cache "$CACHE"
[ -s "$OUT/train_prompts.jsonl" ] || python -m draftforge target prompts --split train --out "$OUT/train_prompts.jsonl"
[ -s "$OUT/heldout_prompts.jsonl" ] || python -m draftforge target prompts --split heldout --out "$OUT/heldout_prompts.jsonl"
python -m benchmarks.pipelines.prompts_left "$OUT/train_prompts.jsonl" "$ROWS" "$OUT/train_prompts_rest.jsonl"

phase "generate: the held-out rows, then the rest of the training prompts (resumable), 2 threads"
python -m draftforge generate --target "$TARGET" --prompts "$OUT/heldout_prompts.jsonl" -n 128 --temperature 0 \
  --max-new-tokens 192 --batch-size "$GEN_BATCH" --dtype "$GEN_DTYPE" --threads 2 --out "$OUT/e3_heldout_rows.jsonl"
python -m draftforge generate --target "$TARGET" --prompts "$OUT/train_prompts_rest.jsonl" --temperature 0 \
  --max-new-tokens 192 --batch-size "$GEN_BATCH" --dtype "$GEN_DTYPE" --threads 2 --out "$ROWS_MORE"

phase "train: $RUN, $STEPS steps from $HEAD on every row, 2 threads, precision $PRECISION"
if [ "$HEAD" = none ]; then START=(); else START=(--set model.init_from="$HEAD" --set optim.lr=4e-4 --set optim.warmup_steps=10); fi
[ -f "$OUT/$RUN/export/draftforge.json" ] || OMP_NUM_THREADS=2 python -m draftforge train recipes/smollm2/eagle3.yaml \
  --set output_dir="$OUT/$RUN" "${START[@]}" --set model.draft_vocab_from="$ROWS" \
  --set "data.sources=[$ROWS,$ROWS_MORE]" --set "data.eval_sources=[$OUT/e3_heldout_rows.jsonl]" \
  --set train.precision="$PRECISION" --set train.max_steps="$STEPS" \
  --set train.eval_every="$EVAL_EVERY" --set train.eval_batches=16 --set train.save_every=25 \
  --set train.eval_at_start=true $(resume_flag "$OUT/$RUN") >> "$OUT/$RUN.log" 2>&1
grep -h "held-out\|step 0" "$OUT/$RUN.log" || true

phase "eval: instructions (T=0, T=1) and HumanEval (T=0), 1 thread, each suite with its own AR"
suite() {  # name, drafter, bench, temperatures, methods, extra flags
  local name="$1" drafter="$2" bench="$3" temps="$4" methods="$5"; shift 5
  [ -f "$OUT/eval-$name/report.json" ] || python -m draftforge eval --target "$TARGET" --drafter "$drafter" \
    --bench "$bench" --temperature "$temps" --methods "$methods" --num-prompts "$EVAL_PROMPTS" \
    --max-new-tokens "$NEW_TOKENS" --repeats 1 --threads 1 --no-plots "$@" --out "$OUT/eval-$name" \
    > "$OUT/eval-$name.log" 2>&1
  grep '^|' "$OUT/eval-$name/report.md" | head -20
}
H="$OUT/$RUN/export"
suite "$RUN-instructions-t0" "$H" instructions 0 chain,tree,eagle2 --tune-chain-length
suite "$RUN-lf-instructions-t0" "$H" instructions 0 chain,tree --tune-chain-length --lookup-first prompt-lookup
suite "$RUN-humaneval-t0" "$H" humaneval 0 chain,tree,eagle2 --tune-chain-length
suite "$RUN-lf-humaneval-t0" "$H" humaneval 0 chain,tree --tune-chain-length --lookup-first prompt-lookup
# the head capped at 2 drafts behind lookup's chain of 5, and prompt lookup alone (`lookup`) in the same run: the two
# are rotated and share one AR, so their tokens per second compare directly
suite "$RUN-lf2-instructions-t0" "$H" instructions 0 chain,lookup --lookup-first prompt-lookup:drafter_tokens=2
suite "$RUN-lf2-humaneval-t0" "$H" humaneval 0 chain,lookup --lookup-first prompt-lookup:drafter_tokens=2
suite "$RUN-instructions-t1" "$H" instructions 1 chain,tree --tune-chain-length
suite "$RUN-lf-instructions-t1" "$H" instructions 1 chain --tune-chain-length --lookup-first prompt-lookup
phase "done"
