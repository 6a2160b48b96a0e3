#!/usr/bin/env bash
# Drafters that accept more, on SmolLM2-135M-Instruct (docs/results/drafter-data.md): the Mamba2 drafter of
# smollm2_pipeline.sh (SFT on the target's greedy tokens) against the same drafter distilled from the target's
# stored top-32 distributions (KL, then TVD = 1 - alpha), then on more in-domain data (902 code completions of
# stdlib function headers + 1,200 more instruction answers), then a width/depth sweep, then longer runs with and
# without 1,702 answers the target sampled at T = 1 (each rows file its own cache); α, top-1 and τ of each
# on held-out instructions and HumanEval (benchmarks/decoding/drafter_tv.py, exact counts, no clock), each
# size's drafter step timed through the harness (benchmarks/micro/drafter_context.py).
#
#   bash benchmarks/pipelines/drafter_data_smollm2.sh      # after smollm2_pipeline.sh SKIP_EVAL=1
#
# Environment (defaults in brackets): CACHE [~/.cache/draftforge]; MORE_PROMPTS [1200] extra instruction
# prompts answered; STEPS [250] distill steps on the SFT rows, SCALE_STEPS [500] on all rows, SWEEP_STEPS [120]
# per sweep size; LONG_STEPS [1500] for the two longer runs; TV_PROMPTS [16] per bench. Every phase resumes or is skipped when its output exists:
# generate resumes row by row, a harvest continues with --resume, a stopped run from its latest checkpoint, a
# finished run is kept (delete runs/smollm2/<run> to retrain it), a measured drafter is not measured again. CPU budget on a 2-core Zen 5,
# 1 thread per process, two processes at a time: generation ~45 min, harvests ~10 min per 1,200 rows,
# distill ~3.5 s per step of 16 x 256 tokens (~1.5 s with one other process), drafter_tv ~2 min per drafter
# and bench; the T = 1 answers ~35 min, their harvests ~10 min, the two longer runs ~45 min side by side.
source "$(dirname "$0")/common.sh"  # strict mode, cd to the repository root, OMP_NUM_THREADS=1, phase
CACHE="${CACHE:-$HOME/.cache/draftforge}"; MORE_PROMPTS="${MORE_PROMPTS:-1200}"; STEPS="${STEPS:-250}"
SCALE_STEPS="${SCALE_STEPS:-500}"; SWEEP_STEPS="${SWEEP_STEPS:-120}"; TV_PROMPTS="${TV_PROMPTS:-16}"
TARGET="$CACHE/smollm2"; OUT=runs/smollm2
for need in "$OUT/sft_rows.jsonl" "$OUT/train_prompts.jsonl" "$OUT/mamba2-pretrain/export/config.json"; do
  [ -e "$need" ] || { echo "missing $need: run benchmarks/pipelines/smollm2_pipeline.sh (SKIP_EVAL=1) first"; exit 1; }
done

phase "data: 902 code-completion rows + $MORE_PROMPTS more instruction answers (greedy, bf16, resumable)"
[ -s "$OUT/code_prompts.jsonl" ] || python -m draftforge target prompts --kind code --split train --out "$OUT/code_prompts.jsonl"
[ -s "$OUT/more_prompts.jsonl" ] || sed -n "1201,$((1200 + MORE_PROMPTS))p" "$OUT/train_prompts.jsonl" > "$OUT/more_prompts.jsonl"
gen() { python -m draftforge generate --target "$TARGET" --temperature 0 --batch-size 16 --threads 1 "$@"; }
gen --prompts "$OUT/code_prompts.jsonl" --max-new-tokens 128 --out "$OUT/code_rows.jsonl" &
gen --prompts "$OUT/more_prompts.jsonl" -n "$MORE_PROMPTS" --max-new-tokens 192 --out "$OUT/more_rows.jsonl" &
wait
if [ ! -s "$OUT/all_rows.jsonl" ]; then  # one rows file (a logits cache belongs to one), with the target's sidecar
  cat "$OUT/sft_rows.jsonl" "$OUT/code_rows.jsonl" "$OUT/more_rows.jsonl" > "$OUT/all_rows.jsonl.tmp"
  cp "$OUT/code_rows.jsonl.meta.json" "$OUT/all_rows.jsonl.meta.json"
  mv "$OUT/all_rows.jsonl.tmp" "$OUT/all_rows.jsonl"
fi
wc -l "$OUT"/sft_rows.jsonl "$OUT"/code_rows.jsonl "$OUT"/more_rows.jsonl "$OUT"/all_rows.jsonl

phase "harvest: the target's top-32 over the drafter's 8,192 ids, on the SFT rows and on all rows"
harvest() {  # rows, cache dir
  local again=(); [ -f "$2/harvest.json" ] && again=(--resume)
  python -m draftforge harvest logits --target "$TARGET" --data "$1" --out "$2" --draft-vocab "$OUT/mamba2-pretrain" \
    --top-k 32 --max-len 256 --threads 1 "${again[@]}" > "$2.log" 2>&1 || { tail -3 "$2.log"; exit 1; }
  tail -1 "$2.log"
}
harvest "$OUT/sft_rows.jsonl" "$OUT/logits-sft" & harvest "$OUT/all_rows.jsonl" "$OUT/logits-all" & wait

phase "train: distill KL and TVD on the SFT rows, then the better loss on all rows (two at a time)"
train() {  # run name, then --set overrides
  local name=$1; shift
  [ -f "$OUT/$name/export/config.json" ] && return 0
  python -m draftforge train recipes/smollm2/distill-mamba2.yaml $(resume_flag "$OUT/$name") --set "output_dir=$OUT/$name" \
    "$@" >> "$OUT/$name.log" 2>&1 || { echo "$name failed: see $OUT/$name.log"; return 1; }
}
train mamba2-distill-kl --set "train.max_steps=$STEPS" & train mamba2-distill-tvd --set distill.loss=tvd \
  --set "train.max_steps=$STEPS" & wait
