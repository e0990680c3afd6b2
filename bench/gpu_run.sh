#!/usr/bin/env bash
# Issue 40's device run, as one command on a lent GPU machine (its own jax with CUDA, nothing to
# install): every piece of a round against its floor, kernel counts and a profile of one round,
# and end-to-end tokens/s against a known tau, Qwen3-8B shapes, random bf16 weights. At most
# ~8 minutes including compiles (each step has its own timeout); JAX's persistent compilation
# cache under $CACHE makes a rerun compile little. Logs and JSON go to ${OUT:-bench/results/gpu}.
# The part "auto" (issue 39: budget auto against AR and N=256, at most 3 more minutes) runs only
# when named.
#
#   bash bench/gpu_run.sh            # steps batch profile e2e
#   PARTS="e2e auto" bash bench/gpu_run.sh
set -u
OUT=${OUT:-bench/results/gpu}
CACHE=${CACHE:-/tmp/jetflow_xla_cache}
PARTS=${PARTS:-"steps batch profile e2e"}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JETFLOW_COMPILATION_CACHE="$CACHE"
nvidia-smi -L | tee "$OUT/device.txt"
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" | tee -a "$OUT/device.txt"
kind=$(python3 -c "import jax; print(jax.devices()[0].device_kind)")
tag=$(echo "$kind" | tr -cs 'A-Za-z0-9' '_' | tr 'A-Z' 'a-z' | sed 's/_$//')

for part in $PARTS; do
  case $part in
    steps)  # AR step, head, verify at N, whole round, batch 1, 4K and 32K tokens: measured / floor
      timeout 170 python3 bench/gpu_step.py --lengths 4096,32768 --budgets 16,64,256 \
        --attention pallas --compile-cache "$CACHE" --out "$OUT/step_costs_qwen3-8b_$tag.json" \
        2>&1 | grep -v "it/s\]" | tail -40 ;;
    batch)  # the same at batch 8 and 32, 4K tokens (batch 32 x 32K does not fit one H200)
      for b in 8 32; do
        timeout 75 python3 bench/gpu_step.py --batch "$b" --lengths 4096 --budgets 16,64 \
          --attention pallas --compile-cache "$CACHE" \
          --out "$OUT/step_costs_qwen3-8b_b${b}_$tag.json" 2>&1 | grep -v "it/s\]" | tail -20
      done ;;
    profile)  # kernels per round and a jax.profiler trace of a few rounds, AR and N=256
      timeout 90 python3 bench/profile_round.py --preset qwen3-8b --budget 256 \
        --trace "$OUT/profile_$tag" --out "$OUT/profile_round_qwen3-8b_$tag.json" 2>&1 | tail -15 ;;
    e2e)  # tokens/s of AR and JetFlow (64, 256) at tau ~4 / 8 / 10, batch 1 and 8
      timeout 150 python3 bench/gpu_e2e.py --preset qwen3-8b --batches 1,8 --taus 4,8,10 \
        --budgets 64,256 --compile-cache "$CACHE" --out "$OUT/e2e_qwen3-8b_$tag.json" \
        2>&1 | tail -25 ;;
    auto)  # issue 39 on the device: --budget auto (ladder AR..256) beside AR and N=256, batch 1
      timeout 180 python3 bench/gpu_e2e.py --preset qwen3-8b --batches 1 --taus 4,10 \
        --budgets 256 --auto --compile-cache "$CACHE" --out "$OUT/e2e_auto_qwen3-8b_$tag.json" \
        2>&1 | tail -12 ;;
    *) echo "unknown part $part (steps, batch, profile, e2e, auto)" >&2 ;;
  esac
done
