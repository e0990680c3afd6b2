"""Acceptance of a verified draft tree: which branch the target agrees with, and its bonus token.

Pure array code, vectorised over nodes (no walk over the tree inside jit). The
target's choice at every node is drawn at once, one independent draw per node:
since the walk visits each node at most once, this is the same as drawing
sequentially along the walk, so acceptance is lossless for any sampler.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jetflow_jax.tree import DraftTree


def accepted_nodes(tree: DraftTree, choices_bn: jax.Array) -> jax.Array:
  """`[B, N]` bool: node i is accepted iff every node on its root path is the target's choice.

  The root always is. Siblings hold distinct tokens, so the accepted nodes form one path.
  """
  parent_choice_bn = jnp.take_along_axis(choices_bn, jnp.maximum(tree.parents, 0), axis=1)
  matches_bn = (tree.tokens == parent_choice_bn) | (tree.parents < 0)
  return jnp.all(matches_bn[:, None, :] | ~tree.ancestor_mask, axis=-1)


def accept(tree: DraftTree, choices_bn: jax.Array, max_depth: int):
  """Returns (path `[B, max_depth + 1]` node indices by depth, accepted depth `[B]`, emitted).

  `emitted[b, k]` for k <= accepted depth is the k-th committed token: the
  accepted draft tokens, then the bonus (the target's choice at the deepest
  accepted node). Both arrays hold junk past the accepted depth.
  """
  accepted_bn = accepted_nodes(tree, choices_bn)
  depths_d = jnp.arange(max_depth + 1, dtype=jnp.int32)
  at_depth_bdn = accepted_bn[:, None, :] & (tree.depths[:, None, :] == depths_d[None, :, None])
  path_bd = jnp.argmax(at_depth_bdn, axis=-1).astype(jnp.int32)
  accepted_depth_b = jnp.sum(jnp.any(at_depth_bdn, axis=-1), axis=-1).astype(jnp.int32) - 1
  # The choice at path node k is the token of path node k + 1 (accepted), or the bonus at the end.
  emitted_bd = jnp.take_along_axis(choices_bn, path_bd, axis=1)
  return path_bd, accepted_depth_b, emitted_bd
