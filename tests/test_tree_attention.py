"""Tree-verify attention: XLA reference vs a float64 brute force, Pallas (interpret) vs the
reference and the brute force at every query count decoding uses, garbage past cache_len, causal
chunks through the kernels, and Pallas lowering for CUDA at Qwen3-8B shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetflow_jax.kernels import tree_attention
from jetflow_jax.kernels.tree_attention import causal_attention

TRITON_CALL = "__gpu$xla.gpu.triton"


def random_parents(rng: np.random.Generator, t: int) -> np.ndarray:
  """A random forest over t nodes with parent < child (-1 marks a root)."""
  return np.array([-1] + [int(rng.integers(-1, i)) for i in range(1, t)])


def ancestor_or_self(parents: np.ndarray) -> np.ndarray:
  """[T, T] bool: mask[t, j] iff node j is t or one of its ancestors."""
  t = len(parents)
  mask = np.eye(t, dtype=bool)
  for i in range(t):
    if parents[i] >= 0:
      mask[i] |= mask[parents[i]]
  return mask


def make_case(seed, b=2, t=5, s=40, n=4, k=1, h=16, cache_len=None, dtype=jnp.float32):
  """Random q, caches, new rows, per-row cache lengths (0 and S included) and tree masks."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  if cache_len is None:
    cache_len = np.array([0, s, *rng.integers(0, s + 1, size=max(b - 2, 0))])[:b]
  masks = np.stack([ancestor_or_self(random_parents(rng, t)) for _ in range(b)])
  arrays = dict(q=normal(b, t, n, h), k_cache=normal(b, s, k, h), v_cache=normal(b, s, k, h),
                k_new=normal(b, t, k, h), v_new=normal(b, t, k, h))
  case = {name: jnp.asarray(x, dtype) for name, x in arrays.items()}
  case.update(cache_len=jnp.asarray(cache_len, jnp.int32), mask=jnp.asarray(masks))
  return case


# Jitted so each case compiles once instead of dispatching the wrapper op by op.
_tree_attention_jit = jax.jit(tree_attention, static_argnames=(
    "impl", "interpret", "block_kv", "block_rows", "kv_splits"))


def run(case, **kwargs):
  args = [case[name] for name in ("q", "k_cache", "v_cache", "cache_len", "k_new", "v_new", "mask")]
  return np.asarray(_tree_attention_jit(*args, **kwargs).astype(jnp.float32))


def brute_force(case) -> np.ndarray:
  """Each node separately: causal attention over [prefix..., root-to-node branch], float64."""
  c = {name: np.asarray(x.astype(jnp.float32), np.float64) if name != "mask" else np.asarray(x)
       for name, x in case.items()}
  b, t, n, h = c["q"].shape
  k_heads = c["k_cache"].shape[2]
  out = np.zeros((b, t, n, h))
  for bi in range(b):
    length = int(c["cache_len"][bi])
    for ti in range(t):
      branch = np.flatnonzero(c["mask"][bi, ti])  # ancestors in order, ending with ti itself
      keys = np.concatenate([c["k_cache"][bi, :length], c["k_new"][bi, branch]])
      values = np.concatenate([c["v_cache"][bi, :length], c["v_new"][bi, branch]])
      for ni in range(n):
        kv = ni // (n // k_heads)
        logits = keys[:, kv] @ c["q"][bi, ti, ni] / np.sqrt(h)
        p = np.exp(logits - logits.max())
        out[bi, ti, ni] = (p / p.sum()) @ values[:, kv]
  return out


@pytest.mark.parametrize("t,n,k", [(5, 4, 4), (9, 8, 2), (16, 4, 1)])
def test_xla_matches_brute_force(t, n, k):
  for seed in range(2):
    case = make_case(seed, b=3, t=t, s=24, n=n, k=k)
    np.testing.assert_allclose(run(case, impl="xla"), brute_force(case), atol=1e-5, rtol=0)


