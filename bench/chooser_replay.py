"""Auto's choices in the device loop replayed at a measured cost table, over many requests and
lengths in minutes: the decisions `--budget auto` takes at Qwen3-0.6B shapes, without the hours
of decoding at those shapes.

  python bench/chooser_replay.py            # writes bench/results/chooser_replay.json
  python bench/chooser_replay.py --taus 8 --new-tokens 32,64 --runs 4
  python bench/chooser_replay.py --draws 12 # over twelve draw sequences (prompts), not one

What is real: `decode_prompts(auto=True)` itself (the chooser, the drafter's record kept in a
cost tables file from run to run, the first look), and the controlled drafter, whose accepted
depths are drawn from (seed, row, position) alone, so a 2-layer stand-in target with a 64-token
prompt meets the same draws as Qwen3-0.6B does. What is replayed: the round times, given to the
chooser from `--seconds` (default: the table calibration measured at Qwen3-0.6B shapes on this
CPU, float32, 64-token prompt, 32 new tokens) and summed over the rounds each method ran. The
first run of a setting finds no record (the benchmark's "table absent"), later runs find what
earlier ones kept ("on disk"). Round times grow with the context, which the replay leaves out:
the measured cells are `bench/auto_budget.py`'s.

One prompt is one sequence of draws, and where two choices tie in expectation it decides
between them. `--draws K` replays K of them (the drafter's seed 0..K-1, each as different a
request as another prompt would be): K users, each with a record of its own, whose `--runs`
requests take the seeds in turn, each user from a different one, so that every run index
covers each draw sequence once; auto's time over them is set against each method's over the
same requests. The seed is a traced param: every draw runs the same compiled rounds. With one
draw (the default) the table is the single prompt's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's jetflow_jax

import jax  # noqa: E402
import numpy as np  # noqa: E402
import tqdm  # noqa: E402

from jetflow_jax.controlled_drafter import (ControlledDrafter, controlled_params,  # noqa: E402
                                            depth_distribution_for_tau)
from jetflow_jax.decoding import TreeShape, decode_prompts, generate, loop  # noqa: E402
from jetflow_jax.decoding.budget import COST_TABLES_ENV, budget_ladder  # noqa: E402
from jetflow_jax.model import init_params  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "bench"))
import step_costs  # noqa: E402

# Seconds of a round at AR, 4, 8, 16, 32, 64: calibration's table at Qwen3-0.6B shapes, float32,
# batch 1, 64-token prompt, 32 new tokens (2026-12-06, this CPU; the controlled drafter has no
# taps, so no flush).
QWEN3_06B_SECONDS = (0.129, 0.384, 0.448, 0.633, 0.967, 1.550)


def floats(text: str) -> list[float]:
  return [float(t) for t in text.split(",") if t.strip()]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--taus", type=floats, default=[2.0, 4.0, 8.0])
  parser.add_argument("--new-tokens", type=lambda t: [int(x) for x in floats(t)],
                      default=[32, 64, 128, 512, 2048])
  parser.add_argument("--budgets", type=lambda t: [int(x) for x in floats(t)], default=[16, 64],
                      help="fixed budgets to compare with")
  parser.add_argument("--runs", type=int, default=6,
                      help="requests per setting and user, one record")
  parser.add_argument("--draws", type=int, default=1,
                      help="draw sequences (the drafter's seed): users, each starting on its own")
  parser.add_argument("--calibrated", action="store_true",
                      help="the controlled drafter as sure as its acceptance warrants (a "
                           "well-trained head), not certain of every token")
  parser.add_argument("--seconds", type=floats, default=list(QWEN3_06B_SECONDS),
                      help="round seconds at AR, 4, 8, ... up to the largest budget")
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results",
                                                    "chooser_replay.json"))
  args = parser.parse_args()
  if args.draws < 1 or args.runs < 1:
    parser.error("--draws and --runs need at least 1")
  ladder = budget_ladder(max(args.budgets))
  if len(args.seconds) != len(ladder):
    parser.error(f"--seconds needs one time per budget of {ladder}")
  seconds = np.asarray(args.seconds, np.float64)
  loop.round_seconds = lambda *_, **__: (seconds, 0.0)  # the chooser reads these

  config, _ = step_costs.preset_pair(step_costs.PRESETS["qwen3-0.6b"], layers=2, vocab=256)
  params = jax.jit(init_params, static_argnums=(0,))(config, jax.random.key(0))
  prompt = np.random.default_rng(0).integers(0, config.vocab_size, (1, 64)).tolist()
  drafter = ControlledDrafter(depth=15, calibrated=args.calibrated)
  cost = lambda budgets: float(sum(seconds[ladder.index(b)] for b in budgets))
  cells, rows = {}, []
  with tempfile.TemporaryDirectory() as directory:
    grid = [(tau, n) for n in args.new_tokens for tau in args.taus]
    for tau, n in tqdm.tqdm(grid, desc="settings"):
      ar = generate(params, config, prompt, n, stop_tokens=())
      draws = [controlled_params([p + t for p, t in zip(prompt, ar.tokens)],
                                 depth_distribution_for_tau(tau, drafter.depth), seed=seed)
               for seed in range(args.draws)]
      decode = lambda drafter_params, shape, auto=False: decode_prompts(
          params, config, drafter, drafter_params, prompt, n, tree_shape=shape,
          stop_tokens=(), auto=auto)
      # Each method's seconds on each draw sequence; AR's do not depend on the draws (the
      # prefill commits the first token).
      method_s = {"AR": [(n - 1) * seconds[0]] * args.draws}
      for budget in args.budgets:
        method_s[f"JetFlow {budget}"] = [
            len(decode(d, TreeShape("top_n", budget, 7)).committed_per_round[0])
            * seconds[ladder.index(budget)] for d in draws]
      # Each run index is one pass of the users over every draw sequence (user u's run r takes
      # draw (u + r) mod K): its total is set against each method's total on the same draws,
      # the best method picked once for the setting, as a user would pick a fixed budget.
      best = min(sum(s) for s in method_s.values())
      auto_s = np.zeros((args.runs, args.draws))  # by run, by draw
      chosen = [[None] * args.draws for _ in range(args.runs)]
      for user in range(args.draws):
        os.environ[COST_TABLES_ENV] = os.path.join(directory, f"tau{tau:g}_n{n}_{user}.json")
        for run in range(args.runs):
          draw = (user + run) % args.draws
          result = decode(draws[draw], TreeShape("top_n", max(args.budgets), 7), auto=True)
          if result.tokens != ar.tokens:
            raise SystemExit(f"auto's tokens differ from AR's at tau {tau:g}, {n} tokens")
          auto_s[run, draw] = cost(result.budgets)
          chosen[run][draw] = {str(b): result.budgets.count(b)
                               for b in sorted(set(result.budgets))}
      ratios = best / auto_s.sum(axis=1)
      cells[f"tau {tau:g} n{n}"] = {
          "seconds by draw": method_s, "auto seconds by run and draw": auto_s.tolist(),
          "auto / best by run": ratios.tolist(), "auto rounds by run and draw": chosen}
      rows.append(f"| {tau:g} | {n} | " + " | ".join(f"{sum(s) / args.draws:.1f}"
                                                      for s in method_s.values())
                  + f" | {ratios[0]:.2f} | {min(ratios[1:], default=np.nan):.2f} | "
                  f"{np.median(ratios[1:]) if args.runs > 1 else np.nan:.2f} |")
  over = f" over {args.draws} draw sequences" if args.draws > 1 else ""
  print(f"\nreplayed seconds per request{over} (mean); auto over the best of AR and JetFlow "
        f"{', '.join(map(str, args.budgets))} on the same requests: the first run (no record), "
        f"then the least and the median of the {args.runs - 1} after it (record on disk)")
  print("| tau | new tokens | " + " | ".join(method_s) + " | auto, first | auto, later: least "
        "| auto, later: median |")
  print("|---" * (len(method_s) + 5) + "|")
  print("\n".join(rows))
  with open(args.out, "w") as f:
    json.dump({"settings": vars(args), "ladder": list(ladder), "cells": cells}, f, indent=1)
  print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
  main()
