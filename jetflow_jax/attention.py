"""Masked multi-head attention with grouped KV heads, and rotary position embeddings.

Axis alphabet used across the package (einsum strings and name suffixes):
B batch, T query length, S key/cache length, D model width, N query heads,
K kv heads, H head dim, F MLP width, V vocab, E experts, L layers.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp

# "pallas" / "pallas_tpu" select the Triton / Mosaic kernel where one exists (read-only cache +
# tree rows, see `jetflow_jax.kernels`); plain masked attention always runs through XLA.
AttentionImpl = Literal["xla", "pallas", "pallas_tpu"]
KV_BLOCK = 128  # cache slots per step of the length-bounded loops below (CPU, TPU)
GPU_SCORES_BYTES = 1 << 28  # on a GPU, a loop step's float32 scores grow up to this


def apply_rope(x_btnh: jax.Array, positions_bt: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding in the rotate-half layout Qwen3 uses; angles in float32."""
  head_dim = x_btnh.shape[-1]
  half = head_dim // 2
  inv_freq = 1.0 / theta**(jnp.arange(half, dtype=jnp.float32) * 2.0 / head_dim)
  angles = positions_bt.astype(jnp.float32)[..., None] * inv_freq
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x_btnh.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x_btnh.dtype)


def attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, mask_bts: jax.Array,
              impl: AttentionImpl = "xla") -> jax.Array:
  """Softmax(q k^T / sqrt(H)) v where `mask_bts` is True; softmax in float32.

  Fully masked query rows (padding) get a uniform average rather than NaN.
  """
  if impl not in ("xla", "pallas", "pallas_tpu"):
    raise ValueError(f"unknown attention impl {impl!r}")
  with jax.named_scope("attention"):
    return jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, mask=mask_bts[:, None],
                                        implementation="xla")


def fold_cache_blocks(q_btkgh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array,
                      num_valid_b: jax.Array, query_slots_bt: jax.Array | None = None,
                      block: int | None = None):
  """Online-softmax state (m, l, acc) of q over cache slots s < num_valid_b[b] (and, with
  `query_slots_bt`, s <= the query's slot), in blocks up to the longest row's count only.

  The loop's trip count is traced (`blocks_to_visit`): a forward costs what the rows hold, not
  the buffer's size.
  q is `[B, T, K, G, H]`, scores scaled by 1/sqrt(H) in float32; returns m, l `[B, K, G, T]`
  and acc `[B, K, G, T, H]` (float32), to be merged with other keys or finished by
  `finish_softmax`.
  """
  b, t, k, g, h = q_btkgh.shape
  size = k_bskh.shape[1]
  block = min(block or cache_block(b * t * k * g, jax.default_backend()), size)
  scale = 1.0 / math.sqrt(h)

  def step(i, carry):
    m, l, acc = carry
    # The last window is pulled back inside the buffer; slots below i * block were counted
    # by the window before and are masked out again.
    start = jnp.minimum(i * block, size - block)
    slot_c = start + jnp.arange(block)
    window = lambda x: jax.lax.dynamic_slice_in_dim(x, start, block, axis=1)
    valid_bc = (slot_c[None, :] >= i * block) & (slot_c[None, :] < num_valid_b[:, None])
    valid_btc = valid_bc[:, None, :]
    if query_slots_bt is not None:
      valid_btc = valid_btc & (slot_c[None, None, :] <= query_slots_bt[:, :, None])
    s_bkgtc = jnp.einsum("btkgh,bckh->bkgtc", q_btkgh, window(k_bskh),
                         preferred_element_type=jnp.float32) * scale
    s_bkgtc = jnp.where(valid_btc[:, None, None], s_bkgtc, -jnp.inf)
    return merge_scores((m, l, acc), s_bkgtc, window(v_bskh))

  # The initial state is made from q, not from constants: XLA hoists a constant broadcast out
  # of every enclosing loop (prefill chunks, decode rounds), one per layer, all live at once.
  zero_bkgt = (q_btkgh[..., 0] * 0).astype(jnp.float32).transpose(0, 2, 3, 1)
  carry = (zero_bkgt - jnp.inf, zero_bkgt,
           jnp.broadcast_to(zero_bkgt[..., None], (b, k, g, t, h)))
  return jax.lax.fori_loop(0, blocks_to_visit(num_valid_b, block, size), step, carry)


