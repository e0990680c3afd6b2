"""Attention masks of the draft head: which keys each block row may read.

Keys are laid out as [context rows | block rows]. Context row j holds the fused
target taps of token j. Block rows are `[anchor, MASK x (block - 1)]` per anchor.
At decode time the head reads its context cache plus one block under
`in_block_mask` (see `head.draft_block`). `training_mask` is what the training pass
computes; only its dense reference path builds it (see `kernels.train_attention`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def in_block_mask(block_size: int, causal: bool) -> jax.Array:
  """[block, block]: offset i reads offset j iff j <= i (JetFlow) or always (DFlash)."""
  if causal:
    return jnp.tril(jnp.ones((block_size, block_size), bool))
  return jnp.ones((block_size, block_size), bool)


def training_mask(anchors_ba: jax.Array, num_context: int, block_size: int,
                  causal: bool) -> jax.Array:
  """[B, A * block, num_context + A * block] mask for many anchors packed in one forward.

  Block rows of anchor a read context rows j < a and, inside their own block,
  offsets as `in_block_mask` says; other anchors' blocks are invisible.
  """
  batch, num_anchors = anchors_ba.shape
  row_anchor = jnp.repeat(jnp.arange(num_anchors), block_size)
  context = jnp.arange(num_context)[None, None, :] < jnp.repeat(anchors_ba, block_size,
                                                                  axis=1)[:, :, None]
  same_anchor = row_anchor[:, None] == row_anchor[None, :]
  offsets = jnp.tile(in_block_mask(block_size, causal), (num_anchors, num_anchors))
  blocks = jnp.broadcast_to(same_anchor & offsets, (batch,) + same_anchor.shape)
  return jnp.concatenate([context, blocks], axis=-1)
