"""Decoding speed of two checkouts side by side in one run: this one and a git commit (by default
the one before the one-decode-loop redesign), alternated so machine noise hits both alike.

  python bench/decode_loop_ab.py                     # HEAD's tree against 08e99b4
  python bench/decode_loop_ab.py --base COMMIT --repeats 5
  python bench/decode_loop_ab.py --serve             # the engine behind the server instead

Each side runs in its own process from its own tree (a `git worktree` of the base) on the
embedded pair, greedy: AR at batch 1 and 8, JetFlow at budgets 16 / 64 / 256 (batch 1), 128 new
tokens from 4 HumanEval prompts; a cell's time is the median over `--repeats` alternations.
With `--serve`, each side's own `bench/serve_load.py` runs instead (its server, AR and JetFlow
at budget 64, 8 slots, `--requests` greedy streamed completions of 64 tokens at 8 clients
and at 1).
Prints a table and writes bench/results/decode_loop_ab.json (with --serve: serve_load_ab.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CELLS = [("ar", 1, 0), ("ar", 8, 0), ("jetflow", 1, 16), ("jetflow", 1, 64), ("jetflow", 1, 256)]

# Runs inside each side's tree: one timed pass over every cell, JSON on stdout. It uses only the
# public calls both sides share (speculative_generate, load_qwen3, load_head, the embedded pair).
WORKER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from jetflow_jax import embedded, load_head, load_qwen3, speculative_generate
from jetflow_jax.bench.datasets import load_prompts
from jetflow_jax.text import encode_prompt, load_tokenizer
cells = json.loads(sys.argv[2])
config, params = load_qwen3(embedded.default_target())
head = load_head(embedded.default_head("jetflow"))
tokenizer = load_tokenizer(embedded.default_target())
prompts = [encode_prompt(tokenizer, p, False) for p in load_prompts("humaneval")[:4]]
out = {}
for method, batch, budget in cells:
  def run():
    wall = tokens = 0.0
    for p in prompts:
      r = speculative_generate(params, config, head[1], head[0], [p] * batch, 128, method=method,
                               budget=budget or 64, warn=lambda _: None)
      wall += r.wall_s
      tokens += r.num_tokens
    return tokens / wall, r.tokens
  run()  # compiles
  rate, tokens = run()
  out[f"{method}/b{batch}/{budget}"] = {"tokens_per_s": rate, "last_tokens": tokens}
print(json.dumps(out))
"""


def decode_cells(tree: str) -> dict:
  """One pass over CELLS by the decode loop of `tree`."""
  done = subprocess.run([sys.executable, "-c", WORKER, tree, json.dumps(CELLS)],
                        capture_output=True, text=True, cwd=tree)
  if done.returncode:
    sys.exit(f"{tree} failed:\n{done.stderr[-3000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def serve_cells(tree: str, requests: int) -> dict:
  """`tree`'s own bench/serve_load.py for AR and JetFlow at budget 64: tokens/s by clients."""
  cells = {}
  for method in ("ar", "jetflow"):
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
      done = subprocess.run([sys.executable, "bench/serve_load.py", "--method", method,
                             "--budget", "64", "--requests", str(requests), "--max-tokens", "64",
                             "--out", out.name],
                            capture_output=True, text=True, cwd=tree)
      if done.returncode:
        sys.exit(f"{tree} serve_load failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
      for run in json.load(open(out.name))["runs"]:
        cells[f"serve/{method}/{run['concurrency']} clients"] = {
            "tokens_per_s": run["tokens_per_s"], "last_tokens": None}
  return cells


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--base", default="08e99b4")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--serve", action="store_true", help="time the server's engine instead")
  parser.add_argument("--requests", type=int, default=16, help="with --serve")
  parser.add_argument("--out")
  args = parser.parse_args()
  args.out = args.out or os.path.join(ROOT, "bench", "results", "serve_load_ab.json"
                                      if args.serve else "decode_loop_ab.json")
  with tempfile.TemporaryDirectory() as tmp:
    base_tree = os.path.join(tmp, "base")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", base_tree, args.base],
                   check=True, capture_output=True)
    try:
      sides = {"base": base_tree, "this": ROOT}
      runs = {name: [] for name in sides}
      for repeat in range(args.repeats):
        for name, tree in sides.items():
          runs[name].append(serve_cells(tree, args.requests) if args.serve else
                            decode_cells(tree))
          print(f"repeat {repeat + 1}/{args.repeats}: {name} done", file=sys.stderr, flush=True)
    finally:
      subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base_tree],
                     capture_output=True)
  rows = []
  print(f"| cell | {args.base} tokens/s | this tokens/s | this / base | same tokens |")
  print("|---|---|---|---|---|")
  for key in runs["base"][0]:
    base = statistics.median(r[key]["tokens_per_s"] for r in runs["base"])
    this = statistics.median(r[key]["tokens_per_s"] for r in runs["this"])
    same = (runs["base"][0][key]["last_tokens"] == runs["this"][0][key]["last_tokens"]
            if not args.serve else "n/a (serve_load compares its own runs)")
    rows.append(dict(cell=key, base_tokens_per_s=base, this_tokens_per_s=this,
                     ratio=this / base, same_tokens=same))
    print(f"| {key} | {base:.0f} | {this:.0f} | {this / base:.3f} | {same} |")
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({"base": args.base, "repeats": args.repeats, "rows": rows,
               "runs": {k: [{c: v["tokens_per_s"] for c, v in r.items()} for r in rs]
                        for k, rs in runs.items()}}, f, indent=1)
  print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
  main()
