#!/usr/bin/env bash
# The real-target pipeline in one command: SmolLM2-135M-Instruct, its own answers as SFT data, a Mamba2
# and a Llama drafter of equal size (pretrain -> sft), then the speedup tables (README "Drafters for SmolLM2").
#
#   bash benchmarks/smollm2_pipeline.sh            # env: CACHE (default /tmp/h1dl/cache), N_PROMPTS (48),
#                                                  #      EVAL_PROMPTS (1), NEW_TOKENS (32)
# Independent phases run side by side (the two drafters train together; the four eval suites and the TV
# measurement run together). generate resumes; training uses --overwrite. Defaults are what fit a 2-core CPU
# shared with other work (load 10-17) in about an hour; on a quiet machine or a GPU raise EVAL_PROMPTS,
# NEW_TOKENS (128) and the recipes' max_steps. Wall times: README "Drafters for SmolLM2".
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
CACHE="${CACHE:-/tmp/h1dl/cache}"; N_PROMPTS="${N_PROMPTS:-48}"; EVAL_PROMPTS="${EVAL_PROMPTS:-1}"
NEW_TOKENS="${NEW_TOKENS:-32}"; OUT=runs/smollm2
T0=$SECONDS
phase() { echo "== [$((SECONDS - T0)) s] $*"; }
mkdir -p "$OUT"

phase "target: SmolLM2-135M-Instruct (cached after the first run)"
python -m draftforge target smollm2 --cache "$CACHE"
TARGET="$CACHE/smollm2"

phase "data: stdlib code corpus (pretrain) + training-split instruction prompts"
[ -s "$OUT/corpus_train.jsonl" ] || python -c "from draftforge.testbed import write_corpus_jsonl as w; w('$OUT/corpus_train.jsonl')"
[ -s "$OUT/train_prompts.jsonl" ] || python -m draftforge target prompts --split train --out "$OUT/train_prompts.jsonl"

phase "generate: the target answers $N_PROMPTS prompts greedily and at T=1 (resumable)"
python -m draftforge generate --target "$TARGET" --prompts "$OUT/train_prompts.jsonl" -n "$N_PROMPTS" \
  --temperature 0 1 --max-new-tokens 96 --batch-size 16 --out "$OUT/sft_rows.jsonl"

phase "train: Mamba2 and Llama drafters side by side (pretrain, then sft)"
for arch in mamba2 llama; do
  ( python -m draftforge train "recipes/smollm2/pretrain-$arch.yaml" --overwrite > "$OUT/pretrain-$arch.log" 2>&1 &&
    python -m draftforge train "recipes/smollm2/sft-$arch.yaml" --overwrite > "$OUT/sft-$arch.log" 2>&1 ) &
done
wait

phase "eval: HumanEval + held-out instructions, T=0 and T=1, median of 3 (four suites side by side)"
for bench in humaneval instructions; do
  python benchmarks/spec_decode.py --target "$TARGET" --mamba-drafter "$OUT/mamba2-sft/export" --bench "$bench" \
    --num-prompts "$EVAL_PROMPTS" --max-new-tokens "$NEW_TOKENS" --repeats 3 --out "$OUT/eval-$bench-mamba" \
    > "$OUT/eval-$bench-mamba.log" 2>&1 &
  python benchmarks/spec_decode.py --target "$TARGET" --transformer-drafter "$OUT/llama-sft/export" --bench "$bench" \
    --num-prompts "$EVAL_PROMPTS" --max-new-tokens "$NEW_TOKENS" --repeats 3 --out "$OUT/eval-$bench-llama" \
    > "$OUT/eval-$bench-llama.log" 2>&1 &
done
python benchmarks/drafter_tv.py --target "$TARGET" --drafter "$OUT/mamba2-sft/export" --drafter "$OUT/llama-sft/export" \
  --num-prompts 4 --max-new-tokens 64 --out "$OUT/drafter_tv.json" > "$OUT/drafter_tv.log" 2>&1 &
wait
python benchmarks/drafter_context.py --drafter "$OUT/mamba2-sft/export" --drafter "$OUT/llama-sft/export" \
  --contexts 1024 4096 8000 --steps 8 --out "$OUT/drafter_context.json"
for f in "$OUT"/eval-*.log; do echo "--- $f"; grep '^|' "$f" || tail -5 "$f"; done
cat "$OUT/drafter_tv.log"
phase "done"
