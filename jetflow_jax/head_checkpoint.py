"""Head checkpoints: the reference's HF layout (import/export) and our training workdirs.

A training workdir holds `head_config.json` (the reference layout) and orbax checkpoints
under `checkpoints/<step>/`; decoding reads the head params of the latest one, training
writes them (`train/checkpointing.py`).
"""

from __future__ import annotations

import json
import os
from typing import Iterator

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jetflow_jax import hf_params, hub, partitioning
from jetflow_jax.config import read_config_json
from jetflow_jax.errors import CheckpointError
from jetflow_jax.head import init_head_params
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.hf_params import Tensor

HEAD_CONFIG_FILE = "head_config.json"  # a training workdir's head, in the reference layout
CHECKPOINT_SUBDIR = "checkpoints"  # a training workdir's orbax checkpoints, one per step


def head_tensors(config: HeadConfig) -> Iterator[Tensor]:
  """Every tensor of a reference-layout head checkpoint."""
  yield Tensor("fc.weight", ("fc", "kernel"), in_dims=1)
  yield Tensor("hidden_norm.weight", ("hidden_norm", "scale"))
  layers = config.layer_config()
  for i in range(config.num_layers):
    yield from hf_params.decoder_layer_tensors(layers, i, f"layers.{i}.", (f"layers_{i}",))
  yield Tensor("norm.weight", ("norm", "scale"))


def abstract_head_params(config: HeadConfig, dtype=jnp.float32):
  return jax.eval_shape(lambda: init_head_params(config, jax.random.key(0), dtype))


def save_hf_head(head_params, config: HeadConfig, out_dir: str, dtype=jnp.bfloat16) -> None:
  """Writes `config.json` + `model.safetensors` in the reference layout.

  The reference's decode code (`DFlashDraftModel`) and `load_head` read the result.

  Args:
    head_params: the head's params.
    config: its config.
    out_dir: the directory to write (created if missing).
    dtype: the dtype of the saved tensors.
  """
  os.makedirs(out_dir, exist_ok=True)
  params = cast(head_params, dtype)
  hf_params.save_tensors(params, head_tensors(config), os.path.join(out_dir, "model.safetensors"))
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump({**config.to_hf_dict(), "torch_dtype": jnp.dtype(dtype).name}, f, indent=2)


def cast(tree, dtype):
  return jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)


def workdir_head_config(workdir: str) -> HeadConfig | None:
  """The head a training workdir was made for, or None for a new workdir."""
  path = os.path.join(workdir, HEAD_CONFIG_FILE)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return HeadConfig.from_hf_dict(json.load(f), path)


def restore_head_params(workdir: str, abstract_params):
  """Head params of the latest checkpoint in a training workdir, on this process's first device
  (whatever mesh and process count wrote them)."""
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  directory = os.path.join(os.path.abspath(workdir), CHECKPOINT_SUBDIR)
  with ocp.CheckpointManager(directory) as manager:
    step = manager.latest_step()
    if step is None:
      raise CheckpointError(f"{workdir} has no training checkpoint yet")
    restored = manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(partitioning.abstract(abstract_params, device))))
  return restored["params"]


def load_head(path: str, dtype=jnp.float32) -> tuple[HeadConfig, dict]:
  """Loads a draft head as (HeadConfig, params).

  Args:
    path: a reference-layout HF directory (JetSpec / DFlash heads, or ours exported with
      `save_hf_head`), a training workdir of `train.py` (its latest checkpoint), or a Hugging
      Face repo id (`JetSpec/jetspec-qwen3-8b[@rev]`).
    dtype: every param is cast to it.

  Returns:
    `(head_config, head_params)`.

  Raises:
    CheckpointError: a missing directory, file or tensor, a shape that disagrees with the
      config, or a workdir with no checkpoint yet.
    ConfigError: a `config.json` that is not a draft head's.
  """
  path = os.path.abspath(os.path.expanduser(hub.resolve(path)))
  if (config := workdir_head_config(path)) is not None:
    params = restore_head_params(path, abstract_head_params(config, jnp.float32))
    return config, cast(params, dtype)
  raw = read_config_json(path)
  config = HeadConfig.from_hf_dict(raw, os.path.join(path, "config.json"))
  params = hf_params.load_tensors(path, list(head_tensors(config)),
                                  abstract_head_params(config, dtype), dtype)
  return config, params
