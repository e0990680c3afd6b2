"""Pallas (Triton) tree-verify attention: flash-style over the committed cache, then the new rows.

One program owns one (batch row, kv head, kv split, block of query rows). Its query rows are the
G query heads of that kv head times a run of query positions, flattened t-major (row r is query
t = r // G, head g = r % G), so every K/V tile is loaded once for all the heads that share it.
Scores live in the log2 domain (scaled by log2(e) / sqrt(H)) so the softmax uses exp2.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Finite, so a row that has seen only masked scores keeps m finite and alpha = exp2(0), not NaN.
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)
_MIN_BLOCK = 16  # Triton's dot needs every matmul dim >= 16


def _next_pow2(x: int) -> int:
  return 1 << max(x - 1, 0).bit_length()


def _kernel(len_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, mask_ref, o_ref, *stat_refs,
            scale_log2: float, block_kv: int, block_new: int, kv_splits: int):
  """Online softmax over this split's cache blocks, plus (split 0 only) the new rows."""
  split = pl.program_id(2)
  cache_len = len_ref[()]
  num_slots = k_ref.shape[0]
  rows, head_dim = q_ref.shape
  q_rh = q_ref[...]

  def step(carry, k_ch, v_ch, valid_rc):
    """Folds one tile of keys into (o, m, l); valid_rc None means every key counts."""
    o_rh, m_r, l_r = carry
    s_rc = plgpu.dot(q_rh, k_ch.astype(q_rh.dtype), trans_b=True) * scale_log2  # f32 accumulation
    if valid_rc is not None:
      s_rc = jnp.where(valid_rc, s_rc, _MASK)
    m_new_r = jnp.maximum(m_r, s_rc.max(axis=-1))
    alpha_r = jnp.exp2(m_r - m_new_r)
    p_rc = jnp.exp2(s_rc - m_new_r[:, None])
    if valid_rc is not None:
      # Zero, not merely tiny: a row with no valid key yet must not accumulate garbage values.
      p_rc = jnp.where(valid_rc, p_rc, 0.0)
    l_new_r = alpha_r * l_r + p_rc.sum(axis=-1)
    o_new_rh = alpha_r[:, None] * o_rh + plgpu.dot(p_rc.astype(v_ch.dtype), v_ch)
    return o_new_rh, m_new_r, l_new_r

  def full_block(i, carry):
    window = pl.ds(i * block_kv, block_kv)
    return step(carry, k_ref[window, :], v_ref[window, :], None)

  def tail_block(i, carry):
    # The window is pulled back inside the buffer when S is not a multiple of block_kv; slots
    # below i * block_kv were already counted by the previous block and are masked out again.
    start = jnp.minimum(i * block_kv, num_slots - block_kv)
    slot_c = start + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
    valid_c = (slot_c >= i * block_kv) & (slot_c < cache_len)
    window = pl.ds(start, block_kv)
    # Slots past cache_len are garbage: zero them so even inf there cannot reach the sum.
    v_ch = jnp.where(valid_c[:, None], v_ref[window, :], jnp.zeros((), v_ref.dtype))
    valid_rc = jnp.broadcast_to(valid_c[None, :], (rows, block_kv))
    return step(carry, k_ref[window, :], v_ch, valid_rc)

  def new_block(j, carry):
    window = pl.ds(j * block_new, block_new)
    valid_rc = mask_ref[:, window] != 0
    return step(carry, kn_ref[window, :], vn_ref[window, :], valid_rc)

  carry = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), _MASK, jnp.float32),
           jnp.zeros((rows,), jnp.float32))
  num_full = cache_len // block_kv
  num_blocks = pl.cdiv(cache_len, block_kv)
  # Splits share the row's valid blocks, not the buffer, so a short prefix still spreads out.
  blocks_per_split = pl.cdiv(num_blocks, kv_splits)
  lo = jnp.minimum(split * blocks_per_split, num_blocks)
  hi = jnp.minimum(lo + blocks_per_split, num_blocks)
  carry = lax.fori_loop(lo, jnp.minimum(hi, num_full), full_block, carry)
  carry = lax.fori_loop(jnp.maximum(lo, num_full), hi, tail_block, carry)
  num_new_blocks = jnp.where(split == 0, kn_ref.shape[0] // block_new, 0)
  o_rh, m_r, l_r = lax.fori_loop(0, num_new_blocks, new_block, carry)

  if kv_splits == 1:
    # A row that may read nothing (only padding rows) gets zeros instead of 0 / 0.
    o_rh = o_rh / jnp.where(l_r > 0.0, l_r, 1.0)[:, None]
  o_ref[...] = o_rh.astype(o_ref.dtype)
  if stat_refs:
    m_ref, l_ref = stat_refs
    m_ref[...] = m_r
    l_ref[...] = l_r


def tree_attention_pallas(q_btnh: jax.Array, k_cache_bskh: jax.Array, v_cache_bskh: jax.Array,
                          cache_len_b: jax.Array, k_new_btkh: jax.Array, v_new_btkh: jax.Array,
                          new_mask_btt: jax.Array, *, interpret: bool = False, block_kv: int = 64,
                          block_rows: int = 64, kv_splits: int = 1, num_warps: int = 4,
                          num_stages: int = 2) -> jax.Array:
  """Pallas tree attention; same contract as `tree_attention(..., impl="pallas")`.

  block_kv: cache slots per step; block_rows: (query, head) rows per program, capped at the padded
  T * G. Both powers of two >= 16, as is H. kv_splits > 1 splits each row's valid cache blocks
  over that many programs (flash-decoding) and merges them here in float32: worth it when
  B * K * row blocks is well below the GPU's SM count (small T, small batch).
  """
  b, t, n, h = q_btnh.shape
  s, k = k_cache_bskh.shape[1], k_cache_bskh.shape[2]
  g = n // k
  for name, size in (("block_kv", block_kv), ("block_rows", block_rows)):
    if size < _MIN_BLOCK or size & (size - 1):
      raise ValueError(f"{name}={size} must be a power of two >= {_MIN_BLOCK}")
  if h < _MIN_BLOCK or h & (h - 1):
    raise ValueError(f"head_dim={h} must be a power of two >= {_MIN_BLOCK} for Triton")
  if kv_splits < 1:
    raise ValueError(f"kv_splits={kv_splits} must be >= 1")

  # Query rows: [B, K, T * G, H], padded to whole row blocks.
  rows = min(block_rows, _next_pow2(max(t * g, _MIN_BLOCK)))
  r_pad = pl.cdiv(t * g, rows) * rows
  q_bkrh = q_btnh.reshape(b, t, k, g, h).transpose(0, 2, 1, 3, 4).reshape(b, k, t * g, h)
  q_bkrh = jnp.pad(q_bkrh, ((0, 0), (0, 0), (0, r_pad - t * g), (0, 0)))
  # New rows: [B, K, T', H] with T' a whole number of new-row blocks; padded keys are masked.
  block_new = min(block_kv, _next_pow2(max(t, _MIN_BLOCK)))
  t_pad = pl.cdiv(t, block_new) * block_new
  pad_new = lambda x: jnp.pad(x.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, t_pad - t), (0, 0)))
  k_new_bkth, v_new_bkth = pad_new(k_new_btkh), pad_new(v_new_btkh)
  # The mask repeated per head row, as int8 (Triton has no bool memory type).
  mask_brt = jnp.repeat(new_mask_btt.astype(jnp.int8), g, axis=1)
  mask_brt = jnp.pad(mask_brt, ((0, 0), (0, r_pad - t * g), (0, t_pad - t)))
  # Only a cache shorter than one block is padded (a small copy); longer ones are read in place.
  if s < block_kv:
    pad_cache = lambda x: jnp.pad(x, ((0, 0), (0, block_kv - s), (0, 0), (0, 0)))
    k_cache_bskh, v_cache_bskh = pad_cache(k_cache_bskh), pad_cache(v_cache_bskh)
  s_pad = k_cache_bskh.shape[1]

  kernel = functools.partial(
      _kernel, scale_log2=math.log2(math.e) / math.sqrt(h), block_kv=block_kv,
      block_new=block_new, kv_splits=kv_splits)
  grid = (b, k, kv_splits, r_pad // rows)
  cache_spec = pl.BlockSpec((None, s_pad, None, h), lambda bi, ki, si, ri: (bi, 0, ki, 0))
  new_spec = pl.BlockSpec((None, None, t_pad, h), lambda bi, ki, si, ri: (bi, ki, 0, 0))
  in_specs = [
      pl.BlockSpec((None,), lambda bi, ki, si, ri: (bi,)),
      pl.BlockSpec((None, None, rows, h), lambda bi, ki, si, ri: (bi, ki, ri, 0)),
      cache_spec, cache_spec, new_spec, new_spec,
      pl.BlockSpec((None, rows, t_pad), lambda bi, ki, si, ri: (bi, ri, 0)),
  ]
  # One split writes the finished output; several write unnormalized f32 partials + (m, l).
  out_dtype = q_btnh.dtype if kv_splits == 1 else jnp.float32
  out_shape = [jax.ShapeDtypeStruct((kv_splits, b, k, r_pad, h), out_dtype)]
  out_specs = [pl.BlockSpec((None, None, None, rows, h),
                            lambda bi, ki, si, ri: (si, bi, ki, ri, 0))]
  if kv_splits > 1:
    stat_spec = pl.BlockSpec((None, None, None, rows), lambda bi, ki, si, ri: (si, bi, ki, ri))
    out_shape += [jax.ShapeDtypeStruct((kv_splits, b, k, r_pad), jnp.float32)] * 2
    out_specs += [stat_spec, stat_spec]
  outs = pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret, name="tree_attention",
  )(jnp.clip(cache_len_b, 0, s).astype(jnp.int32), q_bkrh, k_cache_bskh, v_cache_bskh,
    k_new_bkth, v_new_bkth, mask_brt)

  if kv_splits == 1:
    out_bkrh = outs[0][0]
  else:
    o_sbkrh, m_sbkr, l_sbkr = outs
    # Log-sum-exp merge of the splits (scores are in the log2 domain).
    w_sbkr = jnp.exp2(m_sbkr - m_sbkr.max(axis=0))
    l_bkr = (w_sbkr * l_sbkr).sum(axis=0)
    o_bkrh = (w_sbkr[..., None] * o_sbkrh).sum(axis=0)
    out_bkrh = (o_bkrh / jnp.where(l_bkr > 0.0, l_bkr, 1.0)[..., None]).astype(q_btnh.dtype)
  out_bktgh = out_bkrh[:, :, :t * g].reshape(b, k, t, g, h)
  return out_bktgh.transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)
