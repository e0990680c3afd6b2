"""Pallas (Mosaic TPU) tree-verify attention: flash-style over the read-only cache, then the tree.

Grid (batch row, kv-head group, cache block). A program owns every query row of its kv heads: the
G query heads times the T tree positions, laid out head-major (row r is head r // T', position
r % T', T' the padded T), so each cache block is fetched from HBM once for all of them. The cache
is viewed as `[B, S, K * H]` (a free reshape, never a copy) and a block spans the lanes of kb kv
heads, kb the fewest whose kb * H lanes are a multiple of 128 (1 at H = 128, 2 at H = 64; all K
heads when none is, a legal full-width block). Each query row carries its q in its own head's
lanes and zeros in the others, so one matmul serves every head of the block: at H = 64 the MXU
does twice the products, but no head is padded and the cache is not copied. Per-row cache lengths
come by scalar prefetch: the cache index_map clamps to the row's last valid block, so later steps
fetch nothing new, and pl.when skips their compute. The float32 online-softmax state lives in VMEM
scratch across the cache axis; the last step folds in the new rows under the tree mask and writes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Finite, so a row that has seen only masked scores keeps m finite and alpha = exp(0), not NaN.
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)
_LANES = 128
_SUBLANES = 16  # bf16 packs two rows per sublane: 16-row slices stay tile-aligned for both dtypes
_SCORE_TILE_BYTES = 1 << 20  # default block_kv keeps one [rows, block_kv] f32 score tile this big


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _heads_per_block(k: int, h: int) -> int:
  """Fewest kv heads whose lanes make a legal TPU block: a multiple of 128, else all of them."""
  return next((d for d in range(1, k + 1) if k % d == 0 and d * h % _LANES == 0), k)


def _kernel(len_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, mask_ref, o_ref, m_ref, l_ref, acc_ref,
            *, scale: float, block_kv: int, group_rows: int):
  """Folds this step's cache block into (m, l, acc); the last step adds the new rows and writes."""
  j = pl.program_id(2)
  cache_len = len_ref[pl.program_id(0)]
  # float32 products at full precision on the MXU (its default would round operands to bf16).
  precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None

  @pl.when(j == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, _MASK, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  def fold(rows, q_rw, k_cw, v_cw, valid_rc):
    """Online-softmax update of scratch rows `rows`; valid_rc None means every key counts."""
    s_rc = lax.dot_general(q_rw, k_cw.astype(q_rw.dtype), (((1,), (1,)), ((), ())),
                           precision=precision, preferred_element_type=jnp.float32) * scale
    if valid_rc is not None:
      s_rc = jnp.where(valid_rc, s_rc, _MASK)
    m_prev_r1 = m_ref[rows, :][:, :1]
    m_next_r1 = jnp.maximum(m_prev_r1, s_rc.max(axis=1, keepdims=True))
    alpha_r1 = jnp.exp(m_prev_r1 - m_next_r1)
    p_rc = jnp.exp(s_rc - m_next_r1)
    if valid_rc is not None:
      # Zero, not merely tiny: a row with no valid key yet must not accumulate garbage values.
      p_rc = jnp.where(valid_rc, p_rc, 0.0)
    l_next_r1 = alpha_r1 * l_ref[rows, :][:, :1] + p_rc.sum(axis=1, keepdims=True)
    # Lane-replicated [rows, 128] state, the layout Mosaic keeps per-row scalars in.
    m_ref[rows, :] = jnp.broadcast_to(m_next_r1, (m_next_r1.shape[0], _LANES))
    l_ref[rows, :] = jnp.broadcast_to(l_next_r1, (l_next_r1.shape[0], _LANES))
    pv_rw = lax.dot_general(p_rc.astype(v_cw.dtype), v_cw, (((1,), (0,)), ((), ())),
                            precision=precision, preferred_element_type=jnp.float32)
    acc_ref[rows, :] = alpha_r1 * acc_ref[rows, :] + pv_rw

  all_rows = pl.ds(0, q_ref.shape[0])

  @pl.when((j + 1) * block_kv <= cache_len)
  def _full_block():
    fold(all_rows, q_ref[...], k_ref[...], v_ref[...], None)

  @pl.when((j * block_kv < cache_len) & (cache_len < (j + 1) * block_kv))
  def _last_block():
    # Full-shape iotas, so each mask is built at the shape it is used at (no i1 broadcast).
    slot_rc = j * block_kv + lax.broadcasted_iota(jnp.int32, (q_ref.shape[0], block_kv), 1)
    slot_cw = j * block_kv + lax.broadcasted_iota(jnp.int32, v_ref.shape, 0)
    # Slots past cache_len are garbage (past S too, on a ragged last block): zero them so even
    # NaN or inf there cannot reach a product.
    v_cw = jnp.where(slot_cw < cache_len, v_ref[...], jnp.zeros((), v_ref.dtype))
    fold(all_rows, q_ref[...], k_ref[...], v_cw, slot_rc < cache_len)

  @pl.when(j == pl.num_programs(2) - 1)
  def _new_rows_and_write():
    valid_tj = mask_ref[...] != 0
    kn_jw, vn_jw = kn_ref[...], vn_ref[...]
    # Row groups share one [T', T''] tree mask, so they are folded one group at a time.
    for group in range(q_ref.shape[0] // group_rows):
      rows = pl.ds(group * group_rows, group_rows)
      fold(rows, q_ref[rows, :], kn_jw, vn_jw, valid_tj)
    l_r1 = l_ref[...][:, :1]
    # A row that may read nothing (cache_len 0, empty mask row, or padding) gets zeros, not 0 / 0.
    o_ref[...] = (acc_ref[...] / jnp.where(l_r1 > 0.0, l_r1, 1.0)).astype(o_ref.dtype)


def _default_block_kv(rows: int) -> int:
  """Cache slots per step: as many as keep the score tile near 1 MiB, 128 to 1024."""
  slots = _SCORE_TILE_BYTES // (4 * rows)
  return min(1024, max(_LANES, 1 << max(slots, 1).bit_length() - 1))


def tree_attention_tpu(q_btnh: jax.Array, k_cache_bskh: jax.Array, v_cache_bskh: jax.Array,
                       cache_len_b: jax.Array, k_new_btkh: jax.Array, v_new_btkh: jax.Array,
                       new_mask_btt: jax.Array, *, interpret: bool | pltpu.InterpretParams = False,
                       block_kv: int | None = None) -> jax.Array:
  """Mosaic tree attention; same contract as `tree_attention(..., impl="pallas_tpu")`.

  block_kv: cache slots per grid step, a multiple of 128 (None: near 1 MiB of f32 scores per step),
  capped at S rounded up to 128. Each cache block is fetched once per (batch row, kv-head group):
  the cache is read once, for every tree row and query head. Blocks past a row's cache_len are
  neither fetched nor computed (a row with cache_len 0 still fetches block 0, unused). interpret:
  True (Pallas' HLO interpreter) or a `pltpu.InterpretParams` (the TPU interpreter) runs it on CPU.
  """
  b, t, n, h = q_btnh.shape
  s, k = k_cache_bskh.shape[1], k_cache_bskh.shape[2]
  g = n // k
  kb = _heads_per_block(k, h)
  width = kb * h
  t_rows = _round_up(t, _SUBLANES)  # query positions per head group, sublane-aligned
  t_cols = _round_up(t, _LANES)  # new keys, lane-aligned in the [T', T''] tree scores
  rows = kb * g * t_rows
  if block_kv is None:
    block_kv = _default_block_kv(rows)
  if block_kv <= 0 or block_kv % _LANES:
    raise ValueError(f"block_kv={block_kv} must be a positive multiple of {_LANES}")
  block_kv = min(block_kv, _round_up(s, _LANES))
  # Only a cache shorter than one block is padded (a small copy); longer ones are read in place.
  if s < block_kv:
    pad_cache = lambda x: jnp.pad(x, ((0, 0), (0, block_kv - s), (0, 0), (0, 0)))
    k_cache_bskh, v_cache_bskh = pad_cache(k_cache_bskh), pad_cache(v_cache_bskh)
  s_pad = k_cache_bskh.shape[1]

  # Query rows: [B, K / kb, kb * G * T', kb * H], head-major, each in its kv head's lanes.
  q_bcigth = q_btnh.reshape(b, t, k // kb, kb, g, h).transpose(0, 2, 3, 4, 1, 5)
  q_bcigth = jnp.pad(q_bcigth, ((0, 0),) * 4 + ((0, t_rows - t), (0, 0)))
  own_lanes_ij = jnp.eye(kb, dtype=bool)[None, None, :, None, None, :, None]
  q_bcrw = jnp.where(own_lanes_ij, q_bcigth[..., None, :], jnp.zeros((), q_btnh.dtype))
  q_bcrw = q_bcrw.reshape(b, k // kb, rows, width)
  # New rows: [B, T'', K * H], padded keys masked off by the padded mask columns.
  pad_new = lambda x: jnp.pad(x, ((0, 0), (0, t_cols - t), (0, 0), (0, 0))).reshape(b, t_cols, -1)
  k_new_bjw, v_new_bjw = pad_new(k_new_btkh), pad_new(v_new_btkh)
  # The mask as int32 (bool memrefs are awkward on TPU), padded rows and columns False.
  mask_btj = jnp.pad(new_mask_btt.astype(jnp.int32), ((0, 0), (0, t_rows - t), (0, t_cols - t)))
  # The cache as [B, S, K * H]: a free reshape, so it is read in place.
  k_cache_bsw = k_cache_bskh.reshape(b, s_pad, k * h)
  v_cache_bsw = v_cache_bskh.reshape(b, s_pad, k * h)

  def cache_map(bi, ci, j, len_ref):
    # Past the row's last valid block the index repeats, so the pipeline skips the copy.
    last = jnp.maximum(pl.cdiv(len_ref[bi], block_kv) - 1, 0)
    return bi, jnp.minimum(j, last), ci

  cache_spec = pl.BlockSpec((None, block_kv, width), cache_map)
  new_spec = pl.BlockSpec((None, t_cols, width), lambda bi, ci, j, len_ref: (bi, 0, ci))
  rows_spec = pl.BlockSpec((None, None, rows, width), lambda bi, ci, j, len_ref: (bi, ci, 0, 0))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(b, k // kb, pl.cdiv(s_pad, block_kv)),
      in_specs=[
          rows_spec, cache_spec, cache_spec, new_spec, new_spec,
          pl.BlockSpec((None, t_rows, t_cols), lambda bi, ci, j, len_ref: (bi, 0, 0)),
      ],
      out_specs=rows_spec,
      scratch_shapes=[pltpu.VMEM((rows, _LANES), jnp.float32),  # running max m
                      pltpu.VMEM((rows, _LANES), jnp.float32),  # running sum l
                      pltpu.VMEM((rows, width), jnp.float32)],  # unnormalized output
  )
  kernel = functools.partial(_kernel, scale=1.0 / math.sqrt(h), block_kv=block_kv,
                             group_rows=t_rows)
  out_bcrw = pl.pallas_call(
      kernel, grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((b, k // kb, rows, width), q_btnh.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret, name="tree_attention_tpu",
  )(jnp.clip(cache_len_b, 0, s).astype(jnp.int32), q_bcrw, k_cache_bsw, v_cache_bsw, k_new_bjw,
    v_new_bjw, mask_btj)

  # Each row's output is its own head's lanes: the (i, j) diagonal of [..., kb, G, T', kb, H].
  out_bcigtjh = out_bcrw.reshape(b, k // kb, kb, g, t_rows, kb, h)
  out_bcgthi = jnp.diagonal(out_bcigtjh, axis1=2, axis2=5)
  out_btcigh = out_bcgthi[:, :, :, :t].transpose(0, 3, 1, 5, 2, 4)
  return out_btcigh.reshape(b, t, n, h)
