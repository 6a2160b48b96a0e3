#!/usr/bin/env bash
# EAGLE-2 vs C2T on SmolLM2-135M-Instruct with the SmolLM2 Mamba2 drafter (docs/results/c2t.md):
# harvest EAGLE-2 trees on training prompts, train the C2T head and its feature ablation (PH, Pd, Hd),
# then one τ–γ sweep on held-out instructions: EAGLE-2's N, C2T's β, the ablation heads, and the
# transfer of the Mamba-trained head to the Llama drafter.
# Needs runs/smollm2/mamba2-sft and llama-sft (benchmarks/pipelines/smollm2_pipeline.sh SKIP_EVAL=1).
# Environment: HARVEST_PROMPTS [32], NEW_TOKENS [64] per harvested answer, EVAL_PROMPTS [6], EVAL_TOKENS [128] per
# swept answer, SKIP_EVAL [0] (stop after training).
# Greedy only (both methods are).
source "$(dirname "$0")/common.sh"  # strict mode, cd to the repository root, OMP_NUM_THREADS=1, phase
HARVEST_PROMPTS="${HARVEST_PROMPTS:-32}"; EVAL_PROMPTS="${EVAL_PROMPTS:-6}"; NEW_TOKENS="${NEW_TOKENS:-64}"
EVAL_TOKENS="${EVAL_TOKENS:-128}"
OUT=runs/smollm2; TARGET="$HOME/.cache/draftforge/smollm2"
MAMBA="$OUT/mamba2-sft/export"; LLAMA="$OUT/llama-sft/export"

phase "harvest: full EAGLE-2 pools (k 10, depth 10) along the target's greedy answers to $HARVEST_PROMPTS training prompts"
# prompts 1065.. of the training split: answers neither drafter was trained on
[ -s "$OUT/c2t_prompts.jsonl" ] || sed -n "1065,$((1064 + HARVEST_PROMPTS))p" "$OUT/train_prompts.jsonl" > "$OUT/c2t_prompts.jsonl"
resume=(); [ -f "$OUT/c2t-harvest/harvest.json" ] && resume=(--resume)
python -m draftforge harvest trees --target "$TARGET" --drafter "$MAMBA" --bench "$OUT/c2t_prompts.jsonl" \
  --max-new-tokens "$NEW_TOKENS" --out "$OUT/c2t-harvest" "${resume[@]}"

phase "train: the P+H+d head and the ablation heads"
for f in PHd PH Pd Hd; do
  [ -f "$OUT/c2t-$f/export/draftforge.json" ] || python -m draftforge train recipes/c2t.yaml $(resume_flag "$OUT/c2t-$f") \
    --set "output_dir=$OUT/c2t-$f" --set "model.target=$TARGET" --set "data.sources=[$OUT/c2t-harvest]" \
    --set "c2t.features=$f" --set train.max_steps=1500 >> "$OUT/c2t-$f.log" 2>&1
done

[ "${SKIP_EVAL:-0}" = 1 ] && { phase "done (SKIP_EVAL=1)"; exit 0; }
phase "sweep: EAGLE-2 N, C2T β, ablation heads (Mamba2 drafter); the same head on the Llama drafter (transfer)"
python -m benchmarks.decoding.tree_budget --target "$TARGET" --drafter "$MAMBA" --bench instructions --c2t "$OUT/c2t-PHd/export" \
  --c2t-head "PH=$OUT/c2t-PH/export" --c2t-head "Pd=$OUT/c2t-Pd/export" --c2t-head "Hd=$OUT/c2t-Hd/export" \
  --ns 4,8,16,32 --betas 0.3,0.5,0.7 --ablation-betas 0.5 --eagle-top-k 10 --eagle-depth 5 \
  --num-prompts "$EVAL_PROMPTS" --max-new-tokens "$EVAL_TOKENS" --repeats 2 --out "$OUT/tree_budget_mamba" \
  > "$OUT/tree_budget_mamba.log" 2>&1 &
python -m benchmarks.decoding.tree_budget --target "$TARGET" --drafter "$LLAMA" --bench instructions --c2t "$OUT/c2t-PHd/export" \
  --ns 4,8,16,32 --betas 0.3,0.5,0.7 --eagle-top-k 10 --eagle-depth 5 \
  --num-prompts "$EVAL_PROMPTS" --max-new-tokens "$EVAL_TOKENS" --repeats 2 --out "$OUT/tree_budget_llama" \
  > "$OUT/tree_budget_llama.log" 2>&1
wait
grep '^|' "$OUT/tree_budget_mamba.log" "$OUT/tree_budget_llama.log" || tail -5 "$OUT"/tree_budget_*.log
phase "done"
