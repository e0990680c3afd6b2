"""Where arrays live: logical axes, the rules that map them to mesh axes, and abstract values
with shardings (one helper for every compile-ahead path).

Every dimension of a parameter (target or head), of the KV cache and of the batch has a
logical name, the axis alphabet spelled out: `batch` B, `sequence` T/S, `vocab` V, `embed` D,
`taps` (the head's input, taps x D), `q_heads` N, `kv_heads` K, `head_dim` H, `mlp` F,
`experts` E; None marks a dimension never split. Each mesh has its own rules, an ordered
table from logical axis to mesh axes: the decode mesh (`mesh.py`) splits heads, MLP
columns and the vocabulary over `tp` and experts over `ep`; the training mesh
(`train/sharding.py`) splits each parameter over `fsdp`. `spec` reads a table: the specs of
parameters, caches and batches are written nowhere else.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

KEEP = "keep"  # `abstract(tree, KEEP)`: each leaf where its array already is

Axes = tuple[str | None, ...]  # one logical axis per dimension
Rules = Mapping[str, str | tuple[str, ...]]  # logical axis -> mesh axis or axes, in preference

CACHE_AXES: Axes = ("batch", "sequence", "kv_heads", "head_dim")  # a KV cache buffer [B, S, K, H]
ROWS_AXES: Axes = ("batch",)  # the leading axis of batch-major arrays (tokens, lengths, ...)

# (module, leaf) at the end of a parameter's path -> its logical axes.
_PARAM_AXES: dict[tuple[str, str], Axes] = {
    ("embed_tokens", "embedding"): ("vocab", "embed"),
    ("lm_head", "kernel"): ("embed", "vocab"),
    ("q_proj", "kernel"): ("embed", "q_heads", "head_dim"),
    ("k_proj", "kernel"): ("embed", "kv_heads", "head_dim"),
    ("v_proj", "kernel"): ("embed", "kv_heads", "head_dim"),
    ("o_proj", "kernel"): ("q_heads", "head_dim", "embed"),
    ("q_norm", "scale"): ("head_dim",),
    ("k_norm", "scale"): ("head_dim",),
    ("gate_proj", "kernel"): ("embed", "mlp"),
    ("up_proj", "kernel"): ("embed", "mlp"),
    ("down_proj", "kernel"): ("mlp", "embed"),
    ("experts", "gate_proj"): ("experts", "embed", "mlp"),
    ("experts", "up_proj"): ("experts", "embed", "mlp"),
    ("experts", "down_proj"): ("experts", "mlp", "embed"),
    # The MoE router: every shard routes all of its rows, so the experts' logits stay whole.
    ("gate", "kernel"): ("embed", None),
    ("fc", "kernel"): ("taps", "embed"),  # the head's projection of the target's taps
    # A draft vocabulary's target ids: every shard maps any drafted id, so kept whole.
    ("draft_vocab", "target_ids"): (None,),
}


KernelLayout = Literal["in_out", "out_in"]  # how projection kernels are stored: `model.py` says


def kernel_layout(params) -> KernelLayout:
  """How a target's or a head's projection kernels are stored (read off its first layer); the
  logical axes above name in_out's dimensions."""
  return "out_in" if params["layers_0"]["self_attn"]["q_proj"]["kernel"].ndim == 2 else "in_out"


def param_axes(names: Sequence[str], ndim: int) -> Axes:
  """The logical axes of a target or head parameter, from the names on its path (the last two
  name it, so an optimizer's moments of a parameter read the same)."""
  key = tuple(names[-2:])
  axes = _PARAM_AXES.get(key, ("embed",) if key[-1:] == ("scale",) else None)  # RMSNorms
  if axes is None or len(axes) != ndim:
    raise ValueError(f"no logical axes for parameter {'/'.join(names)} with {ndim} dimensions")
  return axes


