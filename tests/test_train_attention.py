"""Packed-anchor training attention: dense reference vs a float64 brute force, split (XLA) and
Pallas (interpret) vs dense with gradients, the head's training pass under each impl and remat
policy, and Pallas lowering for CUDA at Qwen3-8B head shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetflow_jax.config import Qwen3Config
from jetflow_jax.head import init_head_params, training_logits
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.kernels.train_attention import train_attention
from jetflow_jax.model import init_params

TRITON_CALL = "__gpu$xla.gpu.triton"
ARG_NAMES = ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")


def make_case(seed, b=2, a=6, block=4, s=50, n=8, k=2, h=16, dtype=jnp.float32, packed=False):
  """Random q/k/v and duplicate-free anchors per row that include 0, 1, S - 1 and S.

  `packed` cuts each row into samples at random boundaries: an anchor's context then starts
  where its sample does (`starts`; all 0 otherwise).
  """
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  edges = [0, 1, s - 1, s]
  anchors = [rng.permutation(edges + list(rng.choice(np.arange(2, s - 1), a - 4, replace=False)))
             for _ in range(b)]
  t = a * block
  starts = np.zeros((b, a), int)
  if packed:
    for bi in range(b):
      boundaries = np.concatenate([[0], np.sort(rng.choice(np.arange(2, s), 4, replace=False))])
      starts[bi] = [boundaries[boundaries <= anchor].max() for anchor in anchors[bi]]
  return dict(q=normal(b, t, n, h), k_ctx=normal(b, s, k, h), v_ctx=normal(b, s, k, h),
              k_blk=normal(b, t, k, h), v_blk=normal(b, t, k, h),
              anchors=jnp.asarray(np.stack(anchors), jnp.int32),
              starts=jnp.asarray(starts, jnp.int32))


@functools.partial(jax.jit, static_argnames=("causal", "impl", "block_kv"))
def run(case, causal, impl, block_kv=16):
  return train_attention(*(case[name] for name in ARG_NAMES), case["anchors"], causal,
                         case["starts"], impl=impl, interpret=True, block_kv=block_kv)


@functools.partial(jax.jit, static_argnames=("causal", "impl"))
def grads(case, causal, impl):
  """Gradients in q, k, v (context and block) of a fixed random projection of the output."""
  def loss(args):
    out = train_attention(*args, case["anchors"], causal, case["starts"], impl=impl,
                          interpret=True, block_kv=16)
    weights = jax.random.normal(jax.random.key(0), out.shape)
    return (out.astype(jnp.float32) * weights).sum()
  return jax.grad(loss)(tuple(case[name] for name in ARG_NAMES))


def brute_force(case, causal) -> np.ndarray:
  """Each block row separately: softmax over [context keys start..anchor-1, visible offsets]."""
  c = {name: np.asarray(x, np.float64) for name, x in case.items()}
  b, t, n, h = c["q"].shape
  num_anchors, k_heads = c["anchors"].shape[1], c["k_ctx"].shape[2]
  block = t // num_anchors
  out = np.zeros((b, t, n, h))
  for bi in range(b):
    for ai, anchor in enumerate(c["anchors"][bi].astype(int)):
      context = slice(int(c["starts"][bi, ai]), anchor)
      for i in range(block):
        offsets = ai * block + np.arange(i + 1 if causal else block)
        keys = np.concatenate([c["k_ctx"][bi, context], c["k_blk"][bi, offsets]])
        values = np.concatenate([c["v_ctx"][bi, context], c["v_blk"][bi, offsets]])
        for ni in range(n):
          kv = ni // (n // k_heads)
          logits = keys[:, kv] @ c["q"][bi, ai * block + i, ni] / np.sqrt(h)
          p = np.exp(logits - logits.max())
          out[bi, ai * block + i, ni] = (p / p.sum()) @ values[:, kv]
  return out


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_dense_reference_matches_brute_force(causal, packed):
  case = make_case(0, b=2, a=5, block=3, s=20, n=4, k=2, packed=packed)
  assert (np.asarray(case["starts"]) > 0).any() == packed
  np.testing.assert_allclose(run(case, causal, "dense"), brute_force(case, causal), atol=1e-5,
                             rtol=0)


# S = 50 is not a multiple of any key tile; GQA groups of 4 and 1; blocks of 4 and 16 rows.
SHAPES = [dict(a=6, block=4, s=50, n=8, k=2), dict(a=5, block=16, s=40, n=2, k=2)]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_split_and_pallas_equal_dense(causal, shape, packed):
  case = make_case(1, **shape, packed=packed)
  expected = run(case, causal, "dense")
  for impl in ("split", "pallas"):
    np.testing.assert_allclose(run(case, causal, impl), expected, atol=1e-5, rtol=0, err_msg=impl)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_split_and_pallas_gradients_equal_dense(causal, packed):
  case = make_case(2, a=6, block=4, s=50, n=8, k=2, packed=packed)
  expected = grads(case, causal, "dense")
  for impl in ("split", "pallas"):
    for name, got, want in zip(ARG_NAMES, grads(case, causal, impl), expected):
      np.testing.assert_allclose(got, want, atol=2e-5, rtol=0, err_msg=f"{impl} d{name}")


@pytest.mark.parametrize("chunk", [2, 4])  # 6 anchors: whole chunks, and a padded last chunk
def test_split_in_anchor_chunks_equals_split(chunk):
  case = make_case(4, a=6, block=4, s=50, n=8, k=2, packed=True)

  @functools.partial(jax.jit, static_argnames="chunk_anchors")
  def value_and_grads(args, chunk_anchors):
    def loss(args):
      out = train_attention(*args, case["anchors"], True, case["starts"], impl="split",
                            chunk_anchors=chunk_anchors)
      return (out * jax.random.normal(jax.random.key(0), out.shape)).sum(), out
    return jax.value_and_grad(loss, has_aux=True)(args)

  args = tuple(case[name] for name in ARG_NAMES)
  (_, whole), whole_grads = value_and_grads(args, 0)
  (_, chunked), chunked_grads = value_and_grads(args, chunk)
  np.testing.assert_allclose(chunked, whole, atol=1e-6, rtol=0)
  for name, got, want in zip(ARG_NAMES, chunked_grads, whole_grads):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=f"d{name}")


def test_pallas_bfloat16_close_to_dense():
  case = make_case(3, a=4, block=8, s=48, n=8, k=2, h=32, dtype=jnp.bfloat16)
  expected = np.asarray(run(case, True, "dense"), np.float32)
  np.testing.assert_allclose(np.asarray(run(case, True, "pallas"), np.float32), expected,
                             atol=2e-2, rtol=0)


def test_illegal_pallas_settings_are_refused():
  case = make_case(0)
  with pytest.raises(ValueError, match="power of two"):
    run(case, True, "pallas", block_kv=48)
  with pytest.raises(ValueError, match="unknown train attention impl"):
    run(case, True, "flash")


TARGET = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e4)


@functools.partial(jax.jit, static_argnames=("head", "attention", "remat"))
def head_logits_and_grads(head_params, head, target_params, taps, tokens, anchors, attention,
                          remat):
  def loss(params):
    logits = training_logits(params, head, target_params, TARGET, taps, tokens, anchors,
                             attention=attention, remat=remat)
    weights = jax.random.normal(jax.random.key(1), logits.shape)
    return (logits * weights).sum(), logits
  (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(head_params)
  return logits, grads


def head_case(causal: bool):
  """(head params, head config, target params, taps, tokens, anchors) of a 2-layer head."""
  head = HeadConfig.for_target(TARGET, num_layers=2, block_size=4, mask_token_id=95,
                               causal=causal, target_layer_ids=(0, 2))
  # Small random weights on top of the init, so the norms' scales matter too.
  params = init_head_params(head, jax.random.key(0))
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  params = jax.tree.unflatten(tree, [x + 0.1 * jax.random.normal(k, x.shape)
                                     for x, k in zip(leaves, keys)])
  rng = np.random.default_rng(4)
  tokens = jnp.asarray(rng.integers(0, 95, (2, 20)), jnp.int32)
  taps = jnp.asarray(rng.standard_normal((2, 20, 2, TARGET.hidden_size)), jnp.float32)
  anchors = jnp.asarray([[0, 7, 19], [12, 1, 18]], jnp.int32)
  return params, head, init_params(TARGET, jax.random.key(2)), taps, tokens, anchors


def assert_head_matches(args, expected, attention, remat):
  logits, grads = head_logits_and_grads(*args, attention, remat)
  np.testing.assert_allclose(logits, expected[0], atol=1e-4, rtol=0)
  jax.tree.map(functools.partial(np.testing.assert_allclose, atol=1e-4, rtol=1e-4), grads,
               expected[1])


# Compiles are shared through the jit cache: the dense and split runs of the first test are
# reused by the next two.
@pytest.mark.parametrize("causal", [True, False])
def test_head_split_equals_dense(causal):
  args = head_case(causal)
  expected = head_logits_and_grads(*args, "dense", "none")
  assert np.abs(expected[0]).max() > 1.0
  assert_head_matches(args, expected, "split", "none")


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_head_remat_keeps_logits_and_gradients(remat):
  args = head_case(True)
  assert_head_matches(args, head_logits_and_grads(*args, "split", "none"), "split", remat)


def test_head_pallas_equals_dense():
  args = head_case(True)
  assert_head_matches(args, head_logits_and_grads(*args, "dense", "none"), "pallas", "full")


def test_unknown_remat_policy_is_refused():
  head = HeadConfig.for_target(TARGET, num_layers=1, block_size=4, mask_token_id=95)
  with pytest.raises(ValueError, match="unknown remat policy"):
    training_logits(None, head, None, TARGET, None, jnp.zeros((1, 8), jnp.int32),
                    jnp.zeros((1, 2), jnp.int32), remat="some")


def lower_for_cuda(fn, *args) -> str:
  """StableHLO text of `fn` lowered for CUDA on this CPU-only host (no compile)."""
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_pallas_lowers_for_cuda_at_qwen3_8b_head_shapes():
  """32 query heads, 8 kv heads, H = 128, T = 3072 context rows, 512 anchors of 16, bf16."""
  b, s, a, block, n, k, h = 1, 3072, 512, 16, 32, 8, 128
  bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  # The last two: anchors, and where each anchor's sample starts (packed rows).
  args = (bf16(b, a * block, n, h), bf16(b, s, k, h), bf16(b, s, k, h), bf16(b, a * block, k, h),
          bf16(b, a * block, k, h), jax.ShapeDtypeStruct((b, a), jnp.int32),
          jax.ShapeDtypeStruct((b, a), jnp.int32))
  forward = lambda *x: train_attention(*x[:6], True, x[6], impl="pallas")
  assert lower_for_cuda(forward, *args).count(TRITON_CALL) == 1
  # The backward adds the dq and the dk/dv kernels.
  backward = jax.grad(lambda *x: forward(*x).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3, 4))
  assert lower_for_cuda(backward, *args).count(TRITON_CALL) == 3
