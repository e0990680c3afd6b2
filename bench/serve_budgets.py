"""The server's throughput with `--budget auto` against AR and fixed tree budgets, by load.

Run from the repository root:

  python bench/serve_budgets.py                      # embedded pair, 8 slots, 1 / 4 / 8 clients
  python bench/serve_budgets.py --budgets 4,16,64 --requests 16 --repeats 2

For each server (AR, JetFlow at each fixed budget, JetFlow auto), started in turn as a
subprocess (`serve_load.start_server`: every variant compiled, and auto's step costs measured
afresh, before it answers), the same greedy streamed completions of HumanEval prompts at each
concurrency. The servers take turns `--repeats` times, so machine noise falls on all of them;
each cell keeps its best run. Prints tokens/s per cell and auto / the best of the others, the
budgets auto chose, and writes bench/results/serve_budgets.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import urllib.request

# bench/ is on sys.path (a script's own folder comes first); serve_load puts the checkout there.
from serve_load import ROOT, free_port, run, start_server

from jetflow_jax import embedded
from jetflow_jax.bench.datasets import load_prompts
from jetflow_jax.text import load_tokenizer


def chosen_budgets(url: str) -> dict[str, float]:
  """The server's histogram of step budgets: steps at each budget (not cumulative)."""
  with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
    lines = response.read().decode().splitlines()
  cumulative = {}
  for line in lines:
    if line.startswith("jetflow_step_budget_bucket"):
      bound = line.split('le="')[1].split('"')[0]
      cumulative[bound] = float(line.split()[-1])
  steps, below = {}, 0.0
  for bound, count in cumulative.items():
    if bound != "+Inf" and count > below:
      steps["AR" if float(bound) == 1 else str(int(float(bound)))] = count - below
    below = count
  return steps


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--budgets", default="4,16,64", help="fixed JetFlow budgets")
  parser.add_argument("--concurrency", default="1,4,8")
  parser.add_argument("--slots", type=int, default=8)
  parser.add_argument("--requests", type=int, default=16)
  parser.add_argument("--max-tokens", type=int, default=64)
  parser.add_argument("--context", type=int, default=512)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results",
                                                    "serve_budgets.json"))
  args = parser.parse_args()
  os.environ["JETFLOW_COST_TABLES"] = ""  # auto measures its step costs at every start
  servers = [("ar", "64")] + [("jetflow", b) for b in args.budgets.split(",")] + [
      ("jetflow", "auto")]
  levels = [int(c) for c in args.concurrency.split(",")]
  tokenizer = load_tokenizer(embedded.default_target())
  room = args.context - args.max_tokens
  prompts = [p for p in load_prompts("humaneval")
             if len(tokenizer.encode(p, add_special_tokens=False)) <= room][:args.requests]

  best: dict[str, dict[int, float]] = {}
  budgets_chosen: dict[int, dict] = {}
  for repeat in range(args.repeats):
    for method, budget in servers:
      name = "AR" if method == "ar" else f"jetflow {budget}"
      settings = argparse.Namespace(method=method, slots=args.slots, context=args.context,
                                    budget=budget)
      port = free_port()
      url = f"http://127.0.0.1:{port}"
      with tempfile.NamedTemporaryFile("w", prefix="serve_budgets.", suffix=".log",
                                       delete=False) as log:
        server = start_server(settings, port, log)
        try:
          for level in levels:
            before = chosen_budgets(url) if budget == "auto" else {}
            result = asyncio.run(run(url, prompts, level, args.max_tokens))
            cell = best.setdefault(name, {})
            cell[level] = max(cell.get(level, 0.0), result["tokens_per_s"])
            if budget == "auto":
              after = chosen_budgets(url)
              budgets_chosen[level] = {k: after[k] - before.get(k, 0.0) for k in after
                                       if after[k] > before.get(k, 0.0)}
        finally:
          server.send_signal(signal.SIGTERM)
          server.wait(timeout=60)
      print(f"repeat {repeat + 1}/{args.repeats}: {name} done", file=sys.stderr, flush=True)

  names = list(best)
  print(f"{len(prompts)} HumanEval prompts x {args.max_tokens} tokens, greedy, {args.slots} "
        f"slots; completion tokens/s, best of {args.repeats}")
  print("| clients | " + " | ".join(names) + " | auto / best other |")
  print("|---" * (len(names) + 2) + "|")
  rows = []
  for level in levels:
    others = max(best[n][level] for n in names if n != "jetflow auto")
    ratio = best["jetflow auto"][level] / others
    rows.append({"concurrency": level, "tokens_per_s": {n: best[n][level] for n in names},
                 "auto_over_best_other": ratio, "auto_budgets": budgets_chosen.get(level)})
    print(f"| {level} | " + " | ".join(f"{best[n][level]:.1f}" for n in names)
          + f" | {ratio:.2f} |")
  for level in levels:
    print(f"auto's steps at {level} clients: {budgets_chosen.get(level)}")
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({"settings": vars(args), "cpus": os.cpu_count(), "rows": rows}, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
