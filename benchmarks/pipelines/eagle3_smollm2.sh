#!/usr/bin/env bash
# Drafters that read the target, on SmolLM2-135M-Instruct (docs/results/eagle3.md): an EAGLE-3 head and the
# feature-conditioned Mamba2 drafter, trained online (the frozen target inside every step) with training-time test
# on the target's own greedy answers, then measured by `draftforge eval` (held-out instructions at T = 0 and 1,
# HumanEval at T = 0; each suite with its own AR and prompt lookup as the peer), C2T pruning the head's EAGLE-2
# trees (harvest, classifier, τ–tokens sweep) and step time / state bytes against context
# (benchmarks/micro/drafter_context.py --feature-target).
#
#   bash benchmarks/pipelines/eagle3_smollm2.sh
#
# Environment (defaults in brackets): CACHE [~/.cache/draftforge]; PROMPTS [1000] training prompts answered
# greedily (resumable: generate continues row by row); STEPS [150] training steps of 8 x 256 tokens for the
# attention head and MAMBA_STEPS [50] for the Mamba2 body (~18 CPU-s per step either way on a 2-core Zen 5: the
# target's bf16 forward and five unrolled head steps; docs/results/eagle3.md ran 1,021 rows); EVAL_PROMPTS [6];
# NEW_TOKENS [128]; C2T_PROMPTS [80] prompts harvested for the C2T classifier. A finished training run is kept
# (delete runs/smollm2/<run> to retrain it); an existing report is not measured again.
source "$(dirname "$0")/common.sh"  # strict mode, cd to the repository root, OMP_NUM_THREADS=1, phase
CACHE="${CACHE:-$HOME/.cache/draftforge}"; PROMPTS="${PROMPTS:-1000}"; STEPS="${STEPS:-150}"; MAMBA_STEPS="${MAMBA_STEPS:-50}"
EVAL_PROMPTS="${EVAL_PROMPTS:-6}"; NEW_TOKENS="${NEW_TOKENS:-128}"; C2T_PROMPTS="${C2T_PROMPTS:-80}"
TARGET="$CACHE/smollm2"; OUT=runs/smollm2
mkdir -p "$OUT"

phase "target and training prompts"
python -m draftforge target smollm2 --cache "$CACHE"
[ -s "$OUT/train_prompts.jsonl" ] || python -m draftforge target prompts --split train --out "$OUT/train_prompts.jsonl"

phase "generate: greedy answers to $PROMPTS prompts (resumable)"
python -m draftforge generate --target "$TARGET" --prompts "$OUT/train_prompts.jsonl" --max-new-tokens 192 \
  --batch-size 32 --threads 2 --out "$OUT/sft_rows.jsonl" -n "$PROMPTS" --temperature 0

phase "train: the EAGLE-3 head ($STEPS steps), then the feature-conditioned Mamba2 drafter ($MAMBA_STEPS steps), 2 threads"
train() {  # run name, steps, extra --set flags
  local run="$1" steps="$2"; shift 2
  [ -f "$OUT/$run/export/draftforge.json" ] || OMP_NUM_THREADS=2 python -m draftforge train recipes/smollm2/eagle3.yaml \
    --set output_dir="$OUT/$run" --set train.max_steps="$steps" --set train.eval_every=25 --set train.save_every=25 \
    "$@" $(resume_flag "$OUT/$run") >> "$OUT/$run.log" 2>&1
  grep -h "held-out" "$OUT/$run.log" || true
}
train eagle3 "$STEPS"
train eagle3-mamba2 "$MAMBA_STEPS" --set eagle3.body=mamba2

