#!/usr/bin/env bash
# Long context on SmolLM2-135M-Instruct (docs/results/long-context.md, issue #34): the drafters that read the
# target, as trained at 256 tokens and fine-tuned at 2k, against AR and prompt lookup on document-grounded
# questions of 1k, 2k, 4k and 8k tokens, then regrouped by length (table, JSON, plot).
#
#   bash benchmarks/pipelines/longctx_smollm2.sh
#
# Needs the token-only drafters of benchmarks/pipelines/smollm2_pipeline.sh (SKIP_EVAL=1 is enough:
# runs/smollm2/{mamba2,llama}-sft, ~10 CPU-minutes each once its answers exist) and the heads of
# benchmarks/pipelines/eagle3_smollm2.sh: HEAD [runs/smollm2/eagle3] (the attention head;
# docs/results/long-context.md used runs/smollm2/eagle3-a300, its 225-step extension) and MAMBA
# [runs/smollm2/eagle3-mamba2]. Environment: CACHE [~/.cache/draftforge]; TRAIN_PER_BUCKET [64] training
# questions per task group (at 1,920 prompt tokens; the target answers each greedily, ~5.6 s a row at 1 thread);
# FT_STEPS [32] fine-tuning steps of 4 x 2,048 tokens (~35 s a step for the attention head at 1 thread beside
# another job; the Mamba2 body, whose training-time test unrolls only the scored anchors, ~16-40 s at 2 threads); PER_BUCKET [6] eval questions per task group and length; METHODS
# [chain]. CPU budget: rows ~13 min, fine-tunes ~20 min + ~23 min (2 threads), each eval ~25 min (chain; +20 min
# with tree); the token-only drafters' 2k fine-tunes ~3 min each, their evals ~35 min (chain + tree, T = 0; Llama
# with transformers' assisted generation) and ~22 min (chain, T = 1) each. Resumable: every step whose output
# exists is skipped (generate continues row by row).
source "$(dirname "$0")/common.sh"  # strict mode, cd to the repository root, OMP_NUM_THREADS=1, phase
CACHE="${CACHE:-$HOME/.cache/draftforge}"; HEAD="${HEAD:-runs/smollm2/eagle3}"; MAMBA="${MAMBA:-runs/smollm2/eagle3-mamba2}"
TRAIN_PER_BUCKET="${TRAIN_PER_BUCKET:-64}"; FT_STEPS="${FT_STEPS:-32}"; PER_BUCKET="${PER_BUCKET:-6}"
METHODS="${METHODS:-chain}"
TARGET="$CACHE/smollm2"; OUT=runs/longctx
mkdir -p "$OUT"
for head in "$HEAD" "$MAMBA"; do
  [ -f "$head/export/draftforge.json" ] || { echo "no export in $head: run benchmarks/pipelines/eagle3_smollm2.sh first"; exit 1; }
done
for arch in mamba2 llama; do
  [ -f "runs/smollm2/$arch-sft/export/config.json" ] || {
    echo "no runs/smollm2/$arch-sft/export: run SKIP_EVAL=1 bash benchmarks/pipelines/smollm2_pipeline.sh first"; exit 1; }
done

phase "questions: held-out (eval) and training (rows), disjoint by module"
python -m draftforge target smollm2 --cache "$CACHE"
[ -s "$OUT/questions.jsonl" ] || python -m draftforge target longctx --target "$TARGET" --out "$OUT/questions.jsonl" \
  --per-bucket "$PER_BUCKET"
[ -s "$OUT/train_questions.jsonl" ] || python -m draftforge target longctx --target "$TARGET" --split train \
  --out "$OUT/train_questions.jsonl" --lengths 1920 --per-bucket "$TRAIN_PER_BUCKET"

phase "generate: the target's greedy answers to the training questions (resumable)"
python -m draftforge generate --target "$TARGET" --prompts "$OUT/train_questions.jsonl" --out "$OUT/train_rows.jsonl" \
  --temperature 0 --max-new-tokens 128 --batch-size 4 --dtype bfloat16 --threads 1

