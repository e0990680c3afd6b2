#!/usr/bin/env bash
# Rebuilds the embedded default pair from the CPython standard library, on CPU, resumably:
# re-running continues each step from where it stopped (checkpoints live in $WORK).
#   1. BPE tokenizer + pre-trained target      (jetflow_jax.embedded.pretrain)
#   2. snippet prompts from held-in files      (jetflow_jax.embedded.prompts)
#   3. the target's own continuations          (jetflow_jax.train.regenerate)
#   4. the two heads                           (train.py, configs/embedded.py)
#   5. fresh prompts, a third HumanEval-shaped, their continuations, and a last head stage
#   6. the heads' held-out agreement           (jetflow_jax.embedded.head_eval)
# Finished checkpoints land in jetflow_jax/embedded/checkpoints/ (bfloat16).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORK=${WORK:-runs/embedded}
OUT=jetflow_jax/embedded/checkpoints
TOKENS=${TOKENS:-10e6}
THREADS=${THREADS:-2}  # one is faster when something else shares the 2 cores
PROMPTS=${PROMPTS:-16000}
# Both heads, HEAD_BATCH continuations a step over the target's continuations of $PROMPTS
# snippets, in stages: each resumes the last and restarts the cosine schedule over its own
# total steps.
HEAD_STAGES=${HEAD_STAGES:-"800 2000 3200"}  # the shipped heads
HEAD_BATCH=${HEAD_BATCH:-16}
# The last stage: each head fine-tuned from its staged state on fresh continuations (snippets
# drawn with another seed, and documented functions' signature and docstring, the shape of a
# HumanEval prompt), with a fresh optimizer and schedule.
FRESH_SNIPPETS=${FRESH_SNIPPETS:-12000}
FUNCTIONS=${FUNCTIONS:-6000}
FINAL_STEPS=${FINAL_STEPS:-2000}
FINAL_LR=${FINAL_LR:-8e-4}

mkdir -p "$WORK"
if [ ! -f "$OUT/target/model.safetensors" ]; then
  # --bf16 takes effect only where the CPU has native bfloat16 (AMX, AVX512-BF16).
  env OMP_WAIT_POLICY=PASSIVE $PY -m jetflow_jax.embedded.pretrain --workdir "$WORK/pretrain" \
      --out "$OUT/target" --tokens "$TOKENS" --bf16 --compile --threads "$THREADS"
fi
[ -f "$WORK/prompts.jsonl" ] || $PY -m jetflow_jax.embedded.prompts --tokenizer "$OUT/target" \
    --out "$WORK/prompts.jsonl" --count "$PROMPTS"
# Resumes by record id; transformers' generate decodes this target twice as fast as our loop.
regenerate() {
  $PY -m jetflow_jax.train.regenerate --backend torch --threads "$THREADS" --target "$OUT/target" \
      --prompts "$1" --out "$2" --max-new-tokens 256 --batch-size 64
}
train_heads() {  # Side by side, one core each: same data, same steps. Extra arguments go to both.
  local core=0 pids=()
  for kind in jetflow dflash; do
    taskset -c $core $PY train.py --config=configs/embedded.py:$kind --config.data.prompts= \
        --config.train.batch_size="$HEAD_BATCH" "${@//KIND/$kind}" &
    pids+=($!) core=$(( (core + 1) % $(nproc) ))
  done
  for pid in "${pids[@]}"; do wait "$pid"; done  # fails if either run failed
}
regenerate "$WORK/prompts.jsonl" "$WORK/regenerated.jsonl"
for steps in $HEAD_STAGES; do
  # train.py stops at the data's end, so each stage gets the passes its steps need and one
  # spare (records regeneration could not use); a pass's order does not depend on how many
  # follow it.
  train_heads --workdir="$WORK/head_KIND" --config.data.regenerated="$WORK/regenerated.jsonl" \
      --config.train.epochs=$(( steps * HEAD_BATCH / PROMPTS + 1 )) \
      --config.train.num_steps="$steps"
done
if [ ! -f "$WORK/prompts_final.jsonl" ]; then
  # Seed 3: neither the first prompts' (0) nor head_eval's fresh snippets' (2).
  $PY -m jetflow_jax.embedded.prompts --tokenizer "$OUT/target" --out "$WORK/snippets3.jsonl" \
      --count "$FRESH_SNIPPETS" --seed 3
  $PY -m jetflow_jax.embedded.prompts --tokenizer "$OUT/target" --out "$WORK/functions.jsonl" \
      --count "$FUNCTIONS" --kind function --prompt-tokens 96
  cat "$WORK/snippets3.jsonl" "$WORK/functions.jsonl" > "$WORK/prompts_final.jsonl"
fi
regenerate "$WORK/prompts_final.jsonl" "$WORK/regenerated_final.jsonl"
final_records=$(( FRESH_SNIPPETS + FUNCTIONS ))
train_heads --workdir="$WORK/head_final_KIND" --config.train.init_head="$WORK/head_KIND" \
    --config.data.regenerated="$WORK/regenerated_final.jsonl" --config.train.lr="$FINAL_LR" \
    --config.train.epochs=$(( FINAL_STEPS * HEAD_BATCH / final_records + 1 )) \
    --config.train.num_steps="$FINAL_STEPS"
for kind in jetflow dflash; do
  rm -rf "$OUT/head_$kind" && cp -r "$WORK/head_final_$kind/hf_head" "$OUT/head_$kind"
done
# The heads' bar: top-1 agreement with the target on continuations of held-out files.
$PY -m jetflow_jax.embedded.head_eval --head "$OUT/head_jetflow" --head "$OUT/head_dflash" \
    --save-quality
