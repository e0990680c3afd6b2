"""Pallas (Triton) tree-verify attention: flash-style over the committed cache, then the new rows.

Query rows are the G query heads of a kv head times the T query positions, flattened t-major (row r
is query t = r // G, head g = r % G), cut into tiles of `block_rows` rows. One program owns up to
`max_rows` of them (all T * G when they fit) for one (batch row, kv head, kv split): it walks its
share of the cache once, and every K/V tile it loads is folded into each of its row tiles before
the next is loaded, so a tile is read once for all the rows and heads that program holds.
Scores live in the log2 domain (scaled by log2(e) / sqrt(H)) so the softmax uses exp2.

How many rows a program holds was measured on an H200 (bench/gpu_kernel_tiles.py, Qwen3-8B
shapes, batch 8, bf16, results in bench/results/gpu/gpu_kernel_tiles_h200.json). Each row's
float32 state (H + 2 words) stays in registers for the whole cache walk, so a program of more
rows runs fewer of them per SM, and that costs more than re-reading the cache saves: at a
32K-token cache, N = 64 (256 rows) takes 1.15 / 1.27 / 3.76 ms with 64 / 128 / 256 rows a
program (4 / 2 / 1 cache reads), and N = 256 takes 3.34 / 6.43 / 13.2 ms with 128 / 256 / 512
(8 / 4 / 2 reads); all 1,024 rows in one program (one read) does not compile (384 KiB of shared
memory asked, more than an SM has). The re-reads are by programs of the same (batch row, kv
head, split), launched side by side, so they mostly hit L2. Hence the defaults: 128 rows, in
tiles of 64, on 4 warps (8 warps doubles the time at N = 256). kv_splits adds programs without
re-reading anything: each split walks a disjoint run of cache blocks.
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
            scale_log2: float, block_kv: int, block_new: int, kv_splits: int, tile_rows: int):
  """Online softmax over this split's cache blocks, plus (split 0 only) the new rows, for each of
  the program's row tiles; every K/V tile is loaded once and folded into all of them."""
  split = pl.program_id(3)
  cache_len = len_ref[()]
  num_slots = k_ref.shape[0]
  head_dim = q_ref.shape[1]
  tiles = [pl.ds(i * tile_rows, tile_rows) for i in range(q_ref.shape[0] // tile_rows)]
  q_rh_tiles = [q_ref[rows, :] for rows in tiles]

  def step(carry, q_rh, k_ch, v_ch, valid_rc):
    """Folds one tile of keys into one row tile's (o, m, l); valid_rc None: every key counts."""
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

  def every_tile(carries, k_ch, v_ch, valid_of):
    """The loaded K/V tile folded into each row tile; valid_of(rows) gives that tile's mask."""
    return tuple(step(carry, q_rh, k_ch, v_ch, valid_of(rows))
                 for carry, q_rh, rows in zip(carries, q_rh_tiles, tiles))

  def full_block(i, carries):
    window = pl.ds(i * block_kv, block_kv)
    return every_tile(carries, k_ref[window, :], v_ref[window, :], lambda rows: None)

  def tail_block(i, carries):
    # The window is pulled back inside the buffer when S is not a multiple of block_kv; slots
    # below i * block_kv were already counted by the previous block and are masked out again.
    start = jnp.minimum(i * block_kv, num_slots - block_kv)
    slot_c = start + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
    valid_c = (slot_c >= i * block_kv) & (slot_c < cache_len)
    window = pl.ds(start, block_kv)
    # Slots past cache_len are garbage: zero them so even inf there cannot reach the sum.
    v_ch = jnp.where(valid_c[:, None], v_ref[window, :], jnp.zeros((), v_ref.dtype))
    valid_rc = jnp.broadcast_to(valid_c[None, :], (tile_rows, block_kv))
    return every_tile(carries, k_ref[window, :], v_ch, lambda rows: valid_rc)

  def new_block(j, carries):
    window = pl.ds(j * block_new, block_new)
    return every_tile(carries, kn_ref[window, :], vn_ref[window, :],
                      lambda rows: mask_ref[rows, window] != 0)

  carries = tuple((jnp.zeros((tile_rows, head_dim), jnp.float32),
                   jnp.full((tile_rows,), _MASK, jnp.float32),
                   jnp.zeros((tile_rows,), jnp.float32)) for _ in tiles)
  num_full = cache_len // block_kv
  num_blocks = pl.cdiv(cache_len, block_kv)
  # Splits share the row's valid blocks, not the buffer, so a short prefix still spreads out.
  blocks_per_split = pl.cdiv(num_blocks, kv_splits)
  lo = jnp.minimum(split * blocks_per_split, num_blocks)
  hi = jnp.minimum(lo + blocks_per_split, num_blocks)
  carries = lax.fori_loop(lo, jnp.minimum(hi, num_full), full_block, carries)
  carries = lax.fori_loop(jnp.maximum(lo, num_full), hi, tail_block, carries)
  # int32 bounds on both ends: Triton's scf.for needs one type for its bounds (a Python 0 is
  # lowered as another integer type by newer jax, and the loop then fails to verify).
  zero = jnp.int32(0)
  num_new_blocks = jnp.where(split == 0, jnp.int32(kn_ref.shape[0] // block_new), zero)
  carries = lax.fori_loop(zero, num_new_blocks, new_block, carries)

  for rows, (o_rh, m_r, l_r) in zip(tiles, carries):
    if kv_splits == 1:
      # A row that may read nothing (only padding rows) gets zeros instead of 0 / 0.
      o_rh = o_rh / jnp.where(l_r > 0.0, l_r, 1.0)[:, None]
    o_ref[rows, :] = o_rh.astype(o_ref.dtype)
    if stat_refs:
      m_ref, l_ref = stat_refs
      m_ref[rows] = m_r
      l_ref[rows] = l_r


def tree_attention_pallas(q_btnh: jax.Array, k_cache_bskh: jax.Array, v_cache_bskh: jax.Array,
                          cache_len_b: jax.Array, k_new_btkh: jax.Array, v_new_btkh: jax.Array,
                          new_mask_btt: jax.Array, *, interpret: bool = False, block_kv: int = 64,
                          block_rows: int = 64, max_rows: int = 128, kv_splits: int = 1,
                          num_warps: int = 4, num_stages: int = 2) -> jax.Array:
  """Pallas tree attention; same contract as `tree_attention(..., impl="pallas")`.

  block_kv: cache slots per step; block_rows: (query, head) rows per dot tile, capped at the padded
  T * G; max_rows: most rows one program holds (its row tiles share every K/V load), so the cache
  is read ceil(T * G / max_rows) times. All powers of two >= 16, as is H. kv_splits > 1 splits
  each row's valid cache blocks over that many programs (flash-decoding) and merges them here in
  float32: worth it when B * K * row programs is well below the GPU's SM count (small T, small
  batch).
  """
  b, t, n, h = q_btnh.shape
  s, k = k_cache_bskh.shape[1], k_cache_bskh.shape[2]
  g = n // k
  for name, size in (("block_kv", block_kv), ("block_rows", block_rows), ("max_rows", max_rows)):
    if size < _MIN_BLOCK or size & (size - 1):
      raise ValueError(f"{name}={size} must be a power of two >= {_MIN_BLOCK}")
  if h < _MIN_BLOCK or h & (h - 1):
    raise ValueError(f"head_dim={h} must be a power of two >= {_MIN_BLOCK} for Triton")
  if kv_splits < 1:
    raise ValueError(f"kv_splits={kv_splits} must be >= 1")

  # Row tiles of `tile_rows`; a program holds `tiles` of them (a power of two, so its block is).
  tile_rows = min(block_rows, _next_pow2(max(t * g, _MIN_BLOCK)))
  num_tiles = pl.cdiv(t * g, tile_rows)
  tiles = min(max(max_rows // tile_rows, 1), _next_pow2(num_tiles))
  rows = tiles * tile_rows
  r_pad = pl.cdiv(num_tiles, tiles) * rows
  # Query rows: [B, K, T * G, H], padded to whole programs.
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
      block_new=block_new, kv_splits=kv_splits, tile_rows=tile_rows)
  # Row programs first: Triton launches the leading axes fastest, so the programs that share one
  # (batch row, kv head, split), and hence its cache, run side by side.
  grid = (r_pad // rows, b, k, kv_splits)
  cache_spec = pl.BlockSpec((None, s_pad, None, h), lambda ri, bi, ki, si: (bi, 0, ki, 0))
  new_spec = pl.BlockSpec((None, None, t_pad, h), lambda ri, bi, ki, si: (bi, ki, 0, 0))
  in_specs = [
      pl.BlockSpec((None,), lambda ri, bi, ki, si: (bi,)),
      pl.BlockSpec((None, None, rows, h), lambda ri, bi, ki, si: (bi, ki, ri, 0)),
      cache_spec, cache_spec, new_spec, new_spec,
      pl.BlockSpec((None, rows, t_pad), lambda ri, bi, ki, si: (bi, ri, 0)),
  ]
  # One split writes the finished output; several write unnormalized f32 partials + (m, l).
  out_dtype = q_btnh.dtype if kv_splits == 1 else jnp.float32
  out_shape = [jax.ShapeDtypeStruct((kv_splits, b, k, r_pad, h), out_dtype)]
  out_specs = [pl.BlockSpec((None, None, None, rows, h),
                            lambda ri, bi, ki, si: (si, bi, ki, ri, 0))]
  if kv_splits > 1:
    stat_spec = pl.BlockSpec((None, None, None, rows), lambda ri, bi, ki, si: (si, bi, ki, ri))
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
