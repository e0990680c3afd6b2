"""A (data, fsdp) device mesh: the batch splits over both axes, params over `fsdp`.

The mesh spans every process's devices, in process order, so `fsdp` groups neighbouring
devices (one host's, when fsdp is at most the devices per host) and each process feeds one
contiguous run of the batch's rows. On one device every sharding is trivial and the step
is plain jit. `RULES` maps the logical axes of the batch and of every parameter
(`partitioning.py`) to these mesh axes.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jetflow_jax import partitioning
from jetflow_jax.errors import ConfigError

BATCH_AXES = ("data", "fsdp")
RULES: partitioning.Rules = {
    # The vocabulary first: the embedding and the LM head split by token over fsdp, and logits
    # by vocabulary over fsdp with their rows over data. The LM head then never gathers (the
    # loss's softmax sums meet across fsdp instead), and an embedding lookup reads its own rows.
    "vocab": "fsdp",
    # Every other activation splits its rows over data x fsdp (`partitioning.Layout` pins them).
    "batch": BATCH_AXES,
    # Any other parameter splits over fsdp along its model width where fsdp divides it, else
    # along the first of these axes it divides (replicated when none); it is gathered whole for
    # use, so the axis only decides which parameters split evenly. A model-width split is also a
    # run of whole HF rows or columns, so a sharded load reads just its bytes.
    "embed": "fsdp", "mlp": "fsdp", "experts": "fsdp", "taps": "fsdp",
    "q_heads": "fsdp", "kv_heads": "fsdp",
}


def make_mesh(data: int = -1, fsdp: int = 1, devices=None, num_processes: int | None = None) -> Mesh:
  """`data=-1` takes every device not used by `fsdp`.

  One process may use a leading part of its devices; several must use all of them (a
  process outside the mesh would have nothing to feed).
  """
  devices = list(devices if devices is not None else jax.devices())
  processes = num_processes or jax.process_count()
  where = (f"the {len(devices)} devices of {processes} processes" if processes > 1
           else f"the {len(devices)} devices")
  if fsdp < 1 or len(devices) % fsdp:
    raise ConfigError(f"mesh.fsdp={fsdp} must divide {where}")
  if data == -1:
    data = len(devices) // fsdp
  if data < 1 or data * fsdp > len(devices):
    raise ConfigError(f"mesh data={data} x fsdp={fsdp} needs more than {where}")
  if processes > 1 and data * fsdp != len(devices):
    raise ConfigError(f"mesh data={data} x fsdp={fsdp} = {data * fsdp} devices must span all "
                      f"{where} (or leave mesh.data=-1)")
  return Mesh(np.array(devices[:data * fsdp]).reshape(data, fsdp), BATCH_AXES)


def param_sharding(mesh: Mesh, tree):
  """Each parameter of `tree` (params, or a train state holding them) split over `fsdp` as
  `RULES` say; scalars replicated."""
  return partitioning.shardings(mesh, partitioning.param_specs(tree, RULES, mesh))


def activation_layout(mesh: Mesh) -> partitioning.Layout:
  """The train step's activations on `mesh`: rows over data x fsdp, logits' vocabulary over fsdp."""
  return partitioning.Layout(mesh, RULES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, partitioning.spec(partitioning.ROWS_AXES, RULES, mesh))


def check_batch(mesh: Mesh, batch_size: int, num_processes: int | None = None) -> None:
  processes = num_processes or jax.process_count()
  if batch_size % processes:
    raise ConfigError(f"train.batch_size={batch_size} (the global batch) must split evenly over "
                      f"the {processes} processes")
  ways = mesh.shape["data"] * mesh.shape["fsdp"]
  if batch_size % ways:
    raise ConfigError(f"batch_size={batch_size} must be a multiple of data x fsdp = {ways}")
