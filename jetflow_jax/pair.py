"""The target and the draft head a method runs with: one set of model flags and one loader for
`decode.py`, the server, the bench and regeneration, with the same defaults everywhere.

Defaults: no `--checkpoint` is the embedded target; no `--method` is jetflow when there is a
head (given, or the embedded one) and ar otherwise; each method gets the head it is made for
(`policy.head_kind`: the embedded causal head for jetflow, the bidirectional one for dflash and
ddtree) unless `--head` names one.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

import jax

from jetflow_jax import cli, embedded, hub
from jetflow_jax.checkpoint import load_qwen3
from jetflow_jax.config import Qwen3Config
from jetflow_jax.decoding.policy import DEFAULT_BUDGET, DEFAULT_TOP_K, METHODS, head_kind
from jetflow_jax.errors import InputError
from jetflow_jax.head_checkpoint import load_head
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.kernels.tree_attention import attention_for_backend
from jetflow_jax.mesh import DecodeMesh, parse_mesh

EMBEDDED_NAME = "jetflow-embedded"


def budget_flag(text: str) -> int | str:
  """`--budget`: `auto` or a node count."""
  if text == "auto":
    return text
  try:
    return int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be auto or a number of nodes (got {text!r})") from None


def add_model_flags(parser: argparse.ArgumentParser, *, method: bool = True, auto: bool = True,
                    mesh_help: str | None = "devices to decode over, e.g. tp=4,ep=2 (axes data, "
                    "tp, ep; default: one device)") -> None:
  """The flags that choose and place the pair: checkpoint, head, dtype, kernel, mesh (unless
  `mesh_help` is None) and, with `method`, the method and its tree (`auto` budgets, with
  `auto`: the default then)."""
  parser.add_argument("--checkpoint", help="target: directory or hub id (default: the embedded "
                      "model, with the head its method is made for)")
  parser.add_argument("--head", help="draft head: reference-layout directory or hub id, or a "
                      "training workdir")
  if method:
    parser.add_argument("--method", choices=METHODS,
                        help="default: jetflow with a head, ar without")
    if auto:
      parser.add_argument("--budget", type=budget_flag, default="auto",
                          help="tree nodes, root included, or auto (default): each round's "
                          "budget chosen on the ladder AR, 4, 8, ..., --max-budget from what "
                          "rounds cost here and what the draft predicts (ddtree and jetflow)")
      parser.add_argument("--max-budget", type=int, default=None,
                          help="the largest budget auto may choose (default: 64 on CPU, where "
                          "trees cost their rows, 256 on a GPU or TPU)")
    else:
      parser.add_argument("--budget", type=int, default=DEFAULT_BUDGET,
                          help="tree nodes, root included")
    parser.add_argument("--top-k", type=int, default=DEFAULT_TOP_K,
                        help="tree candidates per depth")
  parser.add_argument("--dtype", default="auto",
                      help="auto (bfloat16 on GPU/TPU, float32 on CPU), float32 or bfloat16")
  parser.add_argument("--attention", default="xla", choices=("xla", "pallas"),
                      help="pallas: the backend's kernel (Triton on GPU, Mosaic on TPU, "
                      "interpreted on CPU)")
  if mesh_help is not None:
    parser.add_argument("--mesh", default="", help=mesh_help)


def max_budget(args: argparse.Namespace) -> int:
  """`--max-budget`, or its default for this backend."""
  if args.max_budget is not None:
    return args.max_budget
  return 64 if jax.default_backend() == "cpu" else 256


@dataclasses.dataclass
class Pair:
  """A loaded target and the head its method runs with (None for ar)."""

  checkpoint: str  # the target's directory (its tokenizer files too)
  name: str  # the model's name for a server
  config: Qwen3Config
  params: Any
  method: str
  head_config: HeadConfig | None
  head_params: Any
  attention: str  # the kernel for this backend
  mesh: DecodeMesh | None


def head_path(method: str, head: str | None, embedded_target: bool) -> str | None:
  """The head `method` runs with: `head` if given, else the embedded one for its kind when the
  target is the embedded one; None for ar."""
  kind = head_kind(method)
  if kind is None:
    return None
  return head or (embedded.default_head(kind) if embedded_target else None)


def load_head_for(method: str, head: str | None, embedded_target: bool, dtype: str = "auto"):
  """(HeadConfig, params) of the head `method` runs with, (None, None) for ar."""
  path = head_path(method, head, embedded_target)
  if method != "ar" and path is None:
    raise InputError(f"method {method!r} needs a draft head (--head); use --method ar without one")
  return load_head(hub.resolve(path), cli.parse_dtype(dtype)) if path else (None, None)


def load_pair(checkpoint: str | None = None, head: str | None = None, method: str | None = None,
              *, dtype: str = "auto", attention: str = "xla", mesh: str = "") -> Pair:
  """Loads the target (placed on `mesh`, e.g. "tp=4") and the head `method` runs with."""
  embedded_target = checkpoint is None
  target = embedded.default_target() if embedded_target else hub.resolve(checkpoint)
  if method is None:
    method = "jetflow" if head or (embedded_target and head_path("jetflow", None, True)) else "ar"
  decode_mesh = DecodeMesh.create(**parse_mesh(mesh)) if mesh else None
  config, params = load_qwen3(target, cli.parse_dtype(dtype),
                              None if decode_mesh is None else decode_mesh.param_shardings)
  head_config, head_params = load_head_for(method, head, embedded_target, dtype)
  name = EMBEDDED_NAME if embedded_target else os.path.basename(os.path.normpath(checkpoint))
  return Pair(checkpoint=target, name=name, config=config, params=params, method=method,
              head_config=head_config, head_params=head_params,
              attention=attention_for_backend(attention, jax.default_backend()),
              mesh=decode_mesh)


def pair_from_flags(args: argparse.Namespace) -> Pair:
  """`load_pair` with the values of `add_model_flags`."""
  return load_pair(args.checkpoint, args.head, args.method, dtype=args.dtype,
                   attention=args.attention, mesh=args.mesh)
