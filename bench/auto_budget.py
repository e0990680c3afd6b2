"""`--budget auto` against AR and fixed budgets in the device loop, cells alternated.

  python bench/auto_budget.py                        # embedded pair, HumanEval 16 and stdlib
  python bench/auto_budget.py --budgets 16,64 --repeats 5

`python -m jetflow_jax.bench` times its cells one after another, so on a noisy machine a
cell's luck moves its ratio by 10-20%; here every pass runs each cell over the whole prompt
set in turn (AR, each fixed budget, auto; the order rotated from pass to pass, so each cell
runs first, second, ...), `--repeats` passes, and each cell's tokens/s is its median. Greedy,
128 new tokens, the JetFlow head, auto up to the largest fixed budget.
Prints a table per set (auto / AR and auto / the best fixed budget) and writes
bench/results/auto_budget.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # before the imports below: measure this checkout, installed or not

import tqdm  # noqa: E402

from jetflow_jax import embedded, load_head, load_qwen3, speculative_generate  # noqa: E402
from jetflow_jax.bench.datasets import load_prompts  # noqa: E402
from jetflow_jax.text import encode_prompt, load_tokenizer  # noqa: E402

SETS = {"humaneval": 16, "stdlib": None}  # prompts of each (None: all)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--budgets", default="16,64", help="fixed JetFlow budgets")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--max-new-tokens", type=int, default=128)
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results",
                                                    "auto_budget.json"))
  args = parser.parse_args()
  fixed = [int(b) for b in args.budgets.split(",")]
  config, params = load_qwen3(embedded.default_target())
  head_config, head_params = load_head(embedded.default_head("jetflow"))
  tokenizer = load_tokenizer(embedded.default_target())
  cells = [("ar", 1)] + [("jetflow", b) for b in fixed] + [("jetflow", "auto")]

  def run(prompts, method, budget):
    wall = tokens = 0.0
    chosen = collections.Counter()
    for prompt in prompts:
      result = speculative_generate(params, config, head_params, head_config, [prompt],
                                    args.max_new_tokens, method=method, budget=budget,
                                    max_budget=max(fixed), warn=lambda _: None)
      wall += result.wall_s
      tokens += result.num_tokens
      chosen.update(result.budgets)
    return tokens / wall, chosen

  report = {}
  for name, limit in SETS.items():
    prompts = [encode_prompt(tokenizer, p, False) for p in load_prompts(name)][:limit]
    for method, budget in cells:  # compiles, and auto's round times
      run(prompts[:2], method, budget)
    rates = collections.defaultdict(list)
    chosen = collections.Counter()
    for repeat in tqdm.trange(args.repeats, desc=name):
      shift = repeat % len(cells)  # each cell takes every place in a pass in turn
      for method, budget in cells[shift:] + cells[:shift]:
        rate, budgets = run(prompts, method, budget)
        rates[f"{method} {budget}"].append(rate)
        if budget == "auto":
          chosen.update(budgets)
    median = {cell: statistics.median(r) for cell, r in rates.items()}
    best_fixed = max(median[f"jetflow {b}"] for b in fixed)
    report[name] = {"prompts": len(prompts), "tokens_per_s": median, "runs": rates,
                    "auto_over_ar": median["jetflow auto"] / median["ar 1"],
                    "auto_over_best_fixed": median["jetflow auto"] / best_fixed,
                    "auto_rounds_by_budget": {str(k): v for k, v in sorted(chosen.items())}}
  print(f"greedy, {args.max_new_tokens} new tokens, tokens/s (median of {args.repeats} "
        "alternated passes)")
  print("| set | AR | " + " | ".join(f"JetFlow {b}" for b in fixed)
        + " | auto | auto / AR | auto / best fixed | auto's rounds |")
  print("|---" * (len(fixed) + 6) + "|")
  for name, r in report.items():
    m = r["tokens_per_s"]
    rounds = ", ".join(f"{'AR' if k == '1' else k} x{v}"
                       for k, v in r["auto_rounds_by_budget"].items())
    print(f"| {name} ({r['prompts']}) | {m['ar 1']:.0f} | "
          + " | ".join(f"{m[f'jetflow {b}']:.0f}" for b in fixed)
          + f" | {m['jetflow auto']:.0f} | {r['auto_over_ar']:.2f} | "
          f"{r['auto_over_best_fixed']:.2f} | {rounds} |")
  with open(args.out, "w") as f:
    json.dump({"settings": vars(args), "sets": report}, f, indent=1)
  print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
  main()
