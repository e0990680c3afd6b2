"""Pallas (Triton) context-prefix attention of the head's training pass, forward and backward.

The T = A * block query rows are A packed blocks; the block of anchor a reads the context keys
start_a <= s < a, start_a being where a's sample begins in a packed row (its in-block part is
merged by the caller, see `train_attention`). A forward or dq program owns one (batch row, kv
head, anchor): its rows are the G query heads of that kv head times the block's offsets,
flattened offset-major (row r is offset r // G, head r % G) and padded to a power of two, so each
K/V tile is loaded once for every head that shares it, and the tiles outside [start, anchor) are
never read. A dk/dv program owns one key tile and visits only the anchors that read it, walking
them in sorted order. Scores live in the log2 domain (scaled by log2(e) / sqrt(H)) so the softmax
uses exp2; the forward also returns the log-sum-exp, which lets the caller merge the in-block
part exactly.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Finite, so a row that has seen no key keeps a finite log-sum-exp (its weight in a merge is 0).
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)
_MIN_BLOCK = 16  # Triton's dot needs every matmul dim >= 16
_LOG2_E = math.log2(math.e)


class _Tuning(NamedTuple):
  """Static kernel settings (hashable, so they ride along custom_vjp as one argument)."""

  interpret: bool
  block_kv: int
  num_warps: int
  num_stages: int


def _next_pow2(x: int) -> int:
  return 1 << max(x - 1, 0).bit_length()


def _scores(q_rh, k_ch, scale_log2: float):
  """[rows, keys] scores in the log2 domain, accumulated in float32."""
  return plgpu.dot(q_rh, k_ch.astype(q_rh.dtype), trans_b=True) * scale_log2


def _key_iota(start, block_kv: int):
  return start + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)


def _visible(tile: int, block_kv: int, start, anchor):
  keys_c = _key_iota(tile * block_kv, block_kv)
  return (keys_c >= start) & (keys_c < anchor)


def _over_tiles(body, carry, start, anchor, block_kv: int):
  """Runs `body(i, carry, masked)` over the key tiles holding keys of [start, anchor).

  Tiles wholly inside the range skip the mask; the partial tiles at either end apply it.
  """
  end = jnp.where(anchor > start, pl.cdiv(anchor, block_kv), 0)
  first_full, last_full = pl.cdiv(start, block_kv), anchor // block_kv
  masked = functools.partial(body, masked=True)
  carry = lax.fori_loop(start // block_kv, jnp.minimum(first_full, end), masked, carry)
  carry = lax.fori_loop(first_full, last_full, functools.partial(body, masked=False), carry)
  return lax.fori_loop(jnp.maximum(first_full, last_full), end, masked, carry)


def _forward_kernel(anchor_ref, start_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *,
                    scale_log2: float, block_kv: int):
  """Online softmax over the key tiles of this program's [start, anchor)."""
  anchor, start = anchor_ref[()], start_ref[()]
  rows, head_dim = q_ref.shape
  q_rh = q_ref[...]

  def tile(i, carry, masked: bool):
    o_rh, m_r, l_r = carry
    window = pl.ds(i * block_kv, block_kv)
    s_rc = _scores(q_rh, k_ref[window, :], scale_log2)
    if masked:
      valid_c = _visible(i, block_kv, start, anchor)
      s_rc = jnp.where(jnp.broadcast_to(valid_c[None, :], s_rc.shape), s_rc, _MASK)
    # Every tile visited holds a key of [start, anchor), so m is a real score and masked keys
    # underflow to exactly zero probability.
    m_new_r = jnp.maximum(m_r, s_rc.max(axis=-1))
    alpha_r = jnp.exp2(m_r - m_new_r)
    p_rc = jnp.exp2(s_rc - m_new_r[:, None])
    v_ch = v_ref[window, :]
    o_new_rh = alpha_r[:, None] * o_rh + plgpu.dot(p_rc.astype(v_ch.dtype), v_ch)
    return o_new_rh, m_new_r, alpha_r * l_r + p_rc.sum(axis=-1)

  carry = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), _MASK, jnp.float32),
           jnp.zeros((rows,), jnp.float32))
  o_rh, m_r, l_r = _over_tiles(tile, carry, start, anchor, block_kv)
  # An empty range (anchor 0) reads no key: zeros out, and a log-sum-exp that weighs nothing in
  # the merge.
  seen_r = l_r > 0.0
  l_r = jnp.where(seen_r, l_r, 1.0)
  o_ref[...] = (o_rh / l_r[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen_r, m_r + jnp.log2(l_r), _MASK)


def _dq_kernel(anchor_ref, start_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
               scale_log2: float, scale: float, block_kv: int):
  """dq of this program's rows, over the same key tiles its forward read."""
  anchor, start = anchor_ref[()], start_ref[()]
  q_rh, do_rh = q_ref[...], do_ref[...]
  lse_r, delta_r = lse_ref[...], delta_ref[...]

  def tile(i, dq_rh, masked: bool):
    window = pl.ds(i * block_kv, block_kv)
    k_ch = k_ref[window, :]
    p_rc = jnp.exp2(_scores(q_rh, k_ch, scale_log2) - lse_r[:, None])
    if masked:
      valid_c = _visible(i, block_kv, start, anchor)
      p_rc = jnp.where(jnp.broadcast_to(valid_c[None, :], p_rc.shape), p_rc, 0.0)
    dp_rc = plgpu.dot(do_rh, v_ref[window, :].astype(do_rh.dtype), trans_b=True)
    ds_rc = p_rc * (dp_rc - delta_r[:, None])
    return dq_rh + plgpu.dot(ds_rc.astype(k_ch.dtype), k_ch)

  dq_rh = _over_tiles(tile, jnp.zeros(q_rh.shape, jnp.float32), start, anchor, block_kv)
  dq_ref[...] = (dq_rh * scale).astype(dq_ref.dtype)


def _dkdv_kernel(first_ref, full_ref, mid_ref, last_ref, anchors_ref, starts_ref, q_ref, k_ref,
                 v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, scale_log2: float,
                 scale: float, rows: int):
  """dk, dv of one key tile from the anchors (sorted ascending) that read it."""
  block_kv = k_ref.shape[0]
  key_c = _key_iota(pl.program_id(2) * block_kv, block_kv)
  k_ch, v_ch = k_ref[...], v_ref[...]

  def anchor_rows(a, carry, masked: bool):
    dk_ch, dv_ch = carry
    window = pl.ds(a * rows, rows)
    q_rh, do_rh = q_ref[window, :], do_ref[window, :]
    p_rc = jnp.exp2(_scores(q_rh, k_ch, scale_log2) - lse_ref[window][:, None])
    if masked:
      valid_c = (key_c < anchors_ref[a]) & (key_c >= starts_ref[a])
      p_rc = jnp.where(jnp.broadcast_to(valid_c[None, :], p_rc.shape), p_rc, 0.0)
    dv_ch = dv_ch + plgpu.dot(p_rc.astype(do_rh.dtype), do_rh, trans_a=True)
    dp_rc = plgpu.dot(do_rh, v_ch.astype(do_rh.dtype), trans_b=True)
    ds_rc = p_rc * (dp_rc - delta_ref[window][:, None])
    return dk_ch + plgpu.dot(ds_rc.astype(q_rh.dtype), q_rh, trans_a=True), dv_ch

  zeros = jnp.zeros(k_ch.shape, jnp.float32)
  masked, unmasked = (functools.partial(anchor_rows, masked=m) for m in (True, False))
  # Anchors [first, full) end inside this tile, [full, mid) read all of it and [mid, last) start
  # inside it (packed rows); anchors from `last` on belong to later samples.
  carry = lax.fori_loop(first_ref[()], full_ref[()], masked, (zeros, zeros))
  carry = lax.fori_loop(full_ref[()], mid_ref[()], unmasked, carry)
  dk_ch, dv_ch = lax.fori_loop(mid_ref[()], last_ref[()], masked, carry)
  dk_ref[...] = (dk_ch * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv_ch.astype(dv_ref.dtype)


def _to_rows(x_btn, num_anchors: int, num_kv: int, rows: int):
  """[B, A * block, N, ...] -> [B, K, A * rows, ...]: each anchor's (offset, head) rows, padded."""
  b, t, n = x_btn.shape[:3]
  rest = x_btn.shape[3:]
  block, g = t // num_anchors, n // num_kv
  x = jnp.moveaxis(x_btn.reshape(b, num_anchors, block, num_kv, g, *rest), 3, 1)
  x = x.reshape(b, num_kv, num_anchors, block * g, *rest)
  x = jnp.pad(x, [(0, 0)] * 3 + [(0, rows - block * g)] + [(0, 0)] * len(rest))
  return x.reshape(b, num_kv, num_anchors * rows, *rest)


def _from_rows(x_bkr, num_anchors: int, block: int, num_heads: int):
  """Inverse of `_to_rows`."""
  b, k = x_bkr.shape[:2]
  rest = x_bkr.shape[3:]
  g = num_heads // k
  x = x_bkr.reshape(b, k, num_anchors, -1, *rest)[:, :, :, :block * g]
  x = jnp.moveaxis(x.reshape(b, k, num_anchors, block, g, *rest), 1, 3)
  return x.reshape(b, num_anchors * block, num_heads, *rest)


def _sorted_rows(x_bkr, order_ba, num_anchors: int):
  """Reorders each kv head's anchor groups of rows by `order_ba`."""
  b, k, r = x_bkr.shape[:3]
  rest = x_bkr.shape[3:]
  x = x_bkr.reshape(b, k, num_anchors, r // num_anchors, *rest)
  index = order_ba.reshape(b, 1, num_anchors, *(1,) * (1 + len(rest)))
  return jnp.take_along_axis(x, index, axis=2).reshape(x_bkr.shape)


def _pad_keys(x_bskh, block_kv: int):
  """Pads S to whole key tiles (the pad keys sit past every anchor, so they are never read)."""
  s = x_bskh.shape[1]
  return jnp.pad(x_bskh, ((0, 0), (0, pl.cdiv(s, block_kv) * block_kv - s), (0, 0), (0, 0)))


def _num_rows(block: int, group: int) -> int:
  return _next_pow2(max(block * group, _MIN_BLOCK))


def _forward(q_btnh, k_bskh, v_bskh, anchors_ba, starts_ba, tuning: _Tuning):
  """(out `[B, T, N, H]`, log2-domain log-sum-exp `[B, T, N]`) from the forward kernel."""
  b, t, n, h = q_btnh.shape
  k = k_bskh.shape[2]
  num_anchors = anchors_ba.shape[1]
  rows = _num_rows(t // num_anchors, n // k)
  q_bkrh = _to_rows(q_btnh, num_anchors, k, rows)
  k_bskh, v_bskh = _pad_keys(k_bskh, tuning.block_kv), _pad_keys(v_bskh, tuning.block_kv)
  s_pad = k_bskh.shape[1]
  kernel = functools.partial(_forward_kernel, scale_log2=_LOG2_E / math.sqrt(h),
                             block_kv=tuning.block_kv)
  keys_spec = pl.BlockSpec((None, s_pad, None, h), lambda bi, ki, ai: (bi, 0, ki, 0))
  rows_spec = pl.BlockSpec((None, None, rows, h), lambda bi, ki, ai: (bi, ki, ai, 0))
  anchor_spec = pl.BlockSpec((None, None), lambda bi, ki, ai: (bi, ai))
  o_bkrh, lse_bkr = pl.pallas_call(
      kernel, grid=(b, k, num_anchors),
      in_specs=[anchor_spec, anchor_spec, rows_spec, keys_spec, keys_spec],
      out_specs=[rows_spec, pl.BlockSpec((None, None, rows), lambda bi, ki, ai: (bi, ki, ai))],
      out_shape=[jax.ShapeDtypeStruct(q_bkrh.shape, q_btnh.dtype),
                 jax.ShapeDtypeStruct(q_bkrh.shape[:3], jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps,
                                           num_stages=tuning.num_stages),
      interpret=tuning.interpret, name="train_prefix_attention",
  )(anchors_ba, starts_ba, q_bkrh, k_bskh, v_bskh)
  block = t // num_anchors
  return _from_rows(o_bkrh, num_anchors, block, n), _from_rows(lse_bkr, num_anchors, block, n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _prefix_attention(q_btnh, k_bskh, v_bskh, anchors_ba, starts_ba, tuning: _Tuning):
  o_btnh, lse2_btn = _forward(q_btnh, k_bskh, v_bskh, anchors_ba, starts_ba, tuning)
  return o_btnh, lse2_btn / _LOG2_E


def _prefix_attention_fwd(q_btnh, k_bskh, v_bskh, anchors_ba, starts_ba, tuning: _Tuning):
  o_btnh, lse2_btn = _forward(q_btnh, k_bskh, v_bskh, anchors_ba, starts_ba, tuning)
  return ((o_btnh, lse2_btn / _LOG2_E),
          (q_btnh, k_bskh, v_bskh, anchors_ba, starts_ba, o_btnh, lse2_btn))


def _prefix_attention_bwd(tuning: _Tuning, residuals, cotangents):
  """Flash-attention backward; the log-sum-exp's cotangent enters through delta."""
  q_btnh, k_bskh, v_bskh, anchors_ba, starts_ba, o_btnh, lse2_btn = residuals
  do_btnh, dlse_btn = cotangents
  b, t, n, h = q_btnh.shape
  s, k = k_bskh.shape[1], k_bskh.shape[2]
  num_anchors = anchors_ba.shape[1]
  block, block_kv = t // num_anchors, tuning.block_kv
  rows = _num_rows(block, n // k)
  # d lse / d score = p, so dlse shifts every ds of the row by p * dlse, as delta does.
  delta_btn = (do_btnh.astype(jnp.float32) * o_btnh.astype(jnp.float32)).sum(-1) - dlse_btn
  to_rows = functools.partial(_to_rows, num_anchors=num_anchors, num_kv=k, rows=rows)
  q_bkrh, do_bkrh = to_rows(q_btnh), to_rows(do_btnh.astype(q_btnh.dtype))
  lse_bkr, delta_bkr = to_rows(lse2_btn), to_rows(delta_btn)
  k_pad_bskh, v_pad_bskh = _pad_keys(k_bskh, block_kv), _pad_keys(v_bskh, block_kv)
  s_pad = k_pad_bskh.shape[1]
  scales = dict(scale_log2=_LOG2_E / math.sqrt(h), scale=1.0 / math.sqrt(h))
  params = plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages)

  keys_spec = pl.BlockSpec((None, s_pad, None, h), lambda bi, ki, ai: (bi, 0, ki, 0))
  rows_spec = pl.BlockSpec((None, None, rows, h), lambda bi, ki, ai: (bi, ki, ai, 0))
  stat_spec = pl.BlockSpec((None, None, rows), lambda bi, ki, ai: (bi, ki, ai))
  anchor_spec = pl.BlockSpec((None, None), lambda bi, ki, ai: (bi, ai))
  dq_bkrh = pl.pallas_call(
      functools.partial(_dq_kernel, block_kv=block_kv, **scales), grid=(b, k, num_anchors),
      in_specs=[anchor_spec, anchor_spec, rows_spec, keys_spec, keys_spec, rows_spec, stat_spec,
                stat_spec],
      out_specs=rows_spec, out_shape=jax.ShapeDtypeStruct(q_bkrh.shape, q_btnh.dtype),
      compiler_params=params, interpret=tuning.interpret, name="train_prefix_attention_dq",
  )(anchors_ba, starts_ba, q_bkrh, k_pad_bskh, v_pad_bskh, do_bkrh, lse_bkr, delta_bkr)

  # Samples are contiguous, so sorting by anchor sorts the starts too, and the readers of a key
  # tile are one run of sorted anchors: [first, full) end inside the tile, [full, mid) read all
  # of it, [mid, last) start inside it.
  order_ba = jnp.argsort(anchors_ba, axis=1)
  sorted_ba = jnp.take_along_axis(anchors_ba, order_ba, axis=1)
  sorted_starts_ba = jnp.take_along_axis(starts_ba, order_ba, axis=1)
  tile_start_j = jnp.arange(s_pad // block_kv, dtype=jnp.int32) * block_kv
  count = lambda sorted_ba, side, bound_j: jax.vmap(
      lambda a: jnp.searchsorted(a, bound_j, side=side).astype(jnp.int32))(sorted_ba)
  first_bj = count(sorted_ba, "right", tile_start_j)
  full_bj = count(sorted_ba, "left", tile_start_j + block_kv)
  mid_bj = jnp.maximum(full_bj, count(sorted_starts_ba, "right", tile_start_j))
  last_bj = count(sorted_starts_ba, "left", tile_start_j + block_kv)
  by_anchor = functools.partial(_sorted_rows, order_ba=order_ba, num_anchors=num_anchors)
  all_rows_spec = pl.BlockSpec((None, None, num_anchors * rows, h),
                               lambda bi, ki, ji: (bi, ki, 0, 0))
  all_stat_spec = pl.BlockSpec((None, None, num_anchors * rows), lambda bi, ki, ji: (bi, ki, 0))
  tile_spec = pl.BlockSpec((None, block_kv, None, h), lambda bi, ki, ji: (bi, ji, ki, 0))
  count_spec = pl.BlockSpec((None, None), lambda bi, ki, ji: (bi, ji))
  all_anchors_spec = pl.BlockSpec((None, num_anchors), lambda bi, ki, ji: (bi, 0))
  dk_bskh, dv_bskh = pl.pallas_call(
      functools.partial(_dkdv_kernel, rows=rows, **scales), grid=(b, k, s_pad // block_kv),
      in_specs=([count_spec] * 4 + [all_anchors_spec] * 2
                + [all_rows_spec, tile_spec, tile_spec, all_rows_spec, all_stat_spec,
                   all_stat_spec]),
      out_specs=[tile_spec, tile_spec],
      out_shape=[jax.ShapeDtypeStruct(k_pad_bskh.shape, k_bskh.dtype),
                 jax.ShapeDtypeStruct(v_pad_bskh.shape, v_bskh.dtype)],
      compiler_params=params, interpret=tuning.interpret, name="train_prefix_attention_dkdv",
  )(first_bj, full_bj, mid_bj, last_bj, sorted_ba, sorted_starts_ba, by_anchor(q_bkrh),
    k_pad_bskh, v_pad_bskh, by_anchor(do_bkrh), by_anchor(lse_bkr), by_anchor(delta_bkr))
  return (_from_rows(dq_bkrh, num_anchors, block, n), dk_bskh[:, :s], dv_bskh[:, :s], None, None)


_prefix_attention.defvjp(_prefix_attention_fwd, _prefix_attention_bwd)


def prefix_attention_pallas(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array,
                            anchors_ba: jax.Array, starts_ba: jax.Array | None = None, *,
                            interpret: bool = False, block_kv: int = 64, num_warps: int = 4,
                            num_stages: int = 2) -> tuple[jax.Array, jax.Array]:
  """(out `[B, T, N, H]`, log-sum-exp `[B, T, N]`) of the packed rows over their context prefix.

  q holds A = anchors_ba.shape[1] blocks of T / A rows (RoPE applied); the rows of anchor a read
  the context keys starts_ba[a] <= s < anchors_ba[a] (starts 0 by default; in packed rows the
  first row of a's sample, so anchors sorted by position have sorted starts), with a float32
  softmax; a row with no key to read gets zeros and a log-sum-exp of about -2e38. Query head n
  uses kv head n // (N / K).
  Differentiable in q, k and v. block_kv: keys per tile, a power of two >= 16, as is H;
  `interpret=True` runs the kernels on CPU.
  """
  t, n, h = q_btnh.shape[1:]
  num_anchors = anchors_ba.shape[1]
  if t % num_anchors:
    raise ValueError(f"{t} query rows do not split into {num_anchors} blocks")
  if n % k_bskh.shape[2]:
    raise ValueError(f"{n} query heads do not group onto {k_bskh.shape[2]} kv heads")
  if block_kv < _MIN_BLOCK or block_kv & (block_kv - 1):
    raise ValueError(f"block_kv={block_kv} must be a power of two >= {_MIN_BLOCK}")
  if h < _MIN_BLOCK or h & (h - 1):
    raise ValueError(f"head_dim={h} must be a power of two >= {_MIN_BLOCK} for Triton")
  anchors_ba = jnp.clip(anchors_ba, 0, k_bskh.shape[1]).astype(jnp.int32)
  starts_ba = (jnp.zeros_like(anchors_ba) if starts_ba is None
               else jnp.clip(starts_ba, 0, anchors_ba).astype(jnp.int32))
  return _prefix_attention(q_btnh, k_bskh, v_bskh, anchors_ba, starts_ba,
                           _Tuning(interpret, block_kv, num_warps, num_stages))
