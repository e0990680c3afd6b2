"""A (data, fsdp) device mesh: the batch splits over both axes, params over `fsdp`.

The mesh spans every process's devices, in process order, so `fsdp` groups neighbouring
devices (one host's, when fsdp is at most the devices per host) and each process feeds one
contiguous run of the batch's rows. On one device every sharding is trivial and the step
is plain jit.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jetflow_jax.errors import ConfigError

BATCH_AXES = ("data", "fsdp")


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
  """Each leaf split over `fsdp` along its largest divisible axis; replicated otherwise."""
  fsdp = mesh.shape["fsdp"]

  def spec(leaf):
    shape = leaf.shape
    axes = sorted(range(len(shape)), key=lambda i: -shape[i])
    for axis in axes:
      if fsdp > 1 and shape[axis] % fsdp == 0:
        return NamedSharding(mesh, P(*[("fsdp" if i == axis else None) for i in range(len(shape))]))
    return NamedSharding(mesh, P())

  return jax.tree.map(spec, tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(BATCH_AXES))


def check_batch(mesh: Mesh, batch_size: int, num_processes: int | None = None) -> None:
  processes = num_processes or jax.process_count()
  if batch_size % processes:
    raise ConfigError(f"train.batch_size={batch_size} (the global batch) must split evenly over "
                      f"the {processes} processes")
  ways = mesh.shape["data"] * mesh.shape["fsdp"]
  if batch_size % ways:
    raise ConfigError(f"batch_size={batch_size} must be a multiple of data x fsdp = {ways}")
