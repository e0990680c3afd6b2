"""Prompts for the embedded heads: snippets of held-in standard-library files, as token ids.

Each prompt is `--prompt-tokens` tokens of a training file starting at a line start;
the target regenerates what follows (`train.py` does that step), so the heads learn the
target's own continuations, never the held-out files.

  python -m jetflow_jax.embedded.prompts --tokenizer DIR --out prompts.jsonl --count 4000
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from jetflow_jax.embedded import corpus


def snippet_prompts(tokenizer, count: int, prompt_tokens: int, seed: int = 0,
                    heldout: bool = False) -> list[list[int]]:
  """`count` prompts, each the first `prompt_tokens` tokens after a random line start.

  Drawn from the training files, or with `heldout` from the held-out ones (evaluation).
  """
  rng = np.random.default_rng(seed)
  files = corpus.split_files()[1 if heldout else 0]
  prompts = []
  while len(prompts) < count:
    text = corpus.read_source(files[rng.integers(len(files))])
    starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n"]
    start = starts[rng.integers(len(starts))]
    ids = tokenizer.encode(text[start:start + 8 * prompt_tokens], add_special_tokens=False)
    if len(ids) >= prompt_tokens:
      prompts.append(ids[:prompt_tokens])
  return prompts


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--tokenizer", required=True, help="directory with tokenizer.json")
  parser.add_argument("--out", required=True)
  parser.add_argument("--count", type=int, default=4000)
  parser.add_argument("--prompt-tokens", type=int, default=48)
  args = parser.parse_args()
  from transformers import AutoTokenizer
  tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
  with open(args.out, "w") as f:
    for i, ids in enumerate(snippet_prompts(tokenizer, args.count, args.prompt_tokens)):
      f.write(json.dumps({"id": f"snippet{i}", "prompt_ids": ids}) + "\n")
  print(f"{args.count} prompts written to {args.out}")


if __name__ == "__main__":
  main()
