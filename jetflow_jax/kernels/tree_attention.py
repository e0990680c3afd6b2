"""Tree-verify attention: T new rows attend to a read-only KV cache prefix and to each other.

The cache is never concatenated with the new rows (that would copy it every call): scores against
the cache and against the new rows are masked separately and share one float32 softmax.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from jetflow_jax.attention import finish_softmax, fold_cache_blocks, merge_scores
from jetflow_jax.errors import InputError
from jetflow_jax.kernels.tree_attention_pallas import tree_attention_pallas
from jetflow_jax.kernels.tree_attention_tpu import tree_attention_tpu

TreeAttentionImpl = Literal["xla", "pallas", "pallas_tpu"]
# Query rows per kernel call of `causal_attention`, per impl (None: all of them in one call). The
# Mosaic kernel keeps every row of a call, its [T, T] mask and its [T, T] tree scores in VMEM:
# at a 2,048-row prefill chunk those two alone are 32 MiB, past the default scoped VMEM limit
# (16 or 32 MiB by TPU generation), so it takes chunks 256 rows at a time (the largest verify it
# is lowered for). Triton's programs hold 128 rows each whatever T is.
CAUSAL_QUERY_BLOCK = {"xla": None, "pallas": None, "pallas_tpu": 256}


def pallas_impl(backend: str) -> TreeAttentionImpl:
  """The Pallas kernel for a JAX backend name: Triton on GPUs, Mosaic on TPUs."""
  if backend in ("gpu", "cuda", "rocm"):
    return "pallas"
  if backend == "tpu":
    return "pallas_tpu"
  raise ValueError(f"no Pallas tree attention kernel for backend {backend!r}")


def attention_for_backend(name: str, backend: str) -> TreeAttentionImpl:
  """`--attention xla|pallas` on `backend`: pallas means the backend's kernel, interpreted on
  CPU; a backend without one is refused by name."""
  if name != "pallas" or backend == "cpu":
    return name
  try:
    return pallas_impl(backend)
  except ValueError:
    raise InputError(f"--attention pallas: no Pallas tree kernel for the {backend!r} backend "
                     "(GPU: Triton, TPU: Mosaic); use --attention xla") from None


def tree_attention_xla(q_btnh: jax.Array, k_cache_bskh: jax.Array, v_cache_bskh: jax.Array,
                       cache_len_b: jax.Array, k_new_btkh: jax.Array, v_new_btkh: jax.Array,
                       new_mask_btt: jax.Array) -> jax.Array:
  """XLA `tree_attention`: the cache in blocks up to the longest row's length (so a verify costs
  what the rows hold, whatever the buffer's size), then the new rows; GQA by viewing q as
  [B, T, K, G, H]."""
  b, t, n, h = q_btnh.shape
  k = k_cache_bskh.shape[2]
  q_btkgh = q_btnh.reshape(b, t, k, n // k, h)
  carry = fold_cache_blocks(q_btkgh, k_cache_bskh, v_cache_bskh, cache_len_b)
  s_bkgtj = jnp.einsum("btkgh,bjkh->bkgtj", q_btkgh, k_new_btkh,
                       preferred_element_type=jnp.float32) / math.sqrt(h)
  s_bkgtj = jnp.where(new_mask_btt[:, None, None], s_bkgtj, -jnp.inf)
  return finish_softmax(merge_scores(carry, s_bkgtj, v_new_btkh), q_btnh.dtype)


def tree_attention(q_btnh: jax.Array, k_cache_bskh: jax.Array, v_cache_bskh: jax.Array,
                   cache_len_b: jax.Array, k_new_btkh: jax.Array, v_new_btkh: jax.Array,
                   new_mask_btt: jax.Array, *, impl: TreeAttentionImpl = "xla",
                   interpret: bool | pltpu.InterpretParams = False, block_kv: int | None = None,
                   block_rows: int = 64, max_rows: int = 128, kv_splits: int = 1,
                   num_warps: int = 4, num_stages: int = 2) -> jax.Array:
  """Softmax(q k / sqrt(H)) v over cache slots [0, cache_len_b[b]) and the new rows allowed by
  `new_mask_btt`; float32 softmax, output in q's dtype.

  q `[B, T, N, H]` (RoPE applied), caches `[B, S, K, H]`, new keys/values `[B, T, K, H]`,
  mask `[B, T, T]` (query t reads new row j where True). Query head n uses kv head n // (N / K).
  Cache slots at or past cache_len are ignored: any finite values for the XLA path (it multiplies
  them by zero probabilities), even NaN/inf for the kernels (they mask them before any product).
  Every path reads the cache only up to the longest row's length.
  A row allowed no key at all (cache_len 0 and an empty mask row) returns zeros. `impl` "pallas" is
  the Triton (GPU) kernel, "pallas_tpu" the Mosaic (TPU) one (see `pallas_impl`); the keyword
  arguments after `impl` tune them only: block_kv both (None: each kernel's default, see
  `tree_attention_pallas` and `tree_attention_tpu`), the rest Triton's. `interpret=True` runs
  either kernel on CPU; the TPU one also takes a `pltpu.InterpretParams` (the TPU interpreter).

  Returns:
    `[B, T, N, H]` in q's dtype.

  Raises:
    ValueError: query heads that do not group onto the kv heads, or an unknown `impl`.
  """
  if q_btnh.shape[2] % k_cache_bskh.shape[2]:
    raise ValueError(f"{q_btnh.shape[2]} query heads do not group onto "
                     f"{k_cache_bskh.shape[2]} kv heads")
  if impl == "xla":
    return tree_attention_xla(q_btnh, k_cache_bskh, v_cache_bskh, cache_len_b, k_new_btkh,
                              v_new_btkh, new_mask_btt)
  if impl == "pallas":
    return tree_attention_pallas(q_btnh, k_cache_bskh, v_cache_bskh, cache_len_b, k_new_btkh,
                                 v_new_btkh, new_mask_btt, interpret=interpret,
                                 block_kv=64 if block_kv is None else block_kv,
                                 block_rows=block_rows, max_rows=max_rows, kv_splits=kv_splits,
                                 num_warps=num_warps, num_stages=num_stages)
  if impl == "pallas_tpu":
    return tree_attention_tpu(q_btnh, k_cache_bskh, v_cache_bskh, cache_len_b, k_new_btkh,
                              v_new_btkh, new_mask_btt, interpret=interpret, block_kv=block_kv)
  raise ValueError(f"unknown tree attention impl {impl!r}")


def causal_attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, start_b: jax.Array,
                     k_new_btkh: jax.Array, v_new_btkh: jax.Array, *,
                     impl: TreeAttentionImpl = "xla",
                     interpret: bool | pltpu.InterpretParams = False,
                     query_block: int | None = None) -> jax.Array:
  """Causal attention of T consecutive rows (a prefill chunk) through `tree_attention`.

  Row t sits at slot start_b[b] + t of buffers `[B, S, K, H]` that already hold the T rows'
  keys and values (`k_new_btkh`, `v_new_btkh`) there, and reads every slot up to its own. The
  rows go `query_block` at a time (None: `CAUSAL_QUERY_BLOCK[impl]`), each block reading the
  buffers' first start_b + lo slots as its cache (the chunk's earlier rows included) and its
  own rows under a causal mask, so a call costs what the rows reach, not the buffer's size.
  """
  t = q_btnh.shape[1]
  block = query_block or CAUSAL_QUERY_BLOCK[impl] or t
  outs = []
  for lo in range(0, t, block):
    size = min(block, t - lo)
    rows = lambda x: x[:, lo:lo + size]
    causal_btt = jnp.broadcast_to(jnp.tril(jnp.ones((size, size), bool)),
                                  (q_btnh.shape[0], size, size))
    outs.append(tree_attention(rows(q_btnh), k_bskh, v_bskh, start_b + lo, rows(k_new_btkh),
                               rows(v_new_btkh), causal_btt, impl=impl, interpret=interpret))
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
