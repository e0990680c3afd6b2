"""Target checkpoints: load HF safetensors or our converted orbax form; convert once."""

from __future__ import annotations

import json
import os
import shutil

import jax.numpy as jnp
import orbax.checkpoint as ocp

from jetflow_jax import hf_params, hub, partitioning
from jetflow_jax.config import Qwen3Config, load_config
from jetflow_jax.errors import CheckpointError
from jetflow_jax.model import abstract_params

CONVERTED_MARKER = "jetflow_params.json"
PARAMS_SUBDIR = "params"
# Files copied beside converted params so the directory stays usable by `decode.py --chat`.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json",
              "chat_template.jinja")


def is_converted(path: str) -> bool:
  return os.path.isfile(os.path.join(path, CONVERTED_MARKER))


def load_qwen3(path: str, dtype=jnp.float32, shardings=None) -> tuple[Qwen3Config, dict]:
  """Loads a Qwen3 / Qwen3-MoE checkpoint as (config, frozen params pytree).

  Args:
    path: a HF directory (`config.json` + `model.safetensors` or sharded files with
      `model.safetensors.index.json`; bf16, fp16 or fp32), a directory written by
      `python -m jetflow_jax.convert`, or a Hugging Face repo id (`Qwen/Qwen3-8B[@rev]`,
      resolved through the hub cache).
    dtype: every param is cast to it.
    shardings: `shardings(config, abstract_params)`, returning a pytree of shardings
      (`DecodeMesh.param_shardings` is one), places every leaf on its devices as it loads:
      each process reads only the slices its devices hold. None: the default device.

  Returns:
    `(config, params)`: the `Qwen3Config` and a plain pytree of arrays.

  Raises:
    CheckpointError: a missing directory or file, a truncated shard, or tensors whose shapes
      disagree with `config.json` (every one of them named).
    ConfigError: a `config.json` this port does not support.
  """
  path = os.path.abspath(os.path.expanduser(hub.resolve(path)))
  config = load_config(path)
  abstract = abstract_params(config, dtype)
  placement = None if shardings is None else shardings(config, abstract)
  if is_converted(path):
    if placement is not None:
      abstract = partitioning.abstract(abstract, placement)
    with ocp.StandardCheckpointer() as checkpointer:
      params = checkpointer.restore(os.path.join(path, PARAMS_SUBDIR), abstract)
  else:
    params = hf_params.load_tensors(path, list(hf_params.qwen3_tensors(config)), abstract, dtype,
                                    placement)
  return config, params


def save_converted(hf_dir: str, out_dir: str, dtype=jnp.bfloat16) -> Qwen3Config:
  """Converts a HF checkpoint to orbax params plus its config and tokenizer files.

  `python -m jetflow_jax.convert` calls it; `load_qwen3` reads the result faster than the
  safetensors.

  Args:
    hf_dir: the HF checkpoint (directory or hub id).
    out_dir: the directory to write.
    dtype: the params' dtype on disk.

  Returns:
    The checkpoint's config.

  Raises:
    CheckpointError: `out_dir` already holds params (or an interrupted conversion), or the
      checkpoint cannot be read.
    ConfigError: a config this port does not support.
  """
  out_dir = os.path.abspath(out_dir)
  if os.path.exists(os.path.join(out_dir, PARAMS_SUBDIR)):
    state = "converted params" if is_converted(out_dir) else "an interrupted conversion"
    raise CheckpointError(f"{out_dir} already holds {state}; choose a new --out or delete it")
  config, params = load_qwen3(hf_dir, dtype)
  os.makedirs(out_dir, exist_ok=True)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(os.path.join(out_dir, PARAMS_SUBDIR), params)
  for name in SIDE_FILES:
    if os.path.isfile(os.path.join(hf_dir, name)):
      shutil.copy(os.path.join(hf_dir, name), os.path.join(out_dir, name))
  # Written last: a directory without the marker is an interrupted conversion, never loaded.
  with open(os.path.join(out_dir, CONVERTED_MARKER), "w") as f:
    json.dump({"format": "jetflow_jax converted Qwen3 params", "dtype": jnp.dtype(dtype).name,
               "source": os.path.abspath(hf_dir)}, f, indent=2)
  return config
