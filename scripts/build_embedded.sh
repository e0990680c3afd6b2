#!/usr/bin/env bash
# Rebuilds the embedded default pair from the CPython standard library, on CPU, resumably:
# re-running continues each step from where it stopped (checkpoints live in $WORK).
#   1. BPE tokenizer + pre-trained target      (jetflow_jax.embedded.pretrain)
#   2. snippet prompts from held-in files      (jetflow_jax.embedded.prompts)
#   3. the target's own continuations          (jetflow_jax.train.regenerate)
#   4. the two heads                           (train.py, configs/embedded.py)
#   5. the heads' held-out agreement           (jetflow_jax.embedded.head_eval)
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

mkdir -p "$WORK"
if [ ! -f "$OUT/target/model.safetensors" ]; then
  # --bf16 takes effect only where the CPU has native bfloat16 (AMX, AVX512-BF16).
  env OMP_WAIT_POLICY=PASSIVE $PY -m jetflow_jax.embedded.pretrain --workdir "$WORK/pretrain" \
      --out "$OUT/target" --tokens "$TOKENS" --bf16 --compile --threads "$THREADS"
fi
[ -f "$WORK/prompts.jsonl" ] || $PY -m jetflow_jax.embedded.prompts --tokenizer "$OUT/target" \
    --out "$WORK/prompts.jsonl" --count "$PROMPTS"
# Resumes by record id; transformers' generate decodes this target twice as fast as our loop.
$PY -m jetflow_jax.train.regenerate --backend torch --threads "$THREADS" --target "$OUT/target" \
    --prompts "$WORK/prompts.jsonl" --out "$WORK/regenerated.jsonl" --max-new-tokens 256 \
    --batch-size 64
# Side by side, one core each: same data, same steps.
for steps in $HEAD_STAGES; do
  # train.py stops at the data's end, so each stage gets the passes its steps need and one
  # spare (records regeneration could not use); a pass's order does not depend on how many
  # follow it.
  epochs=$(( steps * HEAD_BATCH / PROMPTS + 1 ))
  core=0 pids=()
  for kind in jetflow dflash; do
    taskset -c $core $PY train.py --config=configs/embedded.py:$kind --workdir="$WORK/head_$kind" \
        --config.data.prompts= --config.data.regenerated="$WORK/regenerated.jsonl" \
        --config.train.batch_size="$HEAD_BATCH" --config.train.epochs="$epochs" \
        --config.train.num_steps="$steps" &
    pids+=($!) core=$(( (core + 1) % $(nproc) ))
  done
  for pid in "${pids[@]}"; do wait "$pid"; done  # fails if either run failed
done
for kind in jetflow dflash; do
  rm -rf "$OUT/head_$kind" && cp -r "$WORK/head_$kind/hf_head" "$OUT/head_$kind"
done
# The heads' bar: top-1 agreement with the target on continuations of held-out files.
$PY -m jetflow_jax.embedded.head_eval --head "$OUT/head_jetflow" --head "$OUT/head_dflash" \
    --save-quality
