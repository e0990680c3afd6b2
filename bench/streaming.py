"""Does streaming cost speed? Streamed vs one-shot decoding, AR and JetFlow, in one run.

  python bench/streaming.py [--layers 6 --vocab 8192 --tokens 256 --repeats 3]

A random small Qwen3 and a random causal head (CPU, float32). Streaming hands the tokens
to the host every few steps (`on_tokens`), which must not slow decoding down by more
than 10%. Prints a table and writes bench/results/streaming.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jetflow_jax.config import Qwen3Config  # noqa: E402
from jetflow_jax.decoding import speculative_generate  # noqa: E402
from jetflow_jax.head import init_head_params  # noqa: E402
from jetflow_jax.head_config import HeadConfig  # noqa: E402
from jetflow_jax.model import init_params  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--layers", type=int, default=6)
  parser.add_argument("--vocab", type=int, default=8192)
  parser.add_argument("--tokens", type=int, default=256)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default="bench/results/streaming.json")
  args = parser.parse_args()

  config = Qwen3Config(vocab_size=args.vocab, hidden_size=256, intermediate_size=768,
                       num_hidden_layers=args.layers, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                       eos_token_ids=())
  params = init_params(config, jax.random.key(0))
  head = HeadConfig.for_target(config, num_layers=1, target_layer_ids=(1,), block_size=8,
                               mask_token_id=args.vocab - 1)
  head_params = init_head_params(head, jax.random.key(1))
  prompt = [np.random.default_rng(0).integers(0, args.vocab - 1, 32).tolist()]

  rows = {}
  for method in ("ar", "jetflow"):
    for streamed in (False, True):
      run = lambda: speculative_generate(
          params, config, head_params, head, prompt, args.tokens, method=method, budget=32,
          on_tokens=(lambda tokens: None) if streamed else None)
      run()  # compile and warm up
      walls = [run().wall_s for _ in range(args.repeats)]
      rows[(method, streamed)] = statistics.median(walls)
  results = {m: {"one_shot_s": rows[(m, False)], "streamed_s": rows[(m, True)],
                 "streamed_over_one_shot": rows[(m, True)] / rows[(m, False)]}
             for m in ("ar", "jetflow")}
  print("| method | one-shot s | streamed s | streamed / one-shot |\n|---|---|---|---|")
  for method, r in results.items():
    print(f"| {method} | {r['one_shot_s']:.3f} | {r['streamed_s']:.3f} | "
          f"{r['streamed_over_one_shot']:.3f} |")
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({"settings": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
  main()
