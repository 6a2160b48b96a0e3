#!/usr/bin/env bash
# STree on a real-text hybrid, in one command (docs/results/hybrid-stree.md): the SmolLM2 hybrid (3 of 30 attention layers as Mamba2,
# recipes/hybrid/smollm2_hybrid.yaml), its Mamba2 drafter distilled from it (recipes/hybrid/smollm2_drafter.yaml),
# then on held-out instructions and HumanEval, T = 0 and 1, medians of 3 rotated repeats:
#   1. AR vs chain (4 drafts) vs STree (`stree13`, the paper's 13-token tree) vs UCB (benchmarks/pipelines/hybrid_testbed.py),
#      tree siblings at T = 1 drawn without replacement (default), then at T = 1 again with i.i.d. siblings;
#   2. τ without a clock on 16 prompts per bench (benchmarks/decoding/tree_acceptance.py): chain vs stree13 (depth 4) vs
#      6,1 (depth 2) vs 12 (depth 1), all 13 tokens, distinct and i.i.d. siblings at T = 1; then chain and stree13
#      with the drafter before distillation (runs/smollm2/mamba2-sft/export), what distilling from the hybrid gave;
#   3. STree's runtime model t(N) fitted from measured verifications, its predicted speedups next to 1.'s
#      (benchmarks/decoding/hybrid_runtime.py).
# Needs `draftforge target smollm2` and runs/smollm2/mamba2-sft/export + sft_rows.jsonl
# (benchmarks/pipelines/smollm2_pipeline.sh). Environment: NUM_PROMPTS [6] per bench, EVAL_TOKENS [128] per timed answer,
# NEW_TOKENS [64] per answer of the untimed τ runs, DRAFTER_THREADS [2]
# (torch threads of the drafter's distillation: 1 when anything else runs on a 2-core machine).
# Finished runs are kept (delete runs/hybrid/smollm2* to redo them). Two timed processes at a time, 1 thread each.
source "$(dirname "$0")/common.sh"  # strict mode, cd to the repository root, OMP_NUM_THREADS=1, phase
NUM_PROMPTS="${NUM_PROMPTS:-6}"; NEW_TOKENS="${NEW_TOKENS:-64}"; EVAL_TOKENS="${EVAL_TOKENS:-128}"
OUT=runs/hybrid; TARGET=$OUT/smollm2/export; DRAFTER=$OUT/smollm2-drafter/export

phase "target: the SmolLM2 hybrid (convert, distil the new mixers against SmolLM2)"
[ -f "$OUT/smollm2-init/config.json" ] || python -m benchmarks.pipelines.hybrid_smollm2 convert --share 0.1 \
  --out "$OUT/smollm2-init" --corpus "$OUT/corpus"
[ -f "$TARGET/draftforge.json" ] || python -m draftforge train recipes/hybrid/smollm2_hybrid.yaml \
  $(resume_flag "$OUT/smollm2") >> "$OUT/hybrid_distill.log" 2>&1
[ -s "$OUT/hybrid_compare.json" ] || python -m benchmarks.pipelines.hybrid_smollm2 compare "$OUT/smollm2-init" "$TARGET" \
  > "$OUT/hybrid_compare.json" 2> "$OUT/hybrid_compare.log"

phase "drafter: the SmolLM2 Mamba2 drafter distilled from the hybrid (KL, τ = 1)"
[ -f "$DRAFTER/draftforge.json" ] || OMP_NUM_THREADS="${DRAFTER_THREADS:-2}" python -m draftforge train recipes/hybrid/smollm2_drafter.yaml \
  $(resume_flag "$OUT/smollm2-drafter") >> "$OUT/drafter_distill.log" 2>&1
grep -h "done:" "$OUT/drafter_distill.log" || true

[ "${SKIP_EVAL:-0}" = 1 ] && { phase "done (SKIP_EVAL=1)"; exit 0; }
testbed() {  # bench, report dir, more hybrid_testbed.py flags
  local bench=$1 out=$2; shift 2
  python -m benchmarks.pipelines.hybrid_testbed --target "$TARGET" --drafter "$DRAFTER" --bench "$bench" --tree stree13 \
    --num-prompts "$NUM_PROMPTS" --max-new-tokens "$EVAL_TOKENS" --eval-out "$out" "$@" > "$out.log" 2>&1
}
phase "eval 1: AR vs chain vs stree13 vs UCB, instructions and HumanEval side by side"
testbed instructions "$OUT/eval-instructions" & testbed humaneval "$OUT/eval-humaneval" & wait
tail -n 14 "$OUT/eval-instructions.log" "$OUT/eval-humaneval.log"
phase "eval 1b: the same at T = 1 with i.i.d. sibling drafts (--tree-draws iid, SpecInfer's sampling)"
testbed instructions "$OUT/eval-instructions-iid" --temperatures 1 --tree-draws iid &
testbed humaneval "$OUT/eval-humaneval-iid" --temperatures 1 --tree-draws iid & wait

acceptance() {  # drafter, bench, output name, trees...
  local drafter=$1 bench=$2 name=$3; shift 3
  python -m benchmarks.decoding.tree_acceptance --target "$TARGET" --drafter "$drafter" --bench "$bench" "$@" \
    --num-prompts 16 --max-new-tokens "$NEW_TOKENS" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
}
phase "eval 2: τ on 16 prompts per bench, depth vs width at 13 tokens, distinct vs i.i.d. siblings"
for bench in instructions humaneval; do
  acceptance "$DRAFTER" $bench tree_acceptance-$bench --tree stree13 --tree 6,1 --tree 12 &
done; wait
for bench in instructions humaneval; do
  acceptance runs/smollm2/mamba2-sft/export $bench tree_acceptance-undistilled-$bench --tree stree13 &
done; wait
tail -n 13 "$OUT"/tree_acceptance-instructions.log "$OUT"/tree_acceptance-humaneval.log

phase "runtime model: t(N) of chains 1..16 and the trees, predicted vs measured speedups of eval 1"
python -m benchmarks.decoding.hybrid_runtime --target "$TARGET" --report "$OUT/eval-instructions/report.json" \
  --report "$OUT/eval-instructions-iid/report.json" --report "$OUT/eval-humaneval/report.json" \
  --tree stree13 --tree 6,1 --tree 12 --repeats 5 > "$OUT/runtime.json" 2> "$OUT/runtime.log"
tail -n 30 "$OUT/runtime.log"
phase "done"
