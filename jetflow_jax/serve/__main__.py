"""Serve a Qwen3 target, plainly or speculatively, behind an OpenAI-compatible HTTP API.

  python -m jetflow_jax.serve                    # the embedded pair with its JetFlow head
  python -m jetflow_jax.serve --checkpoint Qwen/Qwen3-8B --head HEAD --slots 8 --port 8000
  python -m jetflow_jax.serve --checkpoint Qwen/Qwen3-32B --head HEAD --mesh data=2,tp=4
  curl localhost:8000/v1/completions -d '{"prompt": "def fib(n):", "max_tokens": 32}'

SIGTERM stops taking requests, lets running ones finish (20 s at most) and exits with 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import jax

from jetflow_jax import cli, embedded, hub
from jetflow_jax.checkpoint import load_qwen3
from jetflow_jax.engine import make_engine
from jetflow_jax.errors import InputError
from jetflow_jax.head_checkpoint import load_head
from jetflow_jax.kernels.tree_attention import attention_for_backend
from jetflow_jax.mesh import DecodeMesh, parse_mesh
from jetflow_jax.serve.app import Server, create_app
from jetflow_jax.speculative import METHODS
from jetflow_jax.text import load_tokenizer

EMBEDDED_NAME = "jetflow-embedded"


class Parser(argparse.ArgumentParser):
  def error(self, message):  # one line and exit 2, as for every other bad value
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv=None) -> argparse.Namespace:
  parser = Parser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--checkpoint", help="target: directory or hub id (default: the embedded "
                      "model, with the head its method was trained for)")
  parser.add_argument("--head", help="draft head: reference-layout directory or hub id, or a "
                      "training workdir")
  parser.add_argument("--method", choices=METHODS,
                      help="default: jetflow with a head, ar without")
  parser.add_argument("--budget", type=int, default=64, help="tree nodes, root included")
  parser.add_argument("--top-k", type=int, default=7, help="tree candidates per depth")
  parser.add_argument("--slots", type=int, default=8, help="requests decoded together")
  parser.add_argument("--max-context", type=int,
                      help="tokens per slot, prompt included (default: the model's context "
                      "window, at most 2048)")
  parser.add_argument("--rounds-per-step", type=int, default=4,
                      help="speculative rounds between two hand-overs of tokens to the host")
  parser.add_argument("--dtype", default="auto",
                      help="auto (bfloat16 on GPU/TPU, float32 on CPU), float32 or bfloat16")
  parser.add_argument("--attention", default="xla", choices=("xla", "pallas"),
                      help="pallas: the backend's kernel (on a GPU, the fast one)")
  parser.add_argument("--mesh", default="", help="devices to serve over, e.g. data=2,tp=4 "
                      "(slots split over data, the target over tp and ep); default: one")
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
    dtype = cli.parse_dtype(args.dtype)
    checkpoint, head = args.checkpoint, args.head
    if checkpoint is None:  # the embedded pair, with the head trained for the method
      checkpoint = embedded.default_target()
      if args.method != "ar":
        head = head or embedded.default_head(
            "dflash" if args.method in ("dflash", "ddtree") else "jetflow")
    method = args.method or ("jetflow" if head else "ar")
    name = (os.path.basename(os.path.normpath(args.checkpoint)) if args.checkpoint
            else EMBEDDED_NAME)
    checkpoint, head = hub.resolve(checkpoint), head and hub.resolve(head)
    mesh = DecodeMesh.create(**parse_mesh(args.mesh)) if args.mesh else None
    config, params = load_qwen3(checkpoint, dtype, None if mesh is None else mesh.param_shardings)
    head_config, head_params = (load_head(head, dtype) if head and method != "ar"
                                else (None, None))
    tokenizer = load_tokenizer(checkpoint)
    max_context = args.max_context or min(config.max_position_embeddings, 2048)
    if max_context > config.max_position_embeddings:
      raise InputError(f"--max-context {max_context} exceeds the model's context window of "
                       f"{config.max_position_embeddings} positions (max_position_embeddings)")
    engine = make_engine(
        params, config, head_params, head_config, method=method, budget=args.budget,
        top_k=args.top_k, attention=attention_for_backend(args.attention, jax.default_backend()),
        num_slots=args.slots, max_context=max_context, rounds_per_step=args.rounds_per_step,
        mesh=mesh, warn=lambda line: print(line, file=sys.stderr))
    print(f"serving {name} ({method}, {args.slots} slots of {max_context} tokens) on "
          f"http://{args.host}:{args.port} once compiled", file=sys.stderr, flush=True)
    Server(create_app(engine, tokenizer, name), args.host, args.port).run()

  cli.run(serve)


if __name__ == "__main__":
  main()
