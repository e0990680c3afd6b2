"""Measure what an engine step of each tree budget costs on this device, for `--budget auto`.

  python -m jetflow_jax.calibrate                     # the embedded pair, the server's defaults
  python -m jetflow_jax.calibrate --checkpoint Qwen/Qwen3-8B --head HEAD --slots 16

Takes the server's flags, builds the engine they describe, times a step of every budget of
its ladder with every slot busy, prints the table and keeps it in the cost table file
($JETFLOW_COST_TABLES, default ~/.cache/jetflow_jax/cost_tables.json): a server started with
the same flags on this device then measures nothing. An existing entry is measured again.
"""

from __future__ import annotations

import sys

from jetflow_jax import cli, compile_cache
from jetflow_jax.decoding.budget import cost_tables_path
from jetflow_jax.engine.budgets import step_seconds
from jetflow_jax.engine.flags import add_engine_flags, check_engine_flags, engine_from_flags
from jetflow_jax.errors import InputError
from jetflow_jax.pair import add_model_flags, pair_from_flags
from jetflow_jax.serve.__main__ import Parser


def main(argv=None) -> None:
  parser = Parser(prog="python -m jetflow_jax.calibrate",
                  description=__doc__.strip().splitlines()[0])
  add_model_flags(parser)
  add_engine_flags(parser)
  args = parser.parse_args(argv)

  def calibrate():
    check_engine_flags(args)
    compile_cache.enable()  # what it compiles, a server with the same flags loads from disk
    if args.budget != "auto":
      raise InputError("calibrate measures the budgets of --budget auto; leave --budget out")
    engine = engine_from_flags(args, pair_from_flags(args))
    if not engine.ladder:
      raise InputError(f"method {engine.tree_shape.kind} has no budgets to choose between "
                       "(ddtree and jetflow do)")
    path = cost_tables_path()
    seconds = step_seconds(engine, path, remeasure=True)
    print(f"one step of {engine.rounds_per_step} rounds over {engine.num_slots} busy slots:")
    print("| budget | ms a step | ms a round |\n|---|---|---|")
    for budget, s in zip(engine.ladder, seconds):
      print(f"| {'AR' if budget == 1 else budget} | {1e3 * s:.2f} | "
            f"{1e3 * s / engine.rounds_per_step:.2f} |")
    print(f"kept in {path}" if path else "not kept ($JETFLOW_COST_TABLES is empty)",
          file=sys.stderr)

  cli.run(calibrate)


if __name__ == "__main__":
  main()
