"""Head attention under the packed-anchor training mask, without the dense score matrix.

The T = A * block query rows are A packed blocks `[x_a, MASK...]`: the block of anchor a reads
the context keys start_a <= s < a (start_a: where a's sample begins in a packed row, else 0) and
its own block (causally or not, see `masks.in_block_mask`), nothing
else. The dense reference scores every row against [context | all blocks] under
`masks.training_mask`; the split forms score the context prefix (`[T, S]` in XLA, tile by tile
and only below each anchor in the Pallas kernel) and each block against itself
(`[A, block, block]`), and put both parts under one softmax, so the cross-block scores (A times
the in-block ones) are never formed.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp

from jetflow_jax.attention import attention
from jetflow_jax.kernels.train_attention_pallas import prefix_attention_pallas
from jetflow_jax.masks import context_visible, in_block_mask, training_mask

TrainAttentionImpl = Literal["dense", "split", "pallas"]


def train_attention_dense(q_btnh: jax.Array, k_ctx_bskh: jax.Array, v_ctx_bskh: jax.Array,
                          k_blk_btkh: jax.Array, v_blk_btkh: jax.Array, anchors_ba: jax.Array,
                          causal: bool, context_start_ba: jax.Array) -> jax.Array:
  """Reference: masked attention over the context followed by every block."""
  block = q_btnh.shape[1] // anchors_ba.shape[1]
  mask_bts = training_mask(anchors_ba, k_ctx_bskh.shape[1], block, causal, context_start_ba)
  keys_bskh = jnp.concatenate([k_ctx_bskh, k_blk_btkh], axis=1)
  values_bskh = jnp.concatenate([v_ctx_bskh, v_blk_btkh], axis=1)
  return attention(q_btnh, keys_bskh, values_bskh, mask_bts)


def _by_block(q_btnh, k_blk_btkh, v_blk_btkh, num_anchors: int):
  """q as `[B, A, I, K, G, H]` (I the block offset), block keys/values as `[B, A, J, K, H]`."""
  b, t, n, h = q_btnh.shape
  k = k_blk_btkh.shape[2]
  block = t // num_anchors
  q_baikgh = q_btnh.reshape(b, num_anchors, block, k, n // k, h)
  as_blocks = lambda x_btkh: x_btkh.reshape(b, num_anchors, block, k, h)
  return q_baikgh, as_blocks(k_blk_btkh), as_blocks(v_blk_btkh)


def _block_scores(q_baikgh, k_bajkh, causal: bool):
  """[B, A, K, G, I, J] scaled scores of each block against itself, -inf where masked."""
  scale = 1.0 / math.sqrt(q_baikgh.shape[-1])
  s_bakgij = jnp.einsum("baikgh,bajkh->bakgij", q_baikgh, k_bajkh,
                        preferred_element_type=jnp.float32) * scale
  return jnp.where(in_block_mask(q_baikgh.shape[2], causal), s_bakgij, -jnp.inf)


def _mix(p, values, spec: str):
  # Probabilities drop to the value dtype (as in flash attention); products sum in float32.
  return jnp.einsum(spec, p.astype(values.dtype), values, preferred_element_type=jnp.float32)


def _finish(o_baikgh, l_bakgi, shape):
  """Normalizes and returns `[B, T, N, H]`."""
  return (o_baikgh / l_bakgi.transpose(0, 1, 4, 2, 3)[..., None]).reshape(shape)


def train_attention_split(q_btnh: jax.Array, k_ctx_bskh: jax.Array, v_ctx_bskh: jax.Array,
                          k_blk_btkh: jax.Array, v_blk_btkh: jax.Array, anchors_ba: jax.Array,
                          causal: bool, context_start_ba: jax.Array) -> jax.Array:
  """XLA: context-prefix scores and in-block scores under one float32 softmax."""
  num_anchors = anchors_ba.shape[1]
  q_baikgh, k_bajkh, v_bajkh = _by_block(q_btnh, k_blk_btkh, v_blk_btkh, num_anchors)
  scale = 1.0 / math.sqrt(q_btnh.shape[-1])
  s_ctx_bakgis = jnp.einsum("baikgh,bskh->bakgis", q_baikgh, k_ctx_bskh,
                            preferred_element_type=jnp.float32) * scale
  visible_bas = context_visible(anchors_ba, k_ctx_bskh.shape[1], context_start_ba)
  s_ctx_bakgis = jnp.where(visible_bas[:, :, None, None, None, :], s_ctx_bakgis, -jnp.inf)
  s_blk_bakgij = _block_scores(q_baikgh, k_bajkh, causal)

  # Offset i always reads itself, so m is finite; the softmax does not depend on it.
  m_bakgi = jax.lax.stop_gradient(jnp.maximum(s_ctx_bakgis.max(-1), s_blk_bakgij.max(-1)))
  p_ctx_bakgis = jnp.exp(s_ctx_bakgis - m_bakgi[..., None])
  p_blk_bakgij = jnp.exp(s_blk_bakgij - m_bakgi[..., None])
  l_bakgi = p_ctx_bakgis.sum(-1) + p_blk_bakgij.sum(-1)
  o_baikgh = (_mix(p_ctx_bakgis, v_ctx_bskh, "bakgis,bskh->baikgh")
              + _mix(p_blk_bakgij, v_bajkh, "bakgij,bajkh->baikgh"))
  return _finish(o_baikgh, l_bakgi, q_btnh.shape).astype(q_btnh.dtype)


def _merge_in_block(o_ctx_btnh, lse_ctx_btn, q_btnh, k_blk_btkh, v_blk_btkh, num_anchors: int,
                    causal: bool):
  """Adds the in-block part to a normalized context part through its log-sum-exp."""
  q_baikgh, k_bajkh, v_bajkh = _by_block(q_btnh, k_blk_btkh, v_blk_btkh, num_anchors)
  lse_bakgi = lse_ctx_btn.reshape(q_baikgh.shape[:-1]).transpose(0, 1, 3, 4, 2)
  s_blk_bakgij = _block_scores(q_baikgh, k_bajkh, causal)
  m_bakgi = jax.lax.stop_gradient(jnp.maximum(lse_bakgi, s_blk_bakgij.max(-1)))
  w_ctx_bakgi = jnp.exp(lse_bakgi - m_bakgi)
  p_blk_bakgij = jnp.exp(s_blk_bakgij - m_bakgi[..., None])
  l_bakgi = w_ctx_bakgi + p_blk_bakgij.sum(-1)
  o_ctx_baikgh = o_ctx_btnh.reshape(q_baikgh.shape).astype(jnp.float32)
  o_baikgh = (w_ctx_bakgi.transpose(0, 1, 4, 2, 3)[..., None] * o_ctx_baikgh
              + _mix(p_blk_bakgij, v_bajkh, "bakgij,bajkh->baikgh"))
  return _finish(o_baikgh, l_bakgi, q_btnh.shape).astype(q_btnh.dtype)


def _in_anchor_chunks(attend, chunk: int, q_btnh, k_ctx_bskh, v_ctx_bskh, k_blk_btkh,
                      v_blk_btkh, anchors_ba, causal: bool, context_start_ba):
  """`attend` over `chunk` anchors at a time, each chunk recomputed in the backward pass, so
  one chunk's scores and probabilities exist at once (not all A anchors', in every layer).

  The anchor axis is padded to whole chunks with anchors at position 0: their rows read no
  context, only their own zero block, and are dropped from the output.
  """
  batch, rows, heads, head_dim = q_btnh.shape
  num_anchors = anchors_ba.shape[1]
  block = rows // num_anchors
  num_chunks = -(-num_anchors // chunk)
  pad = num_chunks * chunk - num_anchors

  def split(x_ba, per_anchor: int):  # [B, A * per_anchor, ...] -> [chunks, B, chunk * per_anchor, ...]
    x = x_ba.reshape(batch, num_anchors, per_anchor, *x_ba.shape[2:])
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(batch, num_chunks, chunk * per_anchor, *x_ba.shape[2:])
    return jnp.moveaxis(x, 1, 0)

  def one_chunk(args):
    q, k_blk, v_blk, anchors, starts = args
    return attend(q, k_ctx_bskh, v_ctx_bskh, k_blk, v_blk, anchors, causal, starts)

  # Inside a map the recomputation cannot be merged away, so CSE need not be prevented.
  out_cbtnh = jax.lax.map(jax.checkpoint(one_chunk, prevent_cse=False),
                          (split(q_btnh, block), split(k_blk_btkh, block),
                           split(v_blk_btkh, block), split(anchors_ba, 1),
                           split(context_start_ba, 1)))
  out_btnh = jnp.moveaxis(out_cbtnh, 0, 1).reshape(batch, -1, heads, head_dim)
  return out_btnh[:, :rows]


def train_attention(q_btnh: jax.Array, k_ctx_bskh: jax.Array, v_ctx_bskh: jax.Array,
                    k_blk_btkh: jax.Array, v_blk_btkh: jax.Array, anchors_ba: jax.Array,
                    causal: bool, context_start_ba: jax.Array | None = None, *,
                    impl: TrainAttentionImpl = "split", chunk_anchors: int = 0,
                    interpret: bool = False, block_kv: int = 64, num_warps: int = 4,
                    num_stages: int = 2) -> jax.Array:
  """Attention of A packed blocks over their context prefixes and themselves; output `[B, T, N, H]`.

  q `[B, T, N, H]` and the block keys/values `[B, T, K, H]` hold A = anchors_ba.shape[1] blocks
  of T / A rows (RoPE applied); context keys/values are `[B, S, K, H]`. Rows of anchor a read
  context keys context_start_ba[a] <= s < a (start 0 by default; in packed rows, where a's
  sample begins) and, inside their block, offsets j <= i (causal) or all of them. Query head
  n uses kv head n // (N / K); float32 softmax, output in q's dtype. `impl`: "dense" (masked
  reference), "split" (XLA) or "pallas" (the prefix part in a Triton kernel, see
  `prefix_attention_pallas`, which `block_kv`, `num_warps` and `num_stages` tune).
  `chunk_anchors` > 0 runs "split" that many anchors at a time under remat: its `[T, S]`
  scores, the largest activations of head training, then exist one chunk at a time (the
  kernel never forms them).
  """
  num_anchors = anchors_ba.shape[1]
  if q_btnh.shape[1] % num_anchors:
    raise ValueError(f"{q_btnh.shape[1]} query rows do not split into {num_anchors} blocks")
  if context_start_ba is None:
    context_start_ba = jnp.zeros_like(anchors_ba)
  with jax.named_scope("train_attention"):
    args = (q_btnh, k_ctx_bskh, v_ctx_bskh, k_blk_btkh, v_blk_btkh, anchors_ba, causal,
            context_start_ba)
    if impl == "dense":
      return train_attention_dense(*args)
    if impl == "split":
      if 0 < chunk_anchors < num_anchors:
        return _in_anchor_chunks(train_attention_split, chunk_anchors, *args)
      return train_attention_split(*args)
    if impl == "pallas":
      o_ctx_btnh, lse_ctx_btn = prefix_attention_pallas(
          q_btnh, k_ctx_bskh, v_ctx_bskh, anchors_ba, context_start_ba, interpret=interpret,
          block_kv=block_kv, num_warps=num_warps, num_stages=num_stages)
      return _merge_in_block(o_ctx_btnh, lse_ctx_btn, q_btnh, k_blk_btkh, v_blk_btkh,
                             num_anchors, causal)
  raise ValueError(f"unknown train attention impl {impl!r}")