def spec(axes: Axes, rules: Rules, mesh: Mesh | None = None,
         shape: Sequence[int | None] | None = None) -> P:
  """The `PartitionSpec` of an array whose dimensions have the logical `axes`, under `rules`.

  The rules are read in order: a rule's mesh axes split the first dimension of its logical
  axis, less those an earlier rule already took (a mesh axis splits one dimension), unless,
  given `shape`, they do not divide its size (None: unknown, never refused); then a later
  rule may take them. So with `{"vocab": "fsdp", "batch": ("data", "fsdp")}` logits
  `("batch", "vocab")` split their rows over data and their vocabulary over fsdp, and arrays
  without a vocabulary split their rows over both. Mesh axes that `mesh` lacks are left out.
  An array none of whose axes the rules name is P(); the others get one entry per dimension.
  """
  if not any(axis in rules for axis in axes):
    return P()
  entries: list = [None] * len(axes)
  used: set[str] = set()
  for name, target in rules.items():
    mesh_axes = (target,) if isinstance(target, str) else tuple(target)
    mesh_axes = tuple(a for a in mesh_axes
                      if a not in used and (mesh is None or a in mesh.shape))
    if not mesh_axes:
      continue
    ways = math.prod(mesh.shape[a] for a in mesh_axes) if mesh is not None else 1
    for i, axis in enumerate(axes):
      if axis != name or entries[i] is not None:
        continue
      if shape is not None and shape[i] is not None and shape[i] % ways:
        continue
      entries[i] = mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes
      used.update(mesh_axes)
      break
  return P(*entries)


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
  """Where a jitted step's activations live: `layout(x, axes)` pins `x` (logical `axes`, one
  per dimension) to `mesh` under `rules`; with no mesh it returns `x` as it is.

  The partitioner infers every other placement from the arguments', which is not enough: a
  gather from a table split along its width, or a matmul against a weight split along its
  input, can leave the batch whole on every device, and then each device does every row's
  work. A step pins its activations at the places that decide it.
  """
  mesh: Mesh | None = None
  rules: Rules = dataclasses.field(default_factory=dict)

  def __call__(self, x: jax.Array, axes: Axes) -> jax.Array:
    if self.mesh is None:
      return x
    where = NamedSharding(self.mesh, spec(axes, self.rules, self.mesh, x.shape))
    return jax.lax.with_sharding_constraint(x, where)

  def rows(self, x: jax.Array) -> jax.Array:
    """`x` with its leading axis the batch and the others whole."""
    return self(x, ("batch",) + (None,) * (x.ndim - 1))

  def params(self, tree):
    """A tree of parameters where the rules store them (split, not gathered for use)."""
    if self.mesh is None:
      return tree
    return jax.lax.with_sharding_constraint(
        tree, shardings(self.mesh, param_specs(tree, self.rules, self.mesh)))


def param_specs(tree, rules: Rules, mesh: Mesh | None = None):
  """A `PartitionSpec` for every leaf of a tree of parameters, or of anything holding them
  (a train state, an optimizer state): each parameter by its logical axes, scalars P()."""
  def leaf_spec(path, leaf):
    shape = np.shape(leaf)
    if not shape:
      return P()
    names = [key.key for key in path if isinstance(key, jax.tree_util.DictKey)]
    return spec(param_axes(names, len(shape)), rules, mesh, shape)
  return jax.tree_util.tree_map_with_path(leaf_spec, tree)


def shardings(mesh: Mesh, specs):
  """A tree of `PartitionSpec`s as `NamedSharding`s on `mesh`."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def abstract(tree, sharding=None):
  """`jax.ShapeDtypeStruct`s of `tree`'s leaves (arrays or abstract values).

  `sharding`: None (no placement), one `jax.sharding.Sharding` for every leaf, a pytree of
  shardings shaped like `tree`, or `KEEP` (each leaf's own `.sharding`, where it has one).
  """
  def leaf(x, where=None):
    dtype = x.dtype if hasattr(x, "dtype") else jnp.result_type(x)  # key arrays keep theirs
    return jax.ShapeDtypeStruct(np.shape(x), dtype, sharding=where)

  if sharding is None:
    return jax.tree.map(leaf, tree)
  if isinstance(sharding, str) and sharding == KEEP:
    return jax.tree.map(lambda x: leaf(x, getattr(x, "sharding", None)), tree)
  if isinstance(sharding, jax.sharding.Sharding):
    return jax.tree.map(lambda x: leaf(x, sharding), tree)
  return jax.tree.map(leaf, tree, sharding)
