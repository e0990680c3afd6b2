#!/usr/bin/env bash
# The GPU checks, as one command on a lent GPU machine (its own jax with CUDA, nothing to
# install): kernel numerics, times and tile sweep, the Qwen3-8B step costs, and the embedded
# pair decoded in bfloat16 and float32. Logs and JSON go to ${OUT:-bench/results/gpu}.
set -u
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$OUT/device.txt"
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" | tee -a "$OUT/device.txt"
timeout 150 python3 bench/gpu_kernels.py --out "$OUT/gpu_kernels.json" 2>&1 | tail -40
timeout 170 python3 bench/gpu_kernel_tiles.py --out "$OUT/gpu_kernel_tiles.json" 2>&1 | tail -70
for attention in ${ATTENTION:-pallas}; do
  for dtype in bfloat16 float32; do  # greedy equals AR in float32; bf16 may flip near-ties
    run="${attention}_$dtype"
    timeout 75 python3 decode.py --prompt "def fibonacci(n):" --max-new-tokens 128 --compare-ar \
      --attention "$attention" --dtype "$dtype" --json > "$OUT/decode_embedded_$run.json" 2> "$OUT/decode_$run.err"
    tail -c 600 "$OUT/decode_embedded_$run.json"; echo; tail -3 "$OUT/decode_$run.err"
  done
done
timeout "${STEP_TIMEOUT:-270}" python3 bench/gpu_step.py --lengths 4096 --budgets ${BUDGETS:-16,64,256} --out "$OUT/step_costs_qwen3-8b.json" \
  2>&1 | grep -v "it/s\]" | tail -60
