"""Mosaic (Pallas TPU) tree-verify attention: the TPU interpreter vs the XLA reference on random
trees, garbage past cache_len, and lowering for TPU at Qwen3-8B shapes on this CPU-only host."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jetflow_jax.kernels import tree_attention
from jetflow_jax.kernels.tree_attention import pallas_impl
from test_tree_attention import brute_force, make_case, run

MOSAIC_CALL = "tpu_custom_call"
# The TPU interpreter simulates VMEM and DMAs: scratch starts as NaN, an out-of-bounds block read
# raises, and the parallel grid axes run in a shuffled order.
TPU_INTERPRET = pltpu.InterpretParams(random_seed=0)

# MQA and GQA; H = 128 (one kv head per block) and 64 (two kv heads share a block's 128 lanes, or
# one head's 64 lanes are the whole array); tree sizes 1, 5, 16, 37; S a multiple of block_kv,
# ragged, and below one block; cache lengths 0, S and partial, on and next to block edges.
CASES = [
    dict(t=1, s=300, n=4, k=1, h=128),
    dict(t=5, s=256, n=8, k=2, h=64, cache_len=[0, 128, 129]),
    dict(t=37, s=200, n=4, k=4, h=64),
    dict(t=5, s=150, n=4, k=1, h=64, cache_len=[127, 150, 1]),
    dict(t=16, s=40, n=8, k=2, h=128),
]


def case_id(cfg):
  return "-".join(f"{k}{v}" for k, v in cfg.items() if k != "cache_len")


@pytest.mark.parametrize("cfg", CASES, ids=case_id)
def test_interpret_matches_xla(cfg):
  case = make_case(1, b=3, **cfg)
  out = run(case, impl="pallas_tpu", interpret=TPU_INTERPRET, block_kv=128)
  np.testing.assert_allclose(out, run(case, impl="xla"), atol=2e-5, rtol=0)


def test_interpret_true_and_default_block_kv():
  """`interpret=True` (what callers pass on CPU) runs Pallas' HLO interpreter instead."""
  case = make_case(4, b=2, t=9, s=700, n=8, k=2, h=128)
  out = run(case, impl="pallas_tpu", interpret=True)
  np.testing.assert_allclose(out, run(case, impl="xla"), atol=2e-5, rtol=0)
  np.testing.assert_allclose(out, brute_force(case), atol=2e-5, rtol=0)


def test_interpret_bfloat16_close_to_xla():
  case = make_case(2, b=2, t=16, s=200, n=8, k=2, h=128, dtype=jnp.bfloat16)
  out = run(case, impl="pallas_tpu", interpret=TPU_INTERPRET, block_kv=128)
  np.testing.assert_allclose(out, run(case, impl="xla"), atol=2e-2, rtol=0)
  np.testing.assert_allclose(out, brute_force(case), atol=3e-2, rtol=0)


def test_garbage_past_cache_len_is_ignored():
  case = make_case(3, b=3, t=7, s=300, n=8, k=2, h=64, cache_len=[0, 130, 256])
  slot_bs = jnp.arange(300)[None, :]
  stale_bs11 = (slot_bs >= case["cache_len"][:, None])[..., None, None]
  kwargs = dict(impl="pallas_tpu", interpret=TPU_INTERPRET, block_kv=128)
  clean = run(case, **kwargs)
  np.testing.assert_allclose(clean, run(case, impl="xla"), atol=2e-5, rtol=0)
  for garbage in (np.nan, np.inf):
    for name in ("k_cache", "v_cache"):
      case[name] = jnp.where(stale_bs11, garbage, case[name])
    np.testing.assert_allclose(run(case, **kwargs), clean, atol=1e-6, rtol=0)


def test_pallas_impl_names_the_kernel_for_a_backend():
  assert [pallas_impl(name) for name in ("gpu", "cuda", "rocm", "tpu")] == [
      "pallas", "pallas", "pallas", "pallas_tpu"]
  with pytest.raises(ValueError, match="'cpu'"):
    pallas_impl("cpu")


def lower_for_tpu(fn, *args) -> str:
  """StableHLO text of `fn` lowered for TPU on this CPU-only host (no compile)."""
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


def qwen3_8b_args(t: int, s: int = 4096, b: int = 2) -> tuple:
  """Abstract bf16 arguments at Qwen3-8B attention shapes (32 query heads, 8 kv heads, H=128)."""
  n, k, h = 32, 8, 128
  bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  return (bf16(b, t, n, h), bf16(b, s, k, h), bf16(b, s, k, h),
          jax.ShapeDtypeStruct((b,), jnp.int32), bf16(b, t, k, h), bf16(b, t, k, h),
          jax.ShapeDtypeStruct((b, t, t), jnp.bool_))


@pytest.mark.parametrize("t", [16, 64, 256])
def test_lowers_for_tpu_at_qwen3_8b_shapes(t):
  fn = functools.partial(tree_attention, impl="pallas_tpu")
  assert MOSAIC_CALL in lower_for_tpu(fn, *qwen3_8b_args(t))


def test_lowering_odd_sizes_and_illegal_blocks():
  fn = functools.partial(tree_attention, impl="pallas_tpu", block_kv=384)
  assert MOSAIC_CALL in lower_for_tpu(fn, *qwen3_8b_args(37, s=4000))
  with pytest.raises(ValueError, match="multiple of 128"):
    fn = functools.partial(tree_attention, impl="pallas_tpu", block_kv=64)
    lower_for_tpu(fn, *qwen3_8b_args(16))
