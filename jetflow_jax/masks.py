"""Attention masks of the draft head: which keys each block row may read.

Keys are laid out as [context rows | block rows]. Context row j holds the fused
target taps of token j. Block rows are `[anchor, MASK x (block - 1)]` per anchor.
At decode time the head reads its context cache plus one block under
`in_block_mask` (see `head.draft_block`). `training_mask` is what the training pass
computes; only its dense reference path builds it (see `kernels.train_attention`).
Packed training rows hold several samples; `segment_starts` and `packed_causal_mask`
keep each sample to itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def in_block_mask(block_size: int, causal: bool) -> jax.Array:
  """[block, block]: offset i reads offset j iff j <= i (JetFlow) or always (DFlash)."""
  if causal:
    return jnp.tril(jnp.ones((block_size, block_size), bool))
  return jnp.ones((block_size, block_size), bool)


def context_visible(anchors_ba: jax.Array, num_context: int,
                    context_start_ba: jax.Array | None = None) -> jax.Array:
  """[B, A, num_context]: anchor a's block reads context row j iff context_start <= j < a.

  The start is 0 unless given (in a packed row: the first row of a's sample).
  """
  if context_start_ba is None:
    context_start_ba = jnp.zeros_like(anchors_ba)
  j = jnp.arange(num_context)[None, None, :]
  return (j < anchors_ba[:, :, None]) & (j >= context_start_ba[:, :, None])


def training_mask(anchors_ba: jax.Array, num_context: int, block_size: int, causal: bool,
                  context_start_ba: jax.Array | None = None) -> jax.Array:
  """[B, A * block, num_context + A * block] mask for many anchors packed in one forward.

  Block rows of anchor a read the context rows `context_visible` gives them and, inside
  their own block, offsets as `in_block_mask` says; other anchors' blocks are invisible.
  """
  batch, num_anchors = anchors_ba.shape
  row_anchor = jnp.repeat(jnp.arange(num_anchors), block_size)
  context = jnp.repeat(context_visible(anchors_ba, num_context, context_start_ba), block_size,
                       axis=1)
  same_anchor = row_anchor[:, None] == row_anchor[None, :]
  offsets = jnp.tile(in_block_mask(block_size, causal), (num_anchors, num_anchors))
  blocks = jnp.broadcast_to(same_anchor & offsets, (batch,) + same_anchor.shape)
  return jnp.concatenate([context, blocks], axis=-1)


def segment_starts(segment_ids_bt: jax.Array) -> jax.Array:
  """[B, T]: the index of the first token of each token's segment (sample) in its row."""
  index_bt = jnp.broadcast_to(jnp.arange(segment_ids_bt.shape[1]), segment_ids_bt.shape)
  first_bt = jnp.concatenate([jnp.ones_like(segment_ids_bt[:, :1], bool),
                              segment_ids_bt[:, 1:] != segment_ids_bt[:, :-1]], axis=1)
  return jax.lax.cummax(jnp.where(first_bt, index_bt, 0), axis=1)


def packed_causal_mask(segment_starts_bt: jax.Array) -> jax.Array:
  """[B, T, T]: token t reads token s <= t of its own segment only."""
  index = jnp.arange(segment_starts_bt.shape[1])
  return ((index[None, None, :] <= index[None, :, None])
          & (index[None, None, :] >= segment_starts_bt[:, :, None]))
