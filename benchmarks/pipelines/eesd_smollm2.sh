#!/usr/bin/env bash
# EESD on SmolLM2-135M-Instruct, the paper's ablation in one command (docs/results/eesd.md):
# exit heads at N = 3 (main), N = 2 and N = 6, a head-only exit (N = 3, no exit layer), an exit layer
# trained without self-distilled data (N = 3, stdlib text only) and the N = 3 exit trained 5x longer; then
#   1. the exports side by side at fixed K (benchmarks/decoding/eesd_bench.py): τ, v_d, r_d, HM, tok/s, speedup;
#   2. draft-length control on the N = 3 drafter: K in {3, 5, 10}, Beta-TS, Cali-TS (with the θ predictor
#      harvested for it), SpecDec++ (benchmarks/decoding/length_control.py).
# Needs runs/smollm2/sft_rows.jsonl (its greedy rows) and corpus_train.jsonl (benchmarks/pipelines/smollm2_pipeline.sh).
# Environment: STEPS [100] training steps per exit head (LONG_STEPS [500] for the longer N = 3); EVAL_PROMPTS [6];
# NEW_TOKENS [128]. Finished runs
# are kept (delete runs/smollm2/eesd-* to retrain). Two trainings at a time, 1 thread each.
source "$(dirname "$0")/common.sh"  # strict mode, cd to the repository root, OMP_NUM_THREADS=1, phase
STEPS="${STEPS:-100}"; LONG_STEPS="${LONG_STEPS:-500}"; EVAL_PROMPTS="${EVAL_PROMPTS:-6}"; NEW_TOKENS="${NEW_TOKENS:-128}"
OUT=runs/smollm2; TARGET="$HOME/.cache/draftforge/smollm2"

eesd() {  # run name, then --set overrides
  local name=$1; shift
  [ -f "$OUT/$name/export/draftforge.json" ] && return 0
  python -m draftforge train recipes/smollm2/eesd.yaml $(resume_flag "$OUT/$name") --set "output_dir=$OUT/$name" \
    --set "train.max_steps=$STEPS" "$@" >> "$OUT/$name.log" 2>&1
}
NO_SD=(--set "data.sources=[$OUT/corpus_train.jsonl]" --set data.format=text --set "eesd.open_sources=[]"
       --set model.draft_vocab_from=null)

phase "data: the target's greedy answers (the T=0 rows of sft_rows.jsonl)"
[ -s "$OUT/eesd_rows.jsonl" ] || python -c "
import json, sys
rows = [l for l in open('$OUT/sft_rows.jsonl') if json.loads(l)['temperature'] == 0]
open('$OUT/eesd_rows.jsonl', 'w').writelines(rows); print(len(rows), 'greedy rows')"

phase "train: five exit heads, two at a time ($STEPS steps each), then N = 3 for $LONG_STEPS steps"
eesd eesd-n3 & eesd eesd-n2 --set eesd.exit_after_layer=2 & wait
eesd eesd-n6 --set eesd.exit_after_layer=6 & eesd eesd-n3-headonly --set eesd.exit_layer=false & wait
eesd eesd-n3-nosd "${NO_SD[@]}" & eesd eesd-n3-long --set "train.max_steps=$LONG_STEPS" --set train.eval_every=100 \
  --set train.save_every=100 & wait
grep -h "done:" "$OUT"/eesd-*.log || true

phase "θ predictor for the N = 3 drafter (Cali-TS): held-out answers, harvest, train"
# prompts 1001..1064 of the training split: answers no drafter or exit head was trained on
[ -s "$OUT/theta_prompts.jsonl" ] || sed -n 1001,1064p "$OUT/train_prompts.jsonl" > "$OUT/theta_prompts.jsonl"
python -m draftforge generate --target "$TARGET" --prompts "$OUT/theta_prompts.jsonl" --temperature 0 \
  --max-new-tokens 128 --batch-size 32 --threads 2 --out "$OUT/theta_rows.jsonl"
[ -f "$OUT/theta-harvest-eesd/harvest.json" ] || python -m draftforge harvest theta --target "$TARGET" \
  --drafter "$OUT/eesd-n3/export" --data "$OUT/theta_rows.jsonl" --out "$OUT/theta-harvest-eesd" --overwrite
[ -f "$OUT/theta-eesd/export/draftforge.json" ] || python -m draftforge train recipes/tiny/theta.yaml $(resume_flag "$OUT/theta-eesd") \
  --set "output_dir=$OUT/theta-eesd" --set "model.target=$TARGET" --set "data.sources=[$OUT/theta-harvest-eesd]"

[ "${SKIP_EVAL:-0}" = 1 ] && { phase "done (SKIP_EVAL=1)"; exit 0; }
phase "eval 1: the exports side by side at K = 3 (held-out instructions, greedy)"
python -m benchmarks.decoding.eesd_bench --target "$TARGET" --export "N3=$OUT/eesd-n3/export" --export "N2=$OUT/eesd-n2/export" \
  --export "N6=$OUT/eesd-n6/export" --export "N3 head-only=$OUT/eesd-n3-headonly/export" \
  --export "N3 no self-distill=$OUT/eesd-n3-nosd/export" --export "N3 $LONG_STEPS steps=$OUT/eesd-n3-long/export" \
  --k 3 --bench instructions \
  --num-prompts "$EVAL_PROMPTS" --max-new-tokens "$NEW_TOKENS" --repeats 3 --out "$OUT/eesd_bench.json" \
  > "$OUT/eesd_bench.log" 2>&1 &
phase "eval 2: fixed K vs Beta-TS vs Cali-TS vs SpecDec++ on the N = 3 drafter"
python -m benchmarks.decoding.length_control --target "$TARGET" --drafter "$OUT/eesd-n3/export" \
  --theta-predictor "$OUT/theta-eesd/export" --prompts instructions \
  --num-prompts "$EVAL_PROMPTS" --max-new-tokens "$NEW_TOKENS" --repeats 3 --fixed-k 3 5 10 --max-draft 10 \
  --out "$OUT/eesd_length_control.json" > "$OUT/eesd_length_control.log" 2>&1
wait
grep '^|' "$OUT/eesd_bench.log" "$OUT/eesd_length_control.log" || tail -5 "$OUT"/eesd_*.log
phase "done"
