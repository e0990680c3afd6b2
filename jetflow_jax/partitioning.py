"""Where arrays live: abstract values with shardings (one helper for every compile-ahead path)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

KEEP = "keep"  # `abstract(tree, KEEP)`: each leaf where its array already is


def abstract(tree, sharding=None):
  """`jax.ShapeDtypeStruct`s of `tree`'s leaves (arrays or abstract values).

  `sharding`: None (no placement), one `jax.sharding.Sharding` for every leaf, a pytree of
  shardings shaped like `tree`, or `KEEP` (each leaf's own `.sharding`, where it has one).
  """
  def leaf(x, where=None):
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=where)

  if sharding is None:
    return jax.tree.map(leaf, tree)
  if isinstance(sharding, str) and sharding == KEEP:
    return jax.tree.map(lambda x: leaf(x, getattr(x, "sharding", None)), tree)
  if isinstance(sharding, jax.sharding.Sharding):
    return jax.tree.map(lambda x: leaf(x, sharding), tree)
  return jax.tree.map(leaf, tree, sharding)
