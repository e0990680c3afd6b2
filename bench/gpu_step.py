"""Step costs of Qwen3-8B shapes on one GPU: `step_costs.py --preset qwen3-8b`, same flags.

On the GPU machine, from the repository root:

  pip install -e '.[cuda12]'
  python bench/gpu_step.py          # writes bench/results/step_costs_qwen3-8b.json

Random bfloat16 params made on the device, committed lengths 1024 and 4096, budgets 16..256,
attention xla and pallas, in one process budgeted for under 8 minutes on one H200 (most of it
compiling, overlapped on a thread pool). Each length's table ends with the targets, marked pass
or MISS:
  - verify of 256 nodes at most 1.25x an AR step;
  - head forward at most 8% of an AR step;
  - Pallas tree attention at least as fast as XLA at every N (the worst N is shown).
Every piece also gets the bytes and FLOPs it must move and the floor they imply on this device
(`jetflow_jax.roofline`), and measured / floor. Any flag of step_costs.py can follow (e.g.
`--lengths 4096,32768 --batch 8 --repeats 20`; `--floor-only --device-kind "NVIDIA H200"`
prints the floors without a GPU); with `--compile-cache DIR` a rerun skips most of the
compiling. `bench/gpu_run.sh` runs it with the rest of the device checks.
"""

import sys

import step_costs  # bench/ is on sys.path: Python puts a script's own folder first

if __name__ == "__main__":
  step_costs.main(["--preset", "qwen3-8b", *sys.argv[1:]])
