#!/usr/bin/env bash
# Rebuilds the embedded default pair from the CPython standard library, on CPU, resumably:
# re-running continues each step from where it stopped (checkpoints live in $WORK).
#   1. BPE tokenizer + pre-trained target      (jetflow_jax.embedded.pretrain)
#   2. two fine-tune stages against the target's own greedy loops (pretrain --rollout-loss)
#   3. snippet and function prompts from held-in files (jetflow_jax.embedded.prompts)
#   4. the final target's own continuations    (jetflow_jax.train.regenerate)
#   5. the two heads, side by side             (train.py, configs/embedded.py)
#   6. the heads' held-out agreement           (jetflow_jax.embedded.head_eval)
# Finished checkpoints land in $OUT (bfloat16): by default the package's, where they ship.
# A smoke run of the whole pipeline in half an hour (tiny sizes; nothing shipped is touched):
#   WORK=/tmp/e OUT=/tmp/e/out TOKENS=2e4 ROLLOUT_TOKENS=8192 SNIPPETS="40 100" \
#   FUNCTIONS="20 40" HEAD_ARGS=--config.train.num_steps=4 scripts/build_embedded.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORK=${WORK:-runs/embedded}
OUT=${OUT:-jetflow_jax/embedded/checkpoints}
TOKENS=${TOKENS:-10e6}
ROLLOUT_TOKENS=${ROLLOUT_TOKENS:-1.6384e6}  # 400 steps of 8 x 512 tokens per stage
THREADS=${THREADS:-2}  # one is faster when something else shares the 2 cores
# Prompts per seed (seeds 4 and 5): snippets of training files and documented functions.
read -r -a SNIPPETS <<< "${SNIPPETS:-4000 10000}"
read -r -a FUNCTIONS <<< "${FUNCTIONS:-2000 4000}"
HEAD_ARGS=${HEAD_ARGS:-}  # extra train.py flags for both heads; the schedule is the config's

mkdir -p "$WORK"
pretrain() {  # --bf16 takes effect only where the CPU has native bfloat16 (AMX, AVX512-BF16).
  env OMP_WAIT_POLICY=PASSIVE $PY -m jetflow_jax.embedded.pretrain --bf16 --compile \
      --threads "$THREADS" "$@"
}
if [ ! -f "$OUT/target/model.safetensors" ]; then
  [ -f "$WORK/base_target/model.safetensors" ] || pretrain --workdir "$WORK/pretrain" \
      --out "$WORK/base_target" --tokens "$TOKENS"
  # Each step adds, to a corpus batch with the test suites cut to a quarter, a loss on 16 of
  # the model's own greedy continuations: match the stage's starting model with the token
  # that repeats a 4-gram removed. The second stage starts from, and is taught by, the first.
  rollout=(--test-share 0.25 --lr 5e-4 --unlikelihood-batch 16 --rollout-loss teacher
           --eval-every 100 --tokens "$ROLLOUT_TOKENS")
  [ -f "$WORK/rollout1_target/model.safetensors" ] || pretrain "${rollout[@]}" \
      --init-from "$WORK/base_target" --workdir "$WORK/rollout1" --out "$WORK/rollout1_target"
  pretrain "${rollout[@]}" --init-from "$WORK/rollout1/checkpoint.pt" \
      --workdir "$WORK/rollout2" --out "$OUT/target"
fi
prompts() {
  $PY -m jetflow_jax.embedded.prompts --tokenizer "$OUT/target" "$@"
}
if [ ! -f "$WORK/prompts.jsonl" ]; then
  # Each seed draws snippets of training files and documented functions' signature and
  # docstring (the shape of a HumanEval prompt). Seeds 4 and 5 are neither head_eval's (2)
  # nor any earlier heads' (0, 3); the order is the one trained on.
  for i in 0 1; do
    seed=$(( i + 4 ))
    prompts --out "$WORK/snippets$seed.jsonl" --count "${SNIPPETS[$i]}" --seed $seed
    prompts --out "$WORK/functions$seed.jsonl" --count "${FUNCTIONS[$i]}" --kind function \
        --prompt-tokens 96 --seed $seed
  done
  cat "$WORK"/{snippets4,functions4,snippets5,functions5}.jsonl > "$WORK/prompts.jsonl.tmp"
  mv "$WORK/prompts.jsonl.tmp" "$WORK/prompts.jsonl"
fi
# A token store, resumed by record id; transformers' generate decodes this target twice as fast
# as our loop.
$PY -m jetflow_jax.train.regenerate --backend=torch --threads="$THREADS" --target="$OUT/target" \
    --prompts="$WORK/prompts.jsonl" --out="$WORK/regenerated" --max_new_tokens=256 \
    --batch_size=64
# Side by side, one core each: same data, same steps; only the in-block mask differs.
pids=() core=0
for kind in jetflow dflash; do
  # shellcheck disable=SC2086  # HEAD_ARGS is a list of flags
  taskset -c $core $PY train.py --config=configs/embedded.py:$kind --config.data.prompts= \
      --config.data.store= --config.target.checkpoint="$OUT/target" \
      --workdir="$WORK/head_$kind" --config.data.regenerated="$WORK/regenerated" $HEAD_ARGS &
  pids+=($!) core=$(( (core + 1) % $(nproc) ))
done
for pid in "${pids[@]}"; do wait "$pid"; done  # fails if either run failed
for kind in jetflow dflash; do
  rm -rf "$OUT/head_$kind" && cp -r "$WORK/head_$kind/hf_head" "$OUT/head_$kind"
done
# The heads' bar: top-1 agreement with the target on continuations of held-out files.
$PY -m jetflow_jax.embedded.head_eval --target "$OUT/target" --head "$OUT/head_jetflow" \
    --head "$OUT/head_dflash" --save-quality