phase "eval: instructions (T=0,1) and HumanEval (T=0), 1 thread, each suite with its own AR"
suite() {  # name, drafter, bench, temperatures, methods
  [ -f "$OUT/eval-$1/report.json" ] || python -m draftforge eval --target "$TARGET" --drafter "$2" --bench "$3" \
    --temperature "$4" --methods "$5" --num-prompts "$EVAL_PROMPTS" --max-new-tokens "$NEW_TOKENS" --repeats 1 \
    --threads 1 --out "$OUT/eval-$1" --no-plots > "$OUT/eval-$1.log" 2>&1
  grep '^|' "$OUT/eval-$1/report.md" | head -20
}
suite e3-instructions-t0 "$OUT/eagle3/export" instructions 0 chain,tree,eagle2  # EAGLE-2 is greedy-only
suite e3-instructions-t1 "$OUT/eagle3/export" instructions 1 chain,tree
suite e3-humaneval "$OUT/eagle3/export" humaneval 0 chain,tree,eagle2
suite fm-instructions "$OUT/eagle3-mamba2/export" instructions 0,1 chain,tree
suite lookup-instructions prompt-lookup instructions 0,1 chain
suite lookup-humaneval prompt-lookup humaneval 0 chain

phase "C2T over the head: harvest EAGLE-2 pools on $C2T_PROMPTS unseen prompts, train the classifier, the τ–tokens sweep"
# Prompts neither the head trained on (it may have seen every training prompt) nor the sweep measures: the held-out
# split after its first 128 prompts (the α rows of eagle3_more_rows.sh), without the `instructions` bench's prompts
# and the modules of the evaluated ones. A classifier harvested on 16 prompts saw 17 held-out positives and gained
# nothing; 80 gave 219 (docs/results/eagle3.md §3).
[ -s "$OUT/heldout_prompts.jsonl" ] || python -m draftforge target prompts --split heldout --out "$OUT/heldout_prompts.jsonl"
[ -s "$OUT/c2t_e3_prompts.jsonl" ] || python - "$OUT/heldout_prompts.jsonl" "$EVAL_PROMPTS" "$C2T_PROMPTS" \
  "$OUT/c2t_e3_prompts.jsonl" <<'EOF'
import json, sys
from draftforge.data.instructions import heldout_path
rows = [json.loads(line) for line in open(sys.argv[1])]
bench = [json.loads(line) for line in open(heldout_path())]
measured, ids = {r["module"] for r in bench[: int(sys.argv[2])]}, {r["prompt_id"] for r in bench}
kept = [r for r in rows[128:] if r["module"] not in measured and r["prompt_id"] not in ids][: int(sys.argv[3])]
open(sys.argv[4], "w").writelines(json.dumps(r) + "\n" for r in kept)
print(f"{len(kept)} harvest prompts from {len({r['module'] for r in kept})} modules")
EOF
[ -f "$OUT/c2t-e3-harvest/harvest.json" ] || python -m draftforge harvest trees --target "$TARGET" \
  --drafter "$OUT/eagle3/export" --bench "$OUT/c2t_e3_prompts.jsonl" --max-new-tokens 64 --out "$OUT/c2t-e3-harvest"
[ -f "$OUT/c2t-e3/export/draftforge.json" ] || python -m draftforge train recipes/c2t.yaml $(resume_flag "$OUT/c2t-e3") \
  --set "output_dir=$OUT/c2t-e3" --set "model.target=$TARGET" --set "data.sources=[$OUT/c2t-e3-harvest]" \
  --set train.max_steps=1500 >> "$OUT/c2t-e3.log" 2>&1
[ -f "$OUT/tree_budget_e3/tree_budget.json" ] || python -m benchmarks.decoding.tree_budget --target "$TARGET" \
  --drafter "$OUT/eagle3/export" --bench instructions --c2t "$OUT/c2t-e3/export" --ns 4,8,16,32 --betas 0.3,0.5,0.7,0.9 \
  --chains 1,2,3 --chain-betas 0.3,0.5,0.7 \
  --eagle-top-k 10 --eagle-depth 5 --num-prompts "$EVAL_PROMPTS" --max-new-tokens "$NEW_TOKENS" --repeats 1 \
  --out "$OUT/tree_budget_e3" > "$OUT/tree_budget_e3.log" 2>&1
grep '^|' "$OUT/tree_budget_e3.log" || true

phase "step time and state against context (bf16, 1 thread)"
python -m benchmarks.micro.drafter_context --feature-target "$TARGET" --contexts 1024 2048 4096 8000 --steps 8 \
  --repeats 5 --out "$OUT/feature_context.json"
phase "done"
