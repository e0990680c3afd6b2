"""Decoding over a device mesh: rows data-parallel, the target tensor- and expert-parallel.

Mesh axes (any may be 1):
- `data`: rows of the batch, each device group holding a whole copy of the target;
- `tp`: attention heads, MLP columns/rows and the vocabulary (embedding and LM head);
- `ep`: the experts of MoE layers (their MLP width also splits over `tp`).

The KV cache splits over its kv heads along `tp` (replicated there when the target has
fewer kv heads than `tp`); the draft head and everything else in the decode state is
replicated. `RULES` maps the logical axes of every parameter, of the cache and of the batch
(`partitioning.py`) to these mesh axes; XLA inserts the collectives, except in MoE layers,
which run their experts per shard (`moe.MoE`).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jetflow_jax import partitioning
from jetflow_jax.config import Qwen3Config
from jetflow_jax.errors import InputError

AXES = ("data", "tp", "ep")
RULES: partitioning.Rules = {
    "batch": "data",
    "vocab": "tp", "q_heads": "tp", "kv_heads": "tp", "mlp": "tp",  # the experts' MLP too
    "experts": "ep",
}


def parse_mesh(text: str) -> dict[str, int]:
  """`tp=4,ep=2` -> {"tp": 4, "ep": 2}.

  Raises:
    InputError: an unknown axis, a size that is not a positive integer, or an axis given twice
      (each named).
  """
  sizes = {}
  for part in filter(None, (p.strip() for p in text.split(","))):
    name, _, value = part.partition("=")
    if name not in AXES:
      raise InputError(f"--mesh: unknown axis {name!r} in {text!r}; axes are {', '.join(AXES)}")
    if not re.fullmatch(r"\d+", value) or int(value) < 1:
      raise InputError(f"--mesh: {name}={value!r} must be a positive integer")
    if name in sizes:
      raise InputError(f"--mesh: axis {name} is given twice in {text!r}")
    sizes[name] = int(value)
  return sizes


@dataclasses.dataclass(frozen=True)
class DecodeMesh:
  """A (data, tp, ep) mesh and where each part of decoding lives on it.

  Attributes:
    mesh: the `jax.sharding.Mesh` with axes `data`, `tp`, `ep`.
  """

  mesh: Mesh

  @classmethod
  def create(cls, data: int = 1, tp: int = 1, ep: int = 1, devices=None) -> "DecodeMesh":
    """A mesh of `data x tp x ep` devices: the first ones of `devices` (default: all).

    Raises:
      InputError: more devices asked for than there are.
    """
    devices = list(jax.devices() if devices is None else devices)
    need = data * tp * ep
    if need > len(devices):
      raise InputError(f"--mesh data={data} x tp={tp} x ep={ep} needs {need} devices; "
                       f"{len(devices)} are available")
    return cls(Mesh(np.array(devices[:need]).reshape(data, tp, ep), AXES))

  def size(self, axis: str) -> int:
    """The size of one axis."""
    return self.mesh.shape[axis]

  def check(self, config: Qwen3Config) -> None:
    """Refuses a mesh the target cannot be split over.

    Raises:
      InputError: naming every reason.
    """
    tp, ep = self.size("tp"), self.size("ep")
    problems = []
    counts = [("attention heads", config.num_attention_heads),
              ("vocabulary entries", config.vocab_size)]
    if not all(config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
      counts.append(("MLP columns", config.intermediate_size))
    for what, count in counts:
      if count % tp:
        problems.append(f"tp={tp} does not divide the {count} {what}")
    k = config.num_key_value_heads
    if k % tp and tp % k:
      problems.append(f"tp={tp} neither divides nor is a multiple of the {k} kv heads")
    if ep > 1 and not config.is_moe:
      problems.append(f"ep={ep} needs an MoE target (this one is dense)")
    if config.is_moe:
      if config.num_experts % ep:
        problems.append(f"ep={ep} does not divide the {config.num_experts} experts")
      if config.moe_intermediate_size % tp:
        problems.append(f"tp={tp} does not divide the experts' {config.moe_intermediate_size} "
                        "MLP columns")
    if problems:
      raise InputError("--mesh does not fit the target: " + "; ".join(problems))

  def kv_heads_axis(self, config: Qwen3Config) -> str | None:
    """`tp` when the kv heads split over it, None when each device keeps all of them."""
    spec = partitioning.spec(("kv_heads",), RULES, self.mesh, (config.num_key_value_heads,))
    return spec[0] if spec else None

  def param_specs(self, config: Qwen3Config, params) -> dict:
    """A `PartitionSpec` for every leaf of the target's params, whose kernels are stored in_out
    (the logical axes name those dimensions)."""
    if partitioning.kernel_layout(params) != "in_out":
      raise InputError("a decode mesh splits params whose kernels are stored in_out, as they "
                       "load; these are out_in: `model.with_kernel_layout(params, \"in_out\")`")
    return partitioning.param_specs(params, RULES, self.mesh)

  def param_shardings(self, config: Qwen3Config, params):
    """`param_specs` as shardings, after `check`: whatever places a target on this mesh (its
    loading above all, before any weight is read) refuses a mesh it cannot take."""
    self.check(config)
    return partitioning.shardings(self.mesh, self.param_specs(config, params))

  def cache_sharding(self, config: Qwen3Config, batch: int | None = None) -> NamedSharding:
    """Where a `[B, S, K, H]` KV cache buffer lives; a `batch` the data-parallel copies cannot
    split (an engine's one-request prefill) is whole on every copy."""
    shape = (batch, None, config.num_key_value_heads, None)
    return NamedSharding(self.mesh, partitioning.spec(partitioning.CACHE_AXES, RULES, self.mesh,
                                                      shape))

  def rows(self) -> NamedSharding:
    """Arrays whose leading axis is the batch."""
    return NamedSharding(self.mesh, partitioning.spec(partitioning.ROWS_AXES, RULES, self.mesh))

  def replicated(self) -> NamedSharding:
    """The same value on every device."""
    return NamedSharding(self.mesh, P())

  def put(self, tree, sharding: NamedSharding):
    """Values (the same on every process) onto the mesh. Across processes, where `device_put`
    cannot reach other processes' devices, each fills only its own from a host copy."""
    if jax.process_count() == 1:
      return jax.device_put(tree, sharding)

    def put_leaf(x):
      if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
        return jax.random.wrap_key_data(put_leaf(jax.random.key_data(x)),
                                        impl=jax.random.key_impl(x))
      host = np.asarray(x)
      return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return jax.tree.map(put_leaf, tree)
