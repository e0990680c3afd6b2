"""Convert a HF Qwen3 checkpoint once to orbax params that load fast.

  python -m jetflow_jax.convert --hf /path/to/Qwen3-8B --out /path/to/qwen3-8b-jax
"""

from __future__ import annotations

import argparse
import time

from jetflow_jax import cli
from jetflow_jax.checkpoint import save_converted


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--hf", required=True, help="HF checkpoint directory")
  parser.add_argument("--out", required=True, help="new directory for the converted checkpoint")
  parser.add_argument("--dtype", default="bfloat16", help="float32 or bfloat16")
  args = parser.parse_args(argv)

  def convert():
    start = time.perf_counter()
    config = save_converted(args.hf, args.out, cli.parse_dtype(args.dtype))
    print(f"converted {config.num_hidden_layers}-layer {'MoE ' if config.is_moe else ''}Qwen3 "
          f"to {args.out} ({args.dtype}) in {time.perf_counter() - start:.1f}s")

  cli.run(convert)


if __name__ == "__main__":
  main()