def cache_block(num_score_rows: int, backend: str) -> int:
  """Cache slots per loop step: KV_BLOCK on CPU and TPU, so a row's cost follows its length; on
  a GPU as many as keep the step's float32 scores within GPU_SCORES_BYTES (a power of two), so
  an AR step is one step rather than S / 128 steps of a few small kernels each."""
  if backend != "gpu":
    return KV_BLOCK
  slots = GPU_SCORES_BYTES // (4 * num_score_rows)
  return max(KV_BLOCK, 1 << (slots.bit_length() - 1)) if slots else KV_BLOCK


def blocks_to_visit(num_valid_b: jax.Array, block: int, size: int):
  """Blocks of the buffer up to the longest row's count; on a GPU, every block (a static count).

  XLA:GPU copies a loop's traced trip condition to the host on every iteration: measured on an
  H200, Qwen3-8B's AR step at 4,096 committed tokens took 39.8 ms with the bounded loop (34
  blocks x 36 layers of round trips) and 25.3 ms with a static count, which reads the whole
  buffer, masked, without waiting. There the Triton tree kernel bounds verify by length.
  """
  all_blocks = -(-size // block)
  if jax.default_backend() == "gpu":
    return all_blocks
  return jnp.minimum((jnp.max(num_valid_b) + block - 1) // block, all_blocks)


def merge_scores(carry, s_bkgtc, v_bckh):
  """Folds one block of masked (-inf) float32 scores and its values into (m, l, acc)."""
  m, l, acc = carry
  m_new = jnp.maximum(m, s_bkgtc.max(axis=-1))
  # A row that has seen only masked keys keeps m = -inf; shift by 0 then, not by -inf.
  shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
  p_bkgtc = jnp.exp(s_bkgtc - shift[..., None])
  alpha = jnp.exp(jnp.where(jnp.isfinite(m), m - shift, -jnp.inf))
  # Probabilities drop to the value dtype (as in flash attention); products sum in float32.
  pv = jnp.einsum("bkgtc,bckh->bkgth", p_bkgtc.astype(v_bckh.dtype), v_bckh,
                  preferred_element_type=jnp.float32)
  return m_new, alpha * l + p_bkgtc.sum(axis=-1), alpha[..., None] * acc + pv


def finish_softmax(carry, dtype) -> jax.Array:
  """`[B, T, N, H]` from (m, l, acc); a row that read nothing gets zeros."""
  _, l, acc = carry
  b, k, g, t, h = acc.shape
  out_bkgth = acc / jnp.where(l > 0.0, l, 1.0)[..., None]
  return out_bkgth.transpose(0, 3, 1, 2, 4).reshape(b, t, k * g, h).astype(dtype)


def cached_attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array,
                     query_slots_bt: jax.Array, block: int | None = None) -> jax.Array:
  """Causal attention over a KV cache: query (b, t) at slot query_slots_bt[b, t] reads every
  slot up to its own, visiting blocks only up to the highest such slot (prefill, AR steps).

  Scores are at most `[B, N, T, block]` (block: `cache_block`'s); long prompts come in
  chunks (`generate.prefill_forward`).
  """
  b, t, n, h = q_btnh.shape
  k = k_bskh.shape[2]
  with jax.named_scope("cached_attention"):
    carry = fold_cache_blocks(q_btnh.reshape(b, t, k, n // k, h), k_bskh, v_bskh,
                              query_slots_bt.max(axis=1) + 1, query_slots_bt, block)
    return finish_softmax(carry, q_btnh.dtype)
