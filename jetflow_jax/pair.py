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
from typing import Any, Callable

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
from jetflow_jax.model import decode_kernel_layout, with_kernel_layout

EMBEDDED_NAME = "jetflow-embedded"


def budget_flag(text: str) -> int | str:
  """`--budget`: `auto` or a node count."""
  if text == "auto":
    return text
  try:
    return int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be auto or a number of nodes (got {text!r})") from None


@dataclasses.dataclass(frozen=True)
class Flag:
  """One model flag, for argparse (`--top-k`) and absl (`--top_k`) alike."""

  name: str  # with underscores
  default: Any
  help: str
  type: Callable = str
  choices: tuple | None = None


def model_flags(*, method: bool = True, auto: bool = True,
                mesh_help: str | None = "devices to decode over, e.g. tp=4,ep=2 (axes data, tp, "
                "ep; default: one device)") -> list[Flag]:
  """The flags that choose and place the pair: checkpoint, head, dtype, kernel, mesh (unless
  `mesh_help` is None) and, with `method`, the method and its tree (`auto` budgets, with
  `auto`: the default then)."""
  flags = [Flag("checkpoint", None, "target: directory or hub id (default: the embedded model, "
                "with the head its method is made for)"),
           Flag("head", None, "draft head: reference-layout directory or hub id, or a training "
                "workdir")]
  if method:
    flags.append(Flag("method", None, "default: jetflow with a head, ar without",
                      choices=METHODS))
    if auto:
      flags += [Flag("budget", "auto", "tree nodes, root included, or auto (default): each "
                     "round's budget chosen on the ladder AR, 4, 8, ..., the largest from what "
                     "rounds cost here and what the draft predicts (ddtree and jetflow)",
                     budget_flag),
                Flag("max_budget", None, "the largest budget auto may choose (default: 64 on "
                     "CPU, where trees cost their rows, 256 on a GPU or TPU)", int)]
    else:
      flags.append(Flag("budget", DEFAULT_BUDGET, "tree nodes, root included", int))
    flags.append(Flag("top_k", DEFAULT_TOP_K, "tree candidates per depth", int))
  flags += [Flag("dtype", "auto", "auto (bfloat16 on GPU/TPU, float32 on CPU), float32 or "
                 "bfloat16"),
            Flag("attention", "xla", "pallas: the backend's kernel (Triton on GPU, Mosaic on "
                 "TPU, interpreted on CPU)", choices=("xla", "pallas"))]
  if mesh_help is not None:
    flags.append(Flag("mesh", "", mesh_help))
  return flags


def add_model_flags(parser: argparse.ArgumentParser, **options) -> None:
  """`model_flags(**options)` on an argparse parser (dashes in the names)."""
  for flag in model_flags(**options):
    parser.add_argument("--" + flag.name.replace("_", "-"), type=flag.type, default=flag.default,
                        choices=flag.choices, help=flag.help)


def define_absl_model_flags(**options) -> None:
  """`model_flags(**options)` as absl flags (underscores in the names; the budget a string,
  `parse_budget` reads it)."""
  from absl import flags
  for flag in model_flags(**options):
    if flag.choices:
      flags.DEFINE_enum(flag.name, flag.default, flag.choices, flag.help)
    elif flag.type is int:
      flags.DEFINE_integer(flag.name, flag.default, flag.help)
    else:
      flags.DEFINE_string(flag.name, None if flag.default is None else str(flag.default),
                          flag.help)


def parse_budget(text: str) -> int | str:
  """An absl `--budget` value: `auto` or a node count (InputError otherwise)."""
  try:
    return budget_flag(str(text))
  except argparse.ArgumentTypeError as e:
    raise InputError(f"--budget {e}") from None


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
  """Loads the target (placed on `mesh`, e.g. "tp=4") and the head `method` runs with.

  What `decode.py`, the server, the bench, `calibrate` and regeneration load, from one set of
  flags.

  Args:
    checkpoint: the target (a directory or hub id); None: the embedded target.
    head: the head (a directory, workdir or hub id); None: with the embedded target, the
      embedded head the method is made for.
    method: `ar`, `dflash`, `ddtree` or `jetflow`; None: `jetflow` when there is a head, else
      `ar`.
    dtype: `auto` (bfloat16 on GPU/TPU, float32 on CPU), `float32`, `bfloat16`, ...
    attention: `xla` or `pallas` (the backend's kernel).
    mesh: a decode mesh such as `tp=4,ep=2`; "" for one device.

  Returns:
    The `Pair`: the target's directory, name, config and params, the method, the head's config
    and params (None for ar), the attention path and the `DecodeMesh` (or None). Without a
    mesh, the target's and head's kernels are stored as `model.decode_kernel_layout` says.

  Raises:
    CheckpointError: a target or head that cannot be read.
    ConfigError: a config this port does not support.
    InputError: a mesh that the devices or the target cannot take.
  """
  embedded_target = checkpoint is None
  target = embedded.default_target() if embedded_target else hub.resolve(checkpoint)
  if method is None:
    method = "jetflow" if head or (embedded_target and head_path("jetflow", None, True)) else "ar"
  decode_mesh = DecodeMesh.create(**parse_mesh(mesh)) if mesh else None
  config, params = load_qwen3(target, cli.parse_dtype(dtype),
                              None if decode_mesh is None else decode_mesh.param_shardings)
  head_config, head_params = load_head_for(method, head, embedded_target, dtype)
  if decode_mesh is None:  # one device decodes from its backend's fastest kernel layout
    layout = decode_kernel_layout()
    params = with_kernel_layout(params, layout)
    head_params = None if head_params is None else with_kernel_layout(head_params, layout)
  name = EMBEDDED_NAME if embedded_target else os.path.basename(os.path.normpath(checkpoint))
  return Pair(checkpoint=target, name=name, config=config, params=params, method=method,
              head_config=head_config, head_params=head_params,
              attention=attention_for_backend(attention, jax.default_backend()),
              mesh=decode_mesh)


def pair_from_flags(args: argparse.Namespace) -> Pair:
  """`load_pair` with the values of `add_model_flags`."""
  return load_pair(args.checkpoint, args.head, args.method, dtype=args.dtype,
                   attention=args.attention, mesh=args.mesh)
