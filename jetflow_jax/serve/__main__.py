"""Serve a Qwen3 target, plainly or speculatively, behind an OpenAI-compatible HTTP API.

  python -m jetflow_jax.serve                    # the embedded pair with its JetFlow head
  python -m jetflow_jax.serve --checkpoint Qwen/Qwen3-8B --head HEAD --slots 8 --port 8000
  python -m jetflow_jax.serve --checkpoint Qwen/Qwen3-32B --head HEAD --mesh data=2,tp=4
  JETFLOW_API_KEY=KEY python -m jetflow_jax.serve --host 0.0.0.0 --served-model-name qwen3-8b
  curl localhost:8000/v1/completions -d '{"prompt": "def fib(n):", "max_tokens": 32}'

SIGTERM stops taking requests, lets running ones finish (20 s at most) and exits with 0.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys

from jetflow_jax import cli
from jetflow_jax.engine.flags import add_engine_flags, check_engine_flags, engine_from_flags
from jetflow_jax.errors import InputError
from jetflow_jax.pair import add_model_flags, pair_from_flags
from jetflow_jax.serve.app import create_app
from jetflow_jax.serve.guard import KEY_ENVS, is_loopback, key_from_env
from jetflow_jax.serve.server import Server
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
  parser.add_argument("--host", default="127.0.0.1",
                      help="address to listen on (default: this machine only; 0.0.0.0: every "
                      "interface, then pass --api-key)")
  parser.add_argument("--port", type=int, default=8000)
  parser.add_argument("--api-key", nargs="+", metavar="KEY",
                      help="every /v1 route requires the header 'Authorization: Bearer KEY' "
                      "(any one of these keys) and answers 401 without it; /health and /metrics "
                      f"stay open. Default: ${KEY_ENVS[0]}, else ${KEY_ENVS[1]} (an environment "
                      "variable keeps the key out of the process list); none: no key needed")
  parser.add_argument("--served-model-name", nargs="+", metavar="NAME",
                      help="the names /v1/models lists and requests may give as `model` (the "
                      "first one in answers; any other is a 404); default: jetflow-embedded, or "
                      "the checkpoint's name")
  parser.add_argument("--max-request-bytes", type=int, metavar="N",
                      help="a request body over N bytes gets a 413 before it is parsed (default: "
                      "64 bytes per token of --max-context, at least 1 MiB)")
  parser.add_argument("--request-timeout", type=float, metavar="SECONDS",
                      help="a request not done this long after it arrived, queued or decoding, "
                      "ends with a 504 (a stream: with an error event) and frees its slots "
                      "(default: no limit)")
  return parser.parse_args(argv)


def check_flags(args: argparse.Namespace) -> None:
  """Refuses flag values no server can take, before anything loads."""
  check_engine_flags(args)
  if not 0 <= args.port <= 65535:
    raise InputError(f"--port must lie in [0, 65535] (got {args.port})")
  for flag, values in (("--api-key", args.api_key), ("--served-model-name",
                                                      args.served_model_name)):
    if values is not None and not all(values):
      raise InputError(f"{flag} must not be empty")
  if args.max_request_bytes is not None and args.max_request_bytes < 1:
    raise InputError(f"--max-request-bytes must be >= 1 (got {args.max_request_bytes})")
  if args.request_timeout is not None and not 0 < args.request_timeout < math.inf:
    raise InputError(f"--request-timeout must be a number of seconds > 0 (got "
                     f"{args.request_timeout:g})")


def api_keys(args: argparse.Namespace) -> list[str]:
  """The keys --api-key names, else the environment's (see KEY_ENVS); empty: none needed."""
  key = key_from_env()
  return args.api_key or ([key] if key else [])


def exposure(host: str, port: int, keys: list[str]) -> str | None:
  """The warning due when the server listens beyond this machine without a key."""
  if keys or is_loopback(host):
    return None
  return (f"warning: --host {host} serves anyone who can reach port {port}, with no API key; "
          f"pass --api-key or set ${KEY_ENVS[0]}")


def main(argv=None) -> None:
  args = parse_args(argv)

  def serve():
    check_flags(args)
    keys = api_keys(args)
    if warning := exposure(args.host, args.port, keys):
      print(warning, file=sys.stderr, flush=True)
    # A SIGTERM is a clean stop (exit 0): at once while loading; while serving, uvicorn drains
    # first, then raises it again under this handler.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    pair = pair_from_flags(args)
    tokenizer = load_tokenizer(pair.checkpoint)
    engine = engine_from_flags(args, pair)
    names = args.served_model_name or [pair.name]
    print(f"serving {', '.join(names)} ({pair.method}, {args.slots} slots of "
          f"{engine.max_context} tokens{', API key required' if keys else ''}) on "
          f"http://{args.host}:{args.port} once compiled", file=sys.stderr, flush=True)
    app = create_app(engine, tokenizer, names, api_keys=keys,
                     max_request_bytes=args.max_request_bytes,
                     request_timeout=args.request_timeout)
    Server(app, args.host, args.port).run()

  cli.run(serve)


if __name__ == "__main__":
  main()
