"""Attention masks of the draft head: which keys each block row may read.

Keys are laid out as [context rows | block rows]. Context row j holds the fused
target taps of token j. Block rows are `[anchor, MASK x (block - 1)]` per anchor.
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


def decode_mask(context_len_b: jax.Array, cache_size: int, block_size: int,
                causal: bool) -> jax.Array:
  """[B, block, cache_size] mask for one block stored right after the context in a cache.

  Row b's context fills slots [0, context_len), its block slots
  [context_len, context_len + block); later slots are stale and hidden.
  """
  slots = jnp.arange(cache_size)[None, None, :]
  start = context_len_b[:, None, None]
  offset_in_block = slots - start
  row = jnp.arange(block_size)[None, :, None]
  in_block = (offset_in_block >= 0) & (offset_in_block < block_size)
  visible_in_block = offset_in_block <= row if causal else True
  mask = (slots < start) | (in_block & visible_in_block)
  return jnp.broadcast_to(mask, (context_len_b.shape[0], block_size, cache_size))
