"""Prompts for the embedded heads, from held-in standard-library files, as token ids.

Two kinds: `snippet`, `--prompt-tokens` tokens of a training file from a line start, and
`function`, a documented function's signature and docstring, dedented (the shape of a
HumanEval prompt; at most `--prompt-tokens` tokens). The target regenerates what follows
(`train.py` or `jetflow_jax.train.regenerate` does that step), so the heads learn the
target's own continuations, never the held-out files.

  python -m jetflow_jax.embedded.prompts --tokenizer DIR --out prompts.jsonl --count 4000
  python -m jetflow_jax.embedded.prompts --tokenizer DIR --out f.jsonl --kind function \\
      --prompt-tokens 96
"""

from __future__ import annotations

import argparse
import ast
import json
import textwrap

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


def documented_functions(source: str) -> list[str]:
  """Each documented function of `source` from its `def` line through its docstring, dedented."""
  try:
    tree = ast.parse(source)
  except SyntaxError:  # a few library files are deliberately invalid (test data)
    return []
  lines = source.splitlines(keepends=True)
  return [textwrap.dedent("".join(lines[node.lineno - 1:node.body[0].end_lineno]))
          for node in ast.walk(tree)
          if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
          and ast.get_docstring(node) is not None]


def function_prompts(tokenizer, count: int, max_tokens: int, seed: int = 0) -> list[list[int]]:
  """`count` distinct signature-and-docstring prompts of training files, at most `max_tokens`."""
  headers = sorted({h for f in corpus.split_files()[0]
                    for h in documented_functions(corpus.read_source(f))})
  order = np.random.default_rng(seed).permutation(len(headers))
  prompts = []
  for i in order:
    ids = tokenizer.encode(headers[i], add_special_tokens=False)
    if len(ids) <= max_tokens:
      prompts.append(ids)
      if len(prompts) == count:
        return prompts
  raise ValueError(f"only {len(prompts)} documented functions of at most {max_tokens} tokens "
                   f"in the training files; asked for {count}")


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--tokenizer", required=True, help="directory with tokenizer.json")
  parser.add_argument("--out", required=True)
  parser.add_argument("--count", type=int, default=4000)
  parser.add_argument("--prompt-tokens", type=int, default=48,
                      help="a snippet's length; a function prompt's longest")
  parser.add_argument("--kind", choices=("snippet", "function"), default="snippet")
  # Seeds 4 and 5 drew the shipped heads' prompts; head_eval's fresh snippets use seed 2.
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  from transformers import AutoTokenizer
  tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
  draw = snippet_prompts if args.kind == "snippet" else function_prompts
  prompts = draw(tokenizer, args.count, args.prompt_tokens, seed=args.seed)
  # Ids name kind and seed so that files drawn differently can be concatenated; seed 0 keeps
  # the bare ids (snippet0, snippet1, ...) that earlier data used.
  prefix = args.kind if args.seed == 0 else f"{args.kind}{args.seed}_"
  with open(args.out, "w") as f:
    for i, ids in enumerate(prompts):
      f.write(json.dumps({"id": f"{prefix}{i}", "prompt_ids": ids}) + "\n")
  print(f"{args.count} prompts written to {args.out}")


if __name__ == "__main__":
  main()