phase "fine-tune both heads at 2,048 tokens ($FT_STEPS steps each)"
finetune() {  # run name, init, extra --set flags
  local run="$1" init="$2"; shift 2
  [ -f "$OUT/$run/export/draftforge.json" ] || python -m draftforge train recipes/smollm2/eagle3-longctx.yaml \
    --set output_dir="$OUT/$run" --set model.init_from="$init" --set train.max_steps="$FT_STEPS" "$@" \
    $(resume_flag "$OUT/$run") >> "$OUT/$run.log" 2>&1
  grep -h "held-out" "$OUT/$run.log" || true
}
finetune eagle3-2k "$HEAD"
OMP_NUM_THREADS=2 finetune fm-2k "$MAMBA" --set eagle3.body=mamba2

phase "fine-tune the token-only Mamba2 and Llama drafters at 2,048 tokens (recipes/smollm2/sft-*-longctx.yaml)"
for arch in mamba2 llama; do
  [ -f "$OUT/$arch-2k/export/config.json" ] || python -m draftforge train "recipes/smollm2/sft-$arch-longctx.yaml" \
    $(resume_flag "$OUT/$arch-2k") >> "$OUT/$arch-2k.log" 2>&1
  grep -h "done:" "$OUT/$arch-2k.log" || true
done

phase "eval: T = 0, $METHODS, each drafter in its own run with its own AR (1 thread)"
suite() {  # report name, drafter, methods
  [ -f "$OUT/$1/report.json" ] || python -m draftforge eval --target "$TARGET" --bench "$OUT/questions.jsonl" \
    --drafter "$2" --methods "$3" --max-new-tokens 128 --dtype bfloat16 --threads 1 --repeats 1 --warmup 1 \
    --ignore-eos --self-check identity --out "$OUT/$1" > "$OUT/$1.log" 2>&1
}
suite lookup-t0 prompt-lookup chain
suite e3-t0 "$HEAD/export" "$METHODS"
suite fm-t0 "$MAMBA/export" "$METHODS"
suite e3-2k-t0 "$OUT/eagle3-2k/export" "$METHODS"
suite fm-2k-t0 "$OUT/fm-2k/export" "$METHODS"
suite m2-2k-t0 "$OUT/mamba2-2k/export" chain,tree
suite llama-2k-t0 "$OUT/llama-2k/export" chain,tree  # transformers' assisted generation runs beside it
suite_t1() {  # report name, drafter, extra flags: chain at T = 1
  [ -f "$OUT/$1/report.json" ] || python -m draftforge eval --target "$TARGET" --bench "$OUT/questions.jsonl" \
    --drafter "$2" --methods chain --temperature 1 --max-new-tokens 128 --dtype bfloat16 --threads 1 --repeats 1 \
    --warmup 1 --ignore-eos "${@:3}" --out "$OUT/$1" > "$OUT/$1.log" 2>&1
}
suite_t1 m2-2k-t1 "$OUT/mamba2-2k/export"
suite_t1 llama-2k-t1 "$OUT/llama-2k/export" --baseline ar

phase "per length: table, JSON and plot"
python -m benchmarks.decoding.context_curves "$OUT"/lookup-t0 "$OUT"/e3-t0 "$OUT"/fm-t0 "$OUT"/e3-2k-t0 "$OUT"/fm-2k-t0 \
  --label lookup-t0="prompt lookup" --label e3-t0="EAGLE-3 head" --label fm-t0="feature Mamba2" \
  --label e3-2k-t0="EAGLE-3 head, 2k" --label fm-2k-t0="feature Mamba2, 2k" --out "$OUT/curves"
python -m benchmarks.decoding.context_curves "$OUT"/m2-2k-t0 "$OUT"/llama-2k-t0 "$OUT"/m2-2k-t1 "$OUT"/llama-2k-t1 \
  --label m2-2k-t0="Mamba2, 2k" --label llama-2k-t0="Llama, 2k" --label m2-2k-t1="Mamba2, 2k" \
  --label llama-2k-t1="Llama, 2k" --out "$OUT/curves-tok"
