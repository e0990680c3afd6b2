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
from jetflow_jax.engine.flags import add_engine_flags, check_engine_flags, engine_from_flags
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
  add_model_flags(parser, mesh_help="devices to serve over, e.g. data=2,tp=4 (slots split over "
                  "data, the target over tp and ep); default: one")
  add_engine_flags(parser)
  parser.add_argument("--host", default="127.0.0.1")
  parser.add_argument("--port", type=int, default=8000)
  return parser.parse_args(argv)


def check_flags(args: argparse.Namespace) -> None:
  """Refuses flag values no server can take, before anything loads."""
  check_engine_flags(args)
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
    tokenizer = load_tokenizer(pair.checkpoint)
    engine = engine_from_flags(args, pair)
    print(f"serving {pair.name} ({pair.method}, {args.slots} slots of {engine.max_context} "
          f"tokens) on http://{args.host}:{args.port} once compiled", file=sys.stderr,
          flush=True)
    Server(create_app(engine, tokenizer, pair.name), args.host, args.port).run()

  cli.run(serve)


if __name__ == "__main__":
  main()
