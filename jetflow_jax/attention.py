"""Masked multi-head attention with grouped KV heads, and rotary position embeddings.

Axis alphabet used across the package (einsum strings and name suffixes):
B batch, T query length, S key/cache length, D model width, N query heads,
K kv heads, H head dim, F MLP width, V vocab, E experts, L layers.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

# "pallas" selects the Pallas kernel where one exists (read-only cache + tree rows, see
# `jetflow_jax.kernels`); plain masked attention always runs through XLA.
AttentionImpl = Literal["xla", "pallas"]


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
  if impl not in ("xla", "pallas"):
    raise ValueError(f"unknown attention impl {impl!r}")
  with jax.named_scope("attention"):
    return jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, mask=mask_bts[:, None],
                                        implementation="xla")


def causal_mask(query_slots_bt: jax.Array, num_keys: int) -> jax.Array:
  """[B, T, S] mask: a query at cache slot t sees every slot <= t."""
  return jnp.arange(num_keys)[None, None, :] <= query_slots_bt[:, :, None]
