#!/usr/bin/env bash
# The real-target pipeline in one command: SmolLM2-135M-Instruct, its own answers as SFT data, a Mamba2
# and a Llama drafter of equal size (pretrain -> sft), then the speedup tables (docs/results/smollm2-drafters.md).
#
#   bash benchmarks/pipelines/smollm2_pipeline.sh
#
# Environment (defaults in brackets): CACHE [~/.cache/draftforge] where the target is prepared;
# GREEDY_PROMPTS [1000] prompts answered greedily and SAMPLED_PROMPTS [200] answered at T=1 (the first
# ones of the training split); EVAL_PROMPTS [3] per bench; NEW_TOKENS [128]; SKIP_EVAL=1 stops after
# training. Every phase resumes or is skipped when its output exists (generate resumes row by row; a
# finished training run is kept: delete runs/smollm2/<run> to retrain it). The two drafters train side by
# side (1 thread each); the eval suites run two at a time (1 thread each). Wall times: docs/results/smollm2-drafters.md.
source "$(dirname "$0")/common.sh"  # strict mode, cd to the repository root, OMP_NUM_THREADS=1, phase
CACHE="${CACHE:-$HOME/.cache/draftforge}"; GREEDY_PROMPTS="${GREEDY_PROMPTS:-1000}"
SAMPLED_PROMPTS="${SAMPLED_PROMPTS:-200}"; EVAL_PROMPTS="${EVAL_PROMPTS:-3}"; NEW_TOKENS="${NEW_TOKENS:-128}"
OUT=runs/smollm2
mkdir -p "$OUT"

phase "target: SmolLM2-135M-Instruct (cached after the first run)"
python -m draftforge target smollm2 --cache "$CACHE"
TARGET="$CACHE/smollm2"
[ "$TARGET" -ef "$HOME/.cache/draftforge/smollm2" ] || echo "note: recipes/smollm2/*.yaml name ~/.cache/draftforge/smollm2; edit model.target to $TARGET"

phase "data: stdlib code corpus (pretrain) + training-split instruction prompts"
# without the modules whose instruction and long-context prompts are held out (the corpus's own split is by file)
[ -s "$OUT/corpus_train.jsonl" ] || python -c "from draftforge.testbed import write_corpus_jsonl as w
from draftforge.data.instructions import feeds_heldout_prompts as held
w('$OUT/corpus_train.jsonl', exclude=held)"
python -c "import json, sys; from draftforge.data.instructions import feeds_heldout_prompts as held
bad = [r['source'] for r in map(json.loads, open('$OUT/corpus_train.jsonl')) if held(r['source'])]
sys.exit(f'$OUT/corpus_train.jsonl holds {len(bad)} files of modules whose prompts are held out ({bad[0]}, ...): '
         'it was written before they were left out; move it away and run again to write it without them' if bad else 0)"
[ -s "$OUT/train_prompts.jsonl" ] || python -m draftforge target prompts --split train --out "$OUT/train_prompts.jsonl"

phase "generate: greedy answers to $GREEDY_PROMPTS prompts, T=1 answers to $SAMPLED_PROMPTS (resumable)"
gen() { python -m draftforge generate --target "$TARGET" --prompts "$OUT/train_prompts.jsonl" --max-new-tokens 192 \
          --batch-size 32 --threads 2 --out "$OUT/sft_rows.jsonl" "$@"; }
gen -n "$GREEDY_PROMPTS" --temperature 0
gen -n "$SAMPLED_PROMPTS" --temperature 1

phase "train: Mamba2 and Llama drafters side by side (pretrain, then sft)"
train() {  # run directory name, recipe name
  [ -f "$OUT/$1/export/config.json" ] || python -m draftforge train "recipes/smollm2/$2.yaml" $(resume_flag "$OUT/$1") \
    >> "$OUT/$2.log" 2>&1
}
for arch in mamba2 llama; do
  ( train "$arch-pretrain" "pretrain-$arch" && train "$arch-sft" "sft-$arch" ) &
done
wait
grep -h "done:" "$OUT"/pretrain-*.log "$OUT"/sft-*.log || true
[ "${SKIP_EVAL:-0}" = 1 ] && { phase "done (SKIP_EVAL=1)"; exit 0; }

phase "eval: HumanEval + held-out instructions, T=0 and T=1, median of 3, two suites at a time"
suite() {  # bench, drafter kind, drafter dir
  python -m benchmarks.decoding.spec_decode --target "$TARGET" "--$2-drafter" "$3" --bench "$1" --num-prompts "$EVAL_PROMPTS" \
    --max-new-tokens "$NEW_TOKENS" --repeats 3 --out "$OUT/eval-$1-$2" > "$OUT/eval-$1-$2.log" 2>&1
}
for bench in humaneval instructions; do
  suite "$bench" mamba "$OUT/mamba2-sft/export" & suite "$bench" transformer "$OUT/llama-sft/export" & wait
done
python -m benchmarks.decoding.drafter_tv --target "$TARGET" --drafter "$OUT/mamba2-sft/export" --drafter "$OUT/llama-sft/export" \
  --num-prompts 4 --max-new-tokens 64 --dtype float32 --out "$OUT/drafter_tv.json" > "$OUT/drafter_tv.log" 2>&1
python -m benchmarks.micro.drafter_context --drafter "$OUT/mamba2-sft/export" --drafter "$OUT/llama-sft/export" \
  --contexts 1024 4096 8000 --steps 8 --out "$OUT/drafter_context.json"
for f in "$OUT"/eval-*.log; do echo "--- $f"; grep '^|' "$f" || tail -5 "$f"; done
cat "$OUT/drafter_tv.log"
phase "done"
