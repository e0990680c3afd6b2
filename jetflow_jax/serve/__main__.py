"""Serve a Qwen3 target, plainly or speculatively, behind an OpenAI-compatible HTTP API.

  python -m jetflow_jax.serve                    # the embedded pair with its JetFlow head
  python -m jetflow_jax.serve --checkpoint Qwen/Qwen3-8B --head HEAD --slots 8 --port 8000
  python -m jetflow_jax.serve --checkpoint Qwen/Qwen3-32B --head HEAD --mesh data=2,tp=4
  curl localhost:8000/v1/completions -d '{"prompt": "def fib(n):", "max_tokens": 32}'

SIGTERM stops taking requests, lets running ones finish (20 s at most) and exits with 0.
"""

from __future__ import annotations

import argparse
import signal
import sys

from jetflow_jax import cli
from jetflow_jax.engine import make_engine
from jetflow_jax.errors import InputError
from jetflow_jax.pair import add_model_flags, pair_from_flags
from jetflow_jax.serve.app import Server, create_app
from jetflow_jax.text import load_tokenizer


class Parser(argparse.ArgumentParser):
  def error(self, message):  # one line and exit 2, as for every other bad value
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv=None) -> argparse.Namespace:
  parser = Parser(prog="python -m jetflow_jax.serve",
                  description=__doc__.strip().splitlines()[0])
  # The engine runs a fixed budget: choosing it every step is not there yet.
  add_model_flags(parser, auto=False, mesh_help="devices to serve over, e.g. data=2,tp=4 (slots split over "
                  "data, the target over tp and ep); default: one")
  parser.add_argument("--slots", type=int, default=8, help="requests decoded together")
  parser.add_argument("--max-context", type=int,
                      help="tokens per slot, prompt included (default: the model's context "
                      "window, at most 2048)")
  parser.add_argument("--rounds-per-step", type=int, default=4,
                      help="speculative rounds between two hand-overs of tokens to the host")
  parser.add_argument("--host", default="127.0.0.1")
  parser.add_argument("--port", type=int, default=8000)
  return parser.parse_args(argv)


def check_flags(args: argparse.Namespace) -> None:
  """Refuses flag values no engine can take, before anything loads (the tree's are checked
  against the model's vocabulary once it has)."""
  for flag, value, least in (("--slots", args.slots, 1),
                             ("--rounds-per-step", args.rounds_per_step, 1),
                             ("--max-context", args.max_context, 2)):
    if value is not None and value < least:
      raise InputError(f"{flag} must be >= {least} (got {value})")
  if not 0 <= args.port <= 65535:
    raise InputError(f"--port must lie in [0, 65535] (got {args.port})")


def main(argv=None) -> None:
  args = parse_args(argv)

  def serve():
    check_flags(args)
    # A SIGTERM is a clean stop (exit 0): at once while loading; while serving, uvicorn drains
    # first, then raises it again under this handler.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    pair = pair_from_flags(args)
    config = pair.config
    tokenizer = load_tokenizer(pair.checkpoint)
    max_context = args.max_context or min(config.max_position_embeddings, 2048)
    if max_context > config.max_position_embeddings:
      raise InputError(f"--max-context {max_context} exceeds the model's context window of "
                       f"{config.max_position_embeddings} positions (max_position_embeddings)")
    engine = make_engine(
        pair.params, config, pair.head_params, pair.head_config, method=pair.method,
        budget=args.budget, top_k=args.top_k, attention=pair.attention, num_slots=args.slots,
        max_context=max_context, rounds_per_step=args.rounds_per_step, mesh=pair.mesh,
        warn=lambda line: print(line, file=sys.stderr))
    print(f"serving {pair.name} ({pair.method}, {args.slots} slots of {max_context} tokens) on "
          f"http://{args.host}:{args.port} once compiled", file=sys.stderr, flush=True)
    Server(create_app(engine, tokenizer, pair.name), args.host, args.port).run()

  cli.run(serve)


if __name__ == "__main__":
  main()
