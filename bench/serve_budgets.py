"""The server's throughput with `--budget auto` against AR and fixed tree budgets, by load.

Run from the repository root:

  python bench/serve_budgets.py                      # embedded pair, 8 slots, 1 / 4 / 8 clients
  python bench/serve_budgets.py --budgets 4,16,64 --requests 16 --repeats 2

For each server (AR, JetFlow at each fixed budget, JetFlow auto with no cost table and with
one on disk), started in turn as a subprocess (`serve_load.start_server`: every variant
compiled before it answers), the same greedy streamed completions of HumanEval prompts at each
concurrency. Auto with no table measures its step costs at every start and meets the drafter
for the first time; auto with the table on disk reads the costs and the drafter's record that
an untimed first start (the same requests at the first concurrency) wrote, and keeps adding to
it. The servers take turns `--repeats` times, their order rotated, so machine noise falls on
all of them; each cell keeps its best run. Prints tokens/s per cell and each auto / the best of
the others, the budgets auto chose, and writes bench/results/serve_budgets.json.
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
  tables = os.path.join(tempfile.mkdtemp(prefix="serve_budgets."), "cost_tables.json")
  # (name, method, budget, cost tables file: "" keeps nothing)
  servers = [("AR", "ar", "64", "")] + [(f"jetflow {b}", "jetflow", b, "")
                                        for b in args.budgets.split(",")]
  autos = [("jetflow auto", "jetflow", "auto", ""),
           ("jetflow auto, table on disk", "jetflow", "auto", tables)]
  levels = [int(c) for c in args.concurrency.split(",")]
  tokenizer = load_tokenizer(embedded.default_target())
  room = args.context - args.max_tokens
  prompts = [p for p in load_prompts("humaneval")
             if len(tokenizer.encode(p, add_special_tokens=False)) <= room][:args.requests]

  runs: dict[str, dict[int, list[float]]] = {}  # every turn's tokens/s; the table keeps the best
  budgets_chosen: dict[str, dict[int, dict]] = {}

  def serve(name: str, method: str, budget: str, path: str, levels: list[int], timed: bool):
    os.environ["JETFLOW_COST_TABLES"] = path
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
          if not timed:
            continue
          runs.setdefault(name, {}).setdefault(level, []).append(result["tokens_per_s"])
          if budget == "auto":
            after = chosen_budgets(url)
            budgets_chosen.setdefault(name, {})[level] = {
                k: after[k] - before.get(k, 0.0) for k in after if after[k] > before.get(k, 0.0)}
      finally:
        server.send_signal(signal.SIGTERM)  # the server keeps the drafter's record as it stops
        server.wait(timeout=60)

  serve(*autos[1], levels[:1], timed=False)  # writes the table and the record auto reads
  for repeat in range(args.repeats):
    turn = servers + autos
    for server in turn[repeat % len(turn):] + turn[:repeat % len(turn)]:  # the order rotated
      serve(*server, levels, timed=True)
      print(f"repeat {repeat + 1}/{args.repeats}: {server[0]} done", file=sys.stderr, flush=True)

  best = {name: {level: max(turns) for level, turns in by_level.items()}
          for name, by_level in runs.items()}
  names = list(best)
  print(f"{len(prompts)} HumanEval prompts x {args.max_tokens} tokens, greedy, {args.slots} "
        f"slots; completion tokens/s, best of {args.repeats}")
  print("| clients | " + " | ".join(names) + " | auto / best other | on disk / best other |")
  print("|---" * (len(names) + 3) + "|")
  rows = []
  for level in levels:
    others = max(best[n][level] for n, *_ in servers)
    ratios = {n: best[n][level] / others for n, *_ in autos}
    rows.append({"concurrency": level, "tokens_per_s": {n: best[n][level] for n in names},
                 "tokens_per_s_turns": {n: runs[n][level] for n in names},
                 "auto_over_best_other": ratios[autos[0][0]],
                 "on_disk_over_best_other": ratios[autos[1][0]],
                 "auto_budgets": {n: budgets_chosen[n][level] for n, *_ in autos}})
    print(f"| {level} | " + " | ".join(f"{best[n][level]:.1f}" for n in names)
          + "".join(f" | {r:.2f}" for r in ratios.values()) + " |")
  for level in levels:
    print(f"auto's steps at {level} clients: "
          + "; ".join(f"{n}: {budgets_chosen[n][level]}" for n, *_ in autos))
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({"settings": vars(args), "cpus": os.cpu_count(), "rows": rows}, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