LOSS="${LOSS:-kl}"  # docs/results/drafter-data.md: KL and TVD tie at T=1 on the SFT rows, KL has the higher top-1
all=(--set "data.sources=[$OUT/all_rows.jsonl]" --set "distill.logits_cache=$OUT/logits-all" --set "distill.loss=$LOSS")
train mamba2-distill-all "${all[@]}" --set "train.max_steps=$SCALE_STEPS" &
for size in 2x256 4x256 8x256 4x512; do  # from scratch (embedding: the target's top principal directions), SFT rows
  layers=${size%x*}; width=${size#*x}
  train "mamba2-size-$size" --set "distill.loss=$LOSS" --set "train.max_steps=$SWEEP_STEPS" --set train.eval_every=40 \
    --set train.save_every=40 --set model.init_from=null \
    --set model.arch=mamba2 --set model.embed_from_target=true --set model.draft_vocab=8192 \
    --set "model.draft_vocab_from=$OUT/sft_rows.jsonl" \
    --set "model.overrides={hidden_size: $width, num_hidden_layers: $layers, head_dim: 32, state_size: 32}"
done
# the Llama drafter of smollm2_pipeline.sh (2 layers x 256, same 8,192 draft ids), distilled as mamba2-distill-kl
train llama-distill-kl --set "model.init_from=$OUT/llama-pretrain"
wait

phase "sampled answers: the target at T=1 on 800 new instructions and the code prompts, each file its own cache"
# α at T = 1 is measured on contexts the target *sampled*; every row above is greedy. These rows put sampled
# contexts into training; each rows file gets a cache of its own (distill.logits_cache as a list), so the
# 3,302 rows above are not harvested again.
[ -s "$OUT/t1_prompts.jsonl" ] || sed -n "2401,3200p" "$OUT/train_prompts.jsonl" > "$OUT/t1_prompts.jsonl"
gen --prompts "$OUT/t1_prompts.jsonl" --temperature 1 --max-new-tokens 192 --out "$OUT/instr_t1_rows.jsonl" &
gen --prompts "$OUT/code_prompts.jsonl" --temperature 1 --max-new-tokens 128 --seed 1 --out "$OUT/code_t1_rows.jsonl" &
wait
harvest "$OUT/code_t1_rows.jsonl" "$OUT/logits-code-t1" & harvest "$OUT/instr_t1_rows.jsonl" "$OUT/logits-instr-t1" &
wait
LONG_STEPS="${LONG_STEPS:-1500}"  # the same schedule stretched: steps alone, then steps + sampled rows
train mamba2-distill-all-long "${all[@]}" --set "train.max_steps=$LONG_STEPS" --set train.eval_every=100 \
  --set train.save_every=100 &
train mamba2-distill-t1 --set "distill.loss=$LOSS" --set "train.max_steps=$LONG_STEPS" --set train.eval_every=100 \
  --set train.save_every=100 \
  --set "data.sources=[$OUT/all_rows.jsonl,$OUT/code_t1_rows.jsonl,$OUT/instr_t1_rows.jsonl]" \
  --set "distill.logits_cache=[$OUT/logits-all,$OUT/logits-code-t1,$OUT/logits-instr-t1]" &
wait

phase "measure: α, top-1 and τ per drafter on held-out instructions and HumanEval; step time per drafter"
drafters=()
for run in mamba2-sft mamba2-distill-kl mamba2-distill-tvd mamba2-distill-all mamba2-size-2x256 mamba2-size-4x256 \
           mamba2-size-8x256 mamba2-size-4x512 llama-sft llama-distill-kl; do
  [ -f "$OUT/$run/export/config.json" ] && drafters+=(--drafter "$OUT/$run/export")
done
mkdir -p "$OUT/drafter-data"
for bench in instructions humaneval; do
  [ -s "$OUT/drafter-data/tv-$bench.json" ] || python -m benchmarks.decoding.drafter_tv --target "$TARGET" \
    "${drafters[@]}" --bench "$bench" --num-prompts "$TV_PROMPTS" --max-new-tokens 64 --dtype float32 \
    --out "$OUT/drafter-data/tv-$bench.json" > "$OUT/drafter-data/tv-$bench.log" 2>&1 &
done
wait
[ -s "$OUT/drafter-data/step.json" ] || python -m benchmarks.micro.drafter_context "${drafters[@]}" --contexts 256 \
  --steps 32 --out "$OUT/drafter-data/step.json" > "$OUT/drafter-data/step.log" 2>&1
cat "$OUT/drafter-data/tv-instructions.log" "$OUT/drafter-data/tv-humaneval.log" "$OUT/drafter-data/step.log"
long=()  # the longer runs in the dtype eval decodes in (bf16 here), against the 500-step one
for run in mamba2-distill-all mamba2-distill-all-long mamba2-distill-t1; do
  [ -f "$OUT/$run/export/config.json" ] && long+=(--drafter "$OUT/$run/export")
done
for bench in instructions humaneval; do
  [ -s "$OUT/drafter-data/tv-long-$bench.json" ] || python -m benchmarks.decoding.drafter_tv --target "$TARGET" \
    "${long[@]}" --bench "$bench" --num-prompts "$TV_PROMPTS" --max-new-tokens 64 \
    --out "$OUT/drafter-data/tv-long-$bench.json" > "$OUT/drafter-data/tv-long-$bench.log" 2>&1 &
done
wait
cat "$OUT/drafter-data/tv-long-instructions.log" "$OUT/drafter-data/tv-long-humaneval.log"
phase "done"