def test_xla_chain_equals_causal_attention():
  """A chain tree is plain causal attention over prefix + block (the draft-block case)."""
  case = make_case(0, b=2, t=6, s=12, n=4, k=2)
  case["mask"] = jnp.broadcast_to(jnp.tril(jnp.ones((6, 6), bool)), (2, 6, 6))
  np.testing.assert_allclose(run(case, impl="xla"), brute_force(case), atol=1e-5, rtol=0)


@pytest.mark.parametrize("scores_bytes,block", [(1 << 28, 1 << 20), (4 * 60 * 256, 256)])
def test_xla_gpu_loop_equals_brute_force(monkeypatch, scores_bytes, block):
  """On a GPU the cache loop takes blocks as large as the scores allow, over the whole buffer
  (a static count): one block of all 300 slots, or blocks of 256 whose last is pulled back."""
  from jetflow_jax import attention
  monkeypatch.setattr(attention, "GPU_SCORES_BYTES", scores_bytes)
  monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
  case = make_case(3, b=3, t=5, s=300, n=4, k=1, cache_len=[0, 300, 131])
  args = [case[name] for name in ("q", "k_cache", "v_cache", "cache_len", "k_new", "v_new",
                                  "mask")]
  assert attention.cache_block(3 * 5 * 4, "gpu") == block  # 60 score rows of float32
  np.testing.assert_allclose(np.asarray(tree_attention(*args, impl="xla")), brute_force(case),
                             atol=1e-5, rtol=0)


# T not a multiple of any block, S not a multiple of block_kv (and S below it), GQA 1 and 4.
PALLAS_CASES = [
    dict(t=5, s=50, n=4, k=4, block_kv=16),
    dict(t=16, s=50, n=8, k=2, block_kv=32, block_rows=16),
    dict(t=37, s=40, n=4, k=1, block_kv=64),
    dict(t=16, s=70, n=4, k=1, block_kv=16, kv_splits=3),
]


@pytest.mark.parametrize("cfg", PALLAS_CASES,
                         ids=lambda cfg: "-".join(f"{k}{v}" for k, v in cfg.items()))
def test_pallas_interpret_matches_xla(cfg):
  shape = {name: cfg[name] for name in ("t", "s", "n", "k")}
  tune = {name: v for name, v in cfg.items() if name not in shape}
  case = make_case(1, b=3, **shape)
  expected = run(case, impl="xla")
  np.testing.assert_allclose(run(case, impl="pallas", interpret=True, **tune), expected,
                             atol=1e-5, rtol=0)


def test_pallas_interpret_bfloat16_close_to_xla():
  case = make_case(2, b=2, t=16, s=48, n=8, k=2, h=32, dtype=jnp.bfloat16)
  out = run(case, impl="pallas", interpret=True, block_kv=16)
  np.testing.assert_allclose(out, run(case, impl="xla"), atol=2e-2, rtol=0)
  np.testing.assert_allclose(out, brute_force(case), atol=3e-2, rtol=0)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_garbage_past_cache_len_is_ignored(impl):
  case = make_case(3, b=3, t=7, s=50, n=8, k=2, cache_len=[0, 19, 33])
  slot_bs = jnp.arange(50)[None, :]
  stale_bs11 = (slot_bs >= case["cache_len"][:, None])[..., None, None]
  kwargs = dict(impl=impl, interpret=True, block_kv=16)
  clean = run(case, **kwargs)
  # XLA multiplies the stale values by zero probabilities, so they must be finite there; the
  # kernel never lets them into a product, so NaN is fine too.
  for garbage in (1e30, np.nan) if impl == "pallas" else (1e30,):
    for name in ("k_cache", "v_cache"):
      case[name] = jnp.where(stale_bs11, garbage, case[name])
    np.testing.assert_allclose(run(case, **kwargs), clean, atol=1e-6, rtol=0)


