#!/usr/bin/env bash
# The peers a user tries first, on SmolLM2-135M-Instruct in bf16, one suite at a time on a quiet machine:
# draftforge's prompt lookup (chain and STree's 13-token tree) next to transformers' prompt lookup, the
# trained Mamba2 drafter, and the Llama drafter with transformers' assisted generation; held-out
# instructions and HumanEval, T = 0 and 1. Every suite also writes Spec-Bench answer files (--answers).
#
#   bash benchmarks/pipelines/peers_smollm2.sh            # after smollm2_pipeline.sh (SKIP_EVAL=1 is enough)
#
# Environment (defaults in brackets): CACHE [~/.cache/draftforge]; PROMPTS [6] per bench; NEW_TOKENS [128];
# REPEATS [2]. A suite whose report exists is skipped (delete runs/smollm2/peers/<suite> to redo it); a
# missing drafter is skipped with a line. CPU budget: ~12 min per suite, 4 suites, one core.
source "$(dirname "$0")/common.sh"
CACHE="${CACHE:-$HOME/.cache/draftforge}"; PROMPTS="${PROMPTS:-6}"; NEW_TOKENS="${NEW_TOKENS:-128}"
REPEATS="${REPEATS:-2}"
TARGET="$CACHE/smollm2"; RUNS=runs/smollm2; OUT=$RUNS/peers
mkdir -p "$OUT"
python -m draftforge target smollm2 --cache "$CACHE" > /dev/null

suite() {  # name, drafter, methods, bench
  local dir="$OUT/$1-$4"
  if [ -s "$dir/report.json" ]; then echo "have $dir"; return; fi
  case "$2" in prompt-lookup*) ;; *) [ -f "$2/config.json" ] || { echo "no drafter $2: skipping $1"; return; } ;; esac
  local tree=(); case ",$3," in *,tree,*) tree=(--tree stree13) ;; esac
  phase "$1 on $4"
  python -m draftforge eval --target "$TARGET" --drafter "$2" --bench "$4" --methods "$3" --baseline ar \
    "${tree[@]}" --temperature 0,1 --num-prompts "$PROMPTS" --max-new-tokens "$NEW_TOKENS" --repeats "$REPEATS" \
    --threads 1 --out "$dir" --answers "$dir/answers" > "$dir.log" 2>&1 || echo "suite $1-$4 failed: see $dir.log"
  sed -n '/^| method | T | τ (+bonus)/,/^$/p' "$dir/report.md" 2>/dev/null || tail -3 "$dir.log"
}

suite lookup prompt-lookup ar,chain,tree,hf_prompt_lookup instructions
suite lookup prompt-lookup ar,chain,tree,hf_prompt_lookup humaneval
suite mamba2 "$RUNS/mamba2-sft/export" ar,chain,tree instructions
suite llama "$RUNS/llama-sft/export" ar,chain,hf_assisted instructions
phase "done"
