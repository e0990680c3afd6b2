#!/usr/bin/env bash
# Rebuilds the embedded default pair from the CPython standard library, on CPU, resumably:
# re-running continues each step from where it stopped (checkpoints live in $WORK).
#   1. BPE tokenizer + pre-trained target, two stages   (jetflow_jax.embedded.pretrain)
#   2. snippet prompts from held-in files   (jetflow_jax.embedded.prompts)
#   3. the target's own continuations and the two heads (train.py, configs/embedded.py)
#   4. the heads' held-out agreement              (jetflow_jax.embedded.head_eval)
# Finished checkpoints land in jetflow_jax/embedded/checkpoints/ (bfloat16).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORK=${WORK:-runs/embedded}
OUT=jetflow_jax/embedded/checkpoints
TOKENS=${TOKENS:-12e6}   # first stage: the corpus as it comes
TOKENS2=${TOKENS2:-10e6} # second stage: the test suites cut to a quarter of each batch
# The shipped heads were trained in stages, each continuing the last with its cosine schedule
# restarted over a longer run: epochs:steps (the agreement curve was still rising each time).
HEAD_STAGES=${HEAD_STAGES:-"4:1000 8:1600 10:2400"}

mkdir -p "$WORK"
if [ ! -f "$OUT/target/model.safetensors" ]; then
  # One torch thread: measured faster than two whenever anything else shares the 2 cores.
  pretrain="env OMP_WAIT_POLICY=PASSIVE $PY -m jetflow_jax.embedded.pretrain"
  pretrain="$pretrain --bf16 --compile --threads 1"
  [ -f "$WORK/target_stage1/model.safetensors" ] || $pretrain --workdir "$WORK/pretrain" \
      --out "$WORK/target_stage1" --tokens "$TOKENS"
  # The test suites are 65% of the corpus and the held-out files are library modules.
  $pretrain --workdir "$WORK/pretrain2" --out "$OUT/target" --tokens "$TOKENS2" --lr 1e-3 \
      --init-from "$WORK/pretrain/checkpoint.pt" --test-share 0.25
fi
[ -f "$WORK/prompts.jsonl" ] || $PY -m jetflow_jax.embedded.prompts --tokenizer "$OUT/target" \
    --out "$WORK/prompts.jsonl" --count 4000
for kind in jetflow dflash; do
  for stage in $HEAD_STAGES; do
    $PY train.py --config=configs/embedded.py:$kind --workdir="$WORK/head_$kind" \
        --config.data.prompts="$WORK/prompts.jsonl" \
        --config.data.regenerated="$WORK/regenerated.jsonl" \
        --config.train.epochs="${stage%%:*}" --config.train.num_steps="${stage##*:}"
  done
  rm -rf "$OUT/head_$kind" && cp -r "$WORK/head_$kind/hf_head" "$OUT/head_$kind"
done
# The heads' bar: top-1 agreement with the target on continuations of held-out files.
$PY -m jetflow_jax.embedded.head_eval --head "$OUT/head_jetflow" --head "$OUT/head_dflash" \
    --save-quality
