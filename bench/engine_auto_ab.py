"""The engine's `--budget auto` against plain AR's engine, in one process, where trees never pay.

Run from the repository root:

  python bench/engine_auto_ab.py                     # embedded pair, 8 slots, 1 / 4 / 8 clients

Both engines run the same greedy HumanEval requests through an `Orchestrator`, each client
submitting its next request as its last finishes; the two alternate `--repeats` times per
concurrency (their order flipped each time), after a first untimed run of each. Auto's step
costs are measured once before (as a server's start-up does). Prints tokens/s, auto over AR
paired by turn, the seconds the chooser's own Python took per run, and writes a JSON. Unlike
`serve_budgets.py`, no server or HTTP: what is left is the engines' own difference.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # before the imports below: measure this checkout, installed or not

from jetflow_jax import cli, embedded  # noqa: E402
from jetflow_jax.bench.datasets import load_prompts  # noqa: E402
from jetflow_jax.checkpoint import load_qwen3  # noqa: E402
from jetflow_jax.engine import Orchestrator, Request, make_engine  # noqa: E402
from jetflow_jax.engine import budgets  # noqa: E402
from jetflow_jax.head_checkpoint import load_head  # noqa: E402
from jetflow_jax.text import load_tokenizer  # noqa: E402


class ChooserClock:
  """Seconds spent in the budget chooser's calls."""

  def __init__(self):
    self.seconds = 0.0
    for name in ("choose", "record_step", "reset"):
      setattr(budgets.BudgetChooser, name, self._timed(getattr(budgets.BudgetChooser, name)))

  def _timed(self, method):
    @functools.wraps(method)
    def timed(*args, **kwargs):
      start = time.perf_counter()
      try:
        return method(*args, **kwargs)
      finally:
        self.seconds += time.perf_counter() - start
    return timed


def closed_loop(engine, seconds_l, prompts, max_tokens: int, clients: int):
  """(tokens/s, tokens) of `prompts` through `engine`, `clients` requests in flight at once."""
  orchestrator = Orchestrator(engine, seconds_l=seconds_l if engine.ladder else None)
  queue = [Request(p, max_tokens, stop_tokens=()) for p in prompts]
  live = [orchestrator.submit(queue.pop(0)) for _ in range(min(clients, len(queue)))]
  streams = list(live)
  start = time.perf_counter()
  while orchestrator.step():
    for stream in [s for s in live if s.finished]:
      live.remove(stream)
      if queue:
        live.append(orchestrator.submit(queue.pop(0)))
        streams.append(live[-1])
  tokens = [s.tokens for s in streams]
  return sum(map(len, tokens)) / (time.perf_counter() - start), tokens


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--concurrency", default="1,4,8")
  parser.add_argument("--slots", type=int, default=8)
  parser.add_argument("--requests", type=int, default=16)
  parser.add_argument("--max-tokens", type=int, default=64)
  parser.add_argument("--context", type=int, default=512)
  parser.add_argument("--repeats", type=int, default=6)
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results",
                                                    "engine_auto_ab.json"))
  args = parser.parse_args()
  config, params = load_qwen3(embedded.default_target())
  head, head_params = load_head(embedded.default_head("jetflow"))
  tokenizer = load_tokenizer(embedded.default_target())
  room = args.context - args.max_tokens
  prompts = [ids for ids in (tokenizer.encode(p, add_special_tokens=False)
                             for p in load_prompts("humaneval")) if len(ids) <= room]
  prompts = prompts[:args.requests]
  options = dict(num_slots=args.slots, max_context=args.context, warn=lambda _: None)
  engines = {"AR": make_engine(params, config, method="ar", **options),
             "auto": make_engine(params, config, head_params, head, method="jetflow",
                                 budget="auto", **options)}
  seconds_l = budgets.step_seconds(engines["auto"], path="")  # measured, warmed up, kept nowhere
  clock = ChooserClock()
  rows = []
  for clients in [int(c) for c in args.concurrency.split(",")]:
    reference = {name: closed_loop(e, seconds_l, prompts, args.max_tokens, clients)[1]
                 for name, e in engines.items()}  # compiles what this load reaches
    rates, chooser_s = {name: [] for name in engines}, []
    for turn in range(args.repeats):
      for name in (("AR", "auto") if turn % 2 else ("auto", "AR")):
        clock.seconds = 0.0
        rate, tokens = closed_loop(engines[name], seconds_l, prompts, args.max_tokens, clients)
        assert tokens == reference["AR"], "auto's tokens differ from AR's"
        rates[name].append(rate)
        if name == "auto":
          chooser_s.append(clock.seconds)
    row = dict(clients=clients, tokens_per_s=rates,
               auto_over_ar_paired=statistics.median(a / b for a, b in zip(rates["auto"],
                                                                           rates["AR"])),
               chooser_s_per_run=statistics.median(chooser_s),
               identical_to_ar=reference["auto"] == reference["AR"])
    rows.append(row)
    print(f"{clients} clients: AR {statistics.median(rates['AR']):.1f}, auto "
          f"{statistics.median(rates['auto']):.1f} tokens/s; auto / AR paired "
          f"{row['auto_over_ar_paired']:.3f}; chooser {row['chooser_s_per_run']:.3f} s a run",
          flush=True)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({"settings": vars(args), "step_seconds": list(map(float, seconds_l)),
               "rows": rows}, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  cli.run(main)
