"""The engine's flags and the engine they describe, shared by the server and `calibrate`."""

from __future__ import annotations

import argparse
import sys

from jetflow_jax.engine.engine import Engine, make_engine
from jetflow_jax.errors import InputError
from jetflow_jax.pair import Pair, max_budget


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--slots", type=int, default=8, help="requests decoded together")
  parser.add_argument("--max-context", type=int,
                      help="tokens per slot, prompt included (default: the model's context "
                      "window, at most 2048)")
  parser.add_argument("--rounds-per-step", type=int, default=4,
                      help="speculative rounds between two hand-overs of tokens to the host")


def check_engine_flags(args: argparse.Namespace) -> None:
  """Refuses flag values no engine can take, before anything loads (the tree's are checked
  against the model's vocabulary once it has)."""
  for flag, value, least in (("--slots", args.slots, 1),
                             ("--rounds-per-step", args.rounds_per_step, 1),
                             ("--max-context", args.max_context, 2)):
    if value is not None and value < least:
      raise InputError(f"{flag} must be >= {least} (got {value})")


def engine_from_flags(args: argparse.Namespace, pair: Pair) -> Engine:
  """The engine `add_engine_flags` and `pair.add_model_flags` describe, over `pair`."""
  config = pair.config
  max_context = args.max_context or min(config.max_position_embeddings, 2048)
  if max_context > config.max_position_embeddings:
    raise InputError(f"--max-context {max_context} exceeds the model's context window of "
                     f"{config.max_position_embeddings} positions (max_position_embeddings)")
  return make_engine(
      pair.params, config, pair.head_params, pair.head_config, method=pair.method,
      budget=args.budget, max_budget=max_budget(args), top_k=args.top_k,
      attention=pair.attention, num_slots=args.slots, max_context=max_context,
      rounds_per_step=args.rounds_per_step, mesh=pair.mesh,
      warn=lambda line: print(line, file=sys.stderr))
