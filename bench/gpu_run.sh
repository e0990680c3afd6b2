#!/usr/bin/env bash
# The GPU checks, as one command on a lent GPU machine (its own jax with CUDA, nothing to
# install): kernel numerics and times, the Qwen3-8B step costs, and the embedded pair decoded
# in bfloat16 with both attention paths. Logs and JSON go to ${OUT:-bench/results/gpu}.
set -u
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$OUT/device.txt"
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" | tee -a "$OUT/device.txt"
timeout 150 python3 bench/gpu_kernels.py --out "$OUT/gpu_kernels.json" 2>&1 | tail -40
for attention in ${ATTENTION:-pallas}; do
  timeout 75 python3 decode.py --prompt "def fibonacci(n):" --max-new-tokens 128 --compare-ar \
    --attention "$attention" --json > "$OUT/decode_embedded_$attention.json" 2> "$OUT/decode_$attention.err"
  tail -c 600 "$OUT/decode_embedded_$attention.json"; echo; tail -3 "$OUT/decode_$attention.err"
done
timeout "${STEP_TIMEOUT:-270}" python3 bench/gpu_step.py --lengths 4096 --budgets ${BUDGETS:-16,64,256} --out "$OUT/step_costs_qwen3-8b.json" \
  2>&1 | grep -v "it/s\]" | tail -60
