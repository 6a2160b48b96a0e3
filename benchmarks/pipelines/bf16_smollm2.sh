#!/usr/bin/env bash
# SmolLM2-135M-Instruct in bf16 (dtype auto on a CPU with AVX512-BF16 / AMX): the fair-baseline check, bf16 vs fp32
# generation, and the speedup tables with the cost model (predicted next to measured) for the drafters that
# benchmarks/pipelines/smollm2_pipeline.sh trains, plus the model-free prompt-lookup drafter and transformers' own peers.
#
#   bash benchmarks/pipelines/bf16_smollm2.sh                  # after smollm2_pipeline.sh (SKIP_EVAL=1 is enough)
#
# Environment (defaults in brackets): CACHE [~/.cache/draftforge]; PROMPTS [6] per bench; NEW_TOKENS [128];
# REPEATS [3]; PARALLEL [2] eval suites at a time (1 torch thread each). Every phase is skipped when its report
# exists (delete runs/smollm2/bf16/<phase> to redo it); a drafter that is missing is skipped with a line.
# CPU budget on 2 cores: ~5 min for the baseline checks, ~10-15 min per eval suite (6 suites).
source "$(dirname "$0")/common.sh"  # strict mode, cd to the repository root, OMP_NUM_THREADS=1, phase
CACHE="${CACHE:-$HOME/.cache/draftforge}"; PROMPTS="${PROMPTS:-6}"; NEW_TOKENS="${NEW_TOKENS:-128}"
REPEATS="${REPEATS:-3}"; PARALLEL="${PARALLEL:-2}"
TARGET="$CACHE/smollm2"; RUNS=runs/smollm2; OUT=$RUNS/bf16
mkdir -p "$OUT"
python -m draftforge target smollm2 --cache "$CACHE" > /dev/null

phase "fair baseline: harness AR vs transformers generate(), bf16 and fp32"
[ -s "$OUT/ar_baseline.json" ] || python -m benchmarks.decoding.ar_baseline --target "$TARGET" --bench instructions \
  --dtype bfloat16 --dtype float32 --num-prompts 4 --max-new-tokens "$NEW_TOKENS" --repeats 3 \
  --out "$OUT/ar_baseline.json" > "$OUT/ar_baseline.log" 2>&1
grep '^|' "$OUT/ar_baseline.log" || tail -3 "$OUT/ar_baseline.log"

phase "generation: bf16 vs fp32 tokens/s and greedy agreement"
[ -s "$OUT/generate_precision.json" ] || python -m benchmarks.decoding.generate_precision --target "$TARGET" --num-prompts 32 \
  --batch-size 16 --max-new-tokens 96 --repeats 2 --out "$OUT/generate_precision.json" > "$OUT/generate_precision.log" 2>&1
grep '^|' "$OUT/generate_precision.log" || tail -3 "$OUT/generate_precision.log"

suite() {  # name, drafter, methods (comma list), bench
  local dir="$OUT/$1-$4"
  if [ -s "$dir/report.json" ]; then echo "have $dir"; return; fi
  case "$2" in prompt-lookup*) ;; *) [ -f "$2/config.json" ] || { echo "no drafter $2: skipping $1"; return; } ;; esac
  python -m draftforge eval --target "$TARGET" --drafter "$2" --bench "$4" --methods "$3" --baseline ar \
    --temperature 0,1 --num-prompts "$PROMPTS" --max-new-tokens "$NEW_TOKENS" --repeats "$REPEATS" --threads 1 \
    --out "$dir" > "$dir.log" 2>&1 || echo "suite $1-$4 failed: see $dir.log"
}

phase "eval suites: Mamba2, Llama, prompt lookup on instructions and HumanEval, T = 0 and 1 ($PARALLEL at a time)"
jobs=()
for bench in instructions humaneval; do jobs+=("lookup prompt-lookup ar,chain,tree,hf_prompt_lookup $bench"); done
for bench in instructions humaneval; do jobs+=("llama $RUNS/llama-sft/export ar,chain,tree,hf_assisted $bench"); done
for bench in instructions humaneval; do jobs+=("mamba2 $RUNS/mamba2-sft/export ar,chain,tree,ucb $bench"); done
running=0
for j in "${jobs[@]}"; do
  # shellcheck disable=SC2086
  suite $j &
  running=$((running + 1))
  if [ "$running" -ge "$PARALLEL" ]; then wait -n; running=$((running - 1)); fi
done
wait

phase "fp32 contrast: the Mamba2 suite on instructions at T = 0 in float32"
dir="$OUT/mamba2-instructions-fp32"
[ -s "$dir/report.json" ] || [ ! -f "$RUNS/mamba2-sft/export/config.json" ] || python -m draftforge eval \
  --target "$TARGET" --drafter "$RUNS/mamba2-sft/export" --bench instructions --methods ar,chain,tree,ucb \
  --temperature 0 --num-prompts "$PROMPTS" --max-new-tokens "$NEW_TOKENS" --repeats "$REPEATS" --threads 1 \
  --dtype float32 --out "$dir" > "$dir.log" 2>&1 || echo "fp32 suite failed: see $dir.log"

for f in "$OUT"/*/report.md; do echo "--- $f"; sed -n '/^| method | T | τ (+bonus)/,/^$/p' "$f"; \
  sed -n '/^| method | T | τ | rows/,/^$/p' "$f"; done
phase "done"