# Every query count a kernel sees in decoding: an AR step (1), the draft head's block (16, all
# rows reading each other), a verify tree (64) and a prefill chunk (128, causal). Mosaic's trees
# are checked in test_tree_attention_tpu.
QUERY_COUNTS = [("pallas", 1, "tree"), ("pallas", 16, "full"), ("pallas", 64, "tree"),
                ("pallas", 128, "causal"), ("pallas_tpu", 128, "causal")]


@pytest.mark.parametrize("impl,t,mask", QUERY_COUNTS)
def test_kernel_interpret_matches_brute_force_at_every_query_count(impl, t, mask):
  """Rows of cache length 0, S and in between."""
  case = make_case(7, b=3, t=t, s=150, n=4, k=2, h=32, cache_len=[0, 150, 77])
  if mask != "tree":
    square = np.tril(np.ones((t, t), bool)) if mask == "causal" else np.ones((t, t), bool)
    case["mask"] = jnp.broadcast_to(jnp.asarray(square), (3, t, t))
  out = run(case, impl=impl, interpret=True)
  np.testing.assert_allclose(out, brute_force(case), atol=2e-5, rtol=0)


@pytest.mark.parametrize("impl", ["pallas", "pallas_tpu"])
def test_causal_attention_reads_the_buffer_up_to_each_row(impl):
  """A chunk of 100 rows written at slots start_b + t of a 180-slot buffer (starts 0, 80 and 23;
  blocks of 48 leave a short last one); garbage past the chunk is never read."""
  b, t, s, n, k, h = 3, 100, 180, 4, 2, 32
  start = np.array([0, 80, 23])
  case = make_case(5, b=b, t=t, s=s, n=n, k=k, h=h, cache_len=start)
  k_buf, v_buf = (np.array(case[name]) for name in ("k_cache", "v_cache"))
  for bi, lo in enumerate(start):
    k_buf[bi, lo:lo + t], v_buf[bi, lo:lo + t] = case["k_new"][bi], case["v_new"][bi]
    k_buf[bi, lo + t:] = v_buf[bi, lo + t:] = np.nan
  case["mask"] = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  fn = jax.jit(functools.partial(causal_attention, impl=impl, interpret=True, query_block=48))
  out = fn(case["q"], jnp.asarray(k_buf), jnp.asarray(v_buf), case["cache_len"], case["k_new"],
           case["v_new"])
  np.testing.assert_allclose(np.asarray(out), brute_force(case), atol=2e-5, rtol=0)


def lower_for_cuda(fn, *args) -> str:
  """StableHLO text of `fn` lowered for CUDA on this CPU-only host (no compile)."""
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def qwen3_8b_args(t: int, s: int = 4096) -> tuple:
  """Abstract bf16 arguments at Qwen3-8B attention shapes (32 query heads, 8 kv heads, H=128)."""
  b, n, k, h = 1, 32, 8, 128
  bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  return (bf16(b, t, n, h), bf16(b, s, k, h), bf16(b, s, k, h),
          jax.ShapeDtypeStruct((b,), jnp.int32), bf16(b, t, k, h), bf16(b, t, k, h),
          jax.ShapeDtypeStruct((b, t, t), jnp.bool_))


@pytest.mark.parametrize("t", [16, 32, 64, 128, 256])
def test_pallas_lowers_for_cuda_at_qwen3_8b_shapes(t):
  for kwargs in (dict(), dict(kv_splits=4)):
    fn = functools.partial(tree_attention, impl="pallas", **kwargs)
    assert TRITON_CALL in lower_for_cuda(fn, *qwen3_8b_args(t))


def test_pallas_lowering_odd_sizes_and_illegal_blocks():
  fn = functools.partial(tree_attention, impl="pallas", block_kv=128, block_rows=32)
  assert TRITON_CALL in lower_for_cuda(fn, *qwen3_8b_args(37, s=4000))
  with pytest.raises(ValueError, match="power of two"):
    fn = functools.partial(tree_attention, impl="pallas", block_kv=48)
    lower_for_cuda(fn, *qwen3_8b_args(16))
