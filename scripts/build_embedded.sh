#!/usr/bin/env bash
# Rebuilds the embedded default pair from the CPython standard library, on CPU, resumably:
# re-running continues each step from where it stopped (checkpoints live in $WORK).
#   1. BPE tokenizer + pre-trained target             (jetflow_jax.embedded.pretrain)
#   2. snippet prompts from held-in files   (jetflow_jax.embedded.prompts)
#   3. the target's own continuations and the two heads (train.py, configs/embedded.py)
#   4. the heads' held-out agreement              (jetflow_jax.embedded.head_eval)
# Finished checkpoints land in jetflow_jax/embedded/checkpoints/ (bfloat16).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORK=${WORK:-runs/embedded}
OUT=jetflow_jax/embedded/checkpoints
TOKENS=${TOKENS:-10e6}
THREADS=${THREADS:-2}  # one is faster when something else shares the 2 cores
# The shipped heads were trained in stages, each continuing the last with its cosine schedule
# restarted over a longer run: epochs:steps (the agreement curve was still rising each time).
HEAD_STAGES=${HEAD_STAGES:-"4:1000 8:1600 10:2400"}
# Then fine-tuned (train.init_head) on four times the continuations: ten epochs over the first
# 4,000 had memorised them.
PROMPTS_MORE=${PROMPTS_MORE:-16000}
FINETUNE=${FINETUNE:-"2:1200"}
FINETUNE_LR=${FINETUNE_LR:-1e-3}

mkdir -p "$WORK"
if [ ! -f "$OUT/target/model.safetensors" ]; then
  # --bf16 takes effect only where the CPU has native bfloat16 (AMX, AVX512-BF16).
  env OMP_WAIT_POLICY=PASSIVE $PY -m jetflow_jax.embedded.pretrain --workdir "$WORK/pretrain" \
      --out "$OUT/target" --tokens "$TOKENS" --bf16 --compile --threads "$THREADS"
fi
# One seed: the first 4,000 of the larger set are the first stages' prompts.
[ -f "$WORK/prompts_more.jsonl" ] || $PY -m jetflow_jax.embedded.prompts --tokenizer "$OUT/target" \
    --out "$WORK/prompts_more.jsonl" --count "$PROMPTS_MORE"
[ -f "$WORK/prompts.jsonl" ] || head -n 4000 "$WORK/prompts_more.jsonl" > "$WORK/prompts.jsonl"
for kind in jetflow dflash; do
  for stage in $HEAD_STAGES; do
    $PY train.py --config=configs/embedded.py:$kind --workdir="$WORK/head_$kind" \
        --config.data.prompts="$WORK/prompts.jsonl" \
        --config.data.regenerated="$WORK/regenerated.jsonl" \
        --config.train.epochs="${stage%%:*}" --config.train.num_steps="${stage##*:}"
  done
  # Regeneration resumes by record id: the first 4,000 continuations are reused.
  [ -f "$WORK/regenerated_more.jsonl" ] ||
    cp "$WORK/regenerated.jsonl" "$WORK/regenerated_more.jsonl"
  $PY train.py --config=configs/embedded.py:$kind --workdir="$WORK/head_more_$kind" \
      --config.train.init_head="$WORK/head_$kind" \
      --config.data.prompts="$WORK/prompts_more.jsonl" \
      --config.data.regenerated="$WORK/regenerated_more.jsonl" \
      --config.train.epochs="${FINETUNE%%:*}" --config.train.num_steps="${FINETUNE##*:}" \
      --config.train.lr="$FINETUNE_LR"
  rm -rf "$OUT/head_$kind" && cp -r "$WORK/head_more_$kind/hf_head" "$OUT/head_$kind"
done
# The heads' bar: top-1 agreement with the target on continuations of held-out files.
$PY -m jetflow_jax.embedded.head_eval --head "$OUT/head_jetflow" --head "$OUT/head_dflash" \
    --save-quality
