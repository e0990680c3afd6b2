"""One attention path per impl: with "pallas" / "pallas_tpu" every forward over a cache (prefill
chunks, AR steps, verify trees, the draft head's block) runs the tree kernel, and gives what the
XLA path ("xla", the CPU path) gives; lowered for CUDA and TPU at Qwen3-8B shapes, nothing of the
XLA attention loop is left."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetflow_jax
from jetflow_jax.config import Qwen3Config
from jetflow_jax.decoding.loop import batch_rows, decode_rounds
from jetflow_jax.decoding.prefill import PREFILL_CHUNK, prefill, prefill_forward
from jetflow_jax.decoding.round import RoundSpec, TreeShape
from jetflow_jax.drafters import HeadDrafter
from jetflow_jax.head import draft_block, init_head_cache, init_head_params
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.model import KVCache, abstract_params, forward
from jetflow_jax.sampling import Greedy

TRITON_CALL = "__gpu$xla.gpu.triton"
MOSAIC_CALL = "tpu_custom_call"
# float32 on both paths; they differ only in how the softmax is summed (blocks of 64 or 128
# slots, the kernel's log2 domain): measured 1.7e-6 on hidden states up to 3.8 after two layers.
ATOL = 2e-5
SLOTS = 64


@pytest.fixture(scope="module")
def target(tmp_path_factory):
  from conftest import make_hf_model
  directory = str(tmp_path_factory.mktemp("target"))
  make_hf_model(num_hidden_layers=2).save_pretrained(directory)
  return jetflow_jax.load_qwen3(directory)


def tokens(config, batch, length, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, config.vocab_size, (batch, length)),
                     jnp.int32)


def assert_close(got, want, atol=ATOL):
  jax.tree.map(lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=atol,
                                                       rtol=0), got, want)


@pytest.mark.parametrize("chunk", [16, PREFILL_CHUNK])  # two chunks, or one pass without a cache
def test_prefill_through_the_kernel_equals_xla(target, chunk):
  config, params = target
  prompt_bt, lengths_b = tokens(config, 2, 32), jnp.array([32, 13], jnp.int32)
  run = jax.jit(lambda impl: prefill_forward(params, config, prompt_bt, lengths_b, SLOTS,
                                             chunk=chunk, keep_hidden=True, impl=impl)[:2],
                static_argnums=0)
  (cache, hidden), (want_cache, want_hidden) = run("pallas"), run("xla")
  assert_close(hidden, want_hidden)
  assert_close(jax.tree.map(lambda x: x[:, :32], cache),
               jax.tree.map(lambda x: x[:, :32], want_cache))


@pytest.fixture(scope="module")
def prefix_cache(target):
  """A cache of SLOTS slots for 3 rows whose first 24 hold a random prefix's K/V."""
  config, params = target
  _, rows, _ = jax.jit(lambda: forward(params, config, tokens(config, 3, 24, seed=1)))()
  return KVCache.from_rows(rows, SLOTS)


def test_chunk_after_cache_rows_of_different_lengths(target, prefix_cache):
  """A chunk of 12 rows written after 0, 9 and 24 cached slots: same hidden states and cache.
  (Mosaic's causal chunks, split or not, are checked on their own in test_tree_attention.)"""
  config, params = target
  cache, start_b = prefix_cache, jnp.array([0, 9, 24], jnp.int32)
  run = jax.jit(lambda impl: forward(params, config, tokens(config, 3, 12), cache=cache,
                                     cache_index_b=start_b, impl=impl)[:2], static_argnums=0)
  assert_close(run("pallas"), run("xla"))


def test_ar_step_through_the_kernel_equals_the_in_place_xla_step(target, prefix_cache):
  """The kernel's AR step (a root-only tree, cache read-only) against XLA's (K/V written in place,
  the causal loop), as `decoding.round` runs them; rows of 0, 9 and 24 cached tokens. (Mosaic's
  one-row tree is checked on its own in test_tree_attention_tpu.)"""
  config, params = target
  cache, len_b = prefix_cache, jnp.array([0, 9, 24], jnp.int32)
  token_b1 = tokens(config, 3, 1, seed=2)
  step = jax.jit(lambda: forward(params, config, token_b1, cache=cache, cache_index_b=len_b,
                                 tree_mask_btt=jnp.ones((3, 1, 1), bool), impl="pallas")[:2])
  in_place = jax.jit(lambda: forward(params, config, token_b1, cache=cache, cache_index_b=len_b,
                                     impl="xla")[:2])
  (hidden, rows), (want_hidden, want_cache) = step(), in_place()
  assert_close(hidden, want_hidden)
  written = jax.tree.map(lambda x: x[jnp.arange(3), len_b][:, None], want_cache)
  assert_close(rows, written)


# Qwen3-8B's attention (32 query heads, 8 kv heads, H = 128) in one decoder layer.
QWEN3_8B_LAYER = Qwen3Config(vocab_size=1024, hidden_size=4096, intermediate_size=12288,
                             num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8,
                             head_dim=128)
BATCH, CACHE = 2, 4096
PLATFORMS = {"pallas": ("gpu", "cuda", TRITON_CALL), "pallas_tpu": ("tpu", "tpu", MOSAIC_CALL)}


def abstract(shape, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct(shape, dtype)


def lower(monkeypatch, impl, fn, *args) -> str:
  """StableHLO of `fn` lowered for `impl`'s platform on this CPU-only host, as that platform's
  own backend would trace it (the model interprets kernels only when it runs on CPU)."""
  backend, platform, _ = PLATFORMS[impl]
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def kernel_calls(impl, text) -> int:
  """How many calls of `impl`'s kernel `text` makes; the XLA path's cache loop (a while) must
  not appear in it."""
  assert "stablehlo.while" not in text
  return text.count(PLATFORMS[impl][2])


def target_forward(t, cached, tree, impl):
  """The abstract arguments and function of one target forward of `t` rows."""
  cache = KVCache(k=(abstract((BATCH, CACHE, 8, 128)),), v=(abstract((BATCH, CACHE, 8, 128)),))

  def fn(params, tokens_bt, cache, cache_index_b, tree_mask_btt):
    return forward(params, QWEN3_8B_LAYER, tokens_bt, cache=cache if cached else None,
                   cache_index_b=cache_index_b, tree_mask_btt=tree_mask_btt if tree else None,
                   impl=impl)[:2]

  return fn, (abstract_params(QWEN3_8B_LAYER, jnp.bfloat16), abstract((BATCH, t), jnp.int32),
              cache, abstract((BATCH,), jnp.int32), abstract((BATCH, t, t), jnp.bool_))


# AR step, verify trees, a whole prefill chunk after the cache, a one-pass prefill (no cache).
TARGET_CASES = [dict(t=1, cached=True, tree=True), dict(t=64, cached=True, tree=True),
                dict(t=256, cached=True, tree=True),
                dict(t=PREFILL_CHUNK, cached=True, tree=False),
                dict(t=1000, cached=False, tree=False)]


@pytest.mark.parametrize("impl", ["pallas", "pallas_tpu"])
@pytest.mark.parametrize("case", TARGET_CASES, ids=lambda c: "-".join(
    [f"t{c['t']}", "tree" if c["tree"] else "causal", "cache" if c["cached"] else "nocache"]))
def test_target_forward_lowers_to_the_kernel_at_qwen3_8b_shapes(monkeypatch, impl, case):
  fn, args = target_forward(**case, impl=impl)
  text = lower(monkeypatch, impl, fn, *args)
  # Triton takes every row in one call; Mosaic a causal chunk 256 rows at a time.
  per_call = case["t"] if impl == "pallas" or case["tree"] else 256
  assert kernel_calls(impl, text) == -(-case["t"] // per_call)


@pytest.mark.parametrize("impl", ["pallas", "pallas_tpu"])
def test_draft_head_block_lowers_to_the_kernel_at_qwen3_8b_shapes(monkeypatch, impl):
  head = HeadConfig.for_target(QWEN3_8B_LAYER, num_layers=1, block_size=16, mask_token_id=0,
                               target_layer_ids=(0,))
  head_params = jax.eval_shape(lambda: init_head_params(head, jax.random.key(0), jnp.bfloat16))
  cache = jax.eval_shape(lambda: init_head_cache(head, BATCH, CACHE, jnp.bfloat16))
  fn = lambda head_params, target_params, cache, context_len_b, anchor_b: draft_block(
      head_params, head, target_params, QWEN3_8B_LAYER, cache, context_len_b, anchor_b,
      jnp.bfloat16, impl)
  text = lower(monkeypatch, impl, fn, head_params, abstract_params(QWEN3_8B_LAYER, jnp.bfloat16),
               cache, abstract((BATCH,), jnp.int32), abstract((BATCH,), jnp.int32))
  assert kernel_calls(impl, text) == 1


@pytest.mark.parametrize("impl", ["pallas", "pallas_tpu"])
def test_a_bf16_round_copies_no_weight_or_cache_to_float32(monkeypatch, impl):
  """A whole JetFlow round of bf16 params lowered for the accelerator: activations go to float32
  where the numerics ask (norms, softmax), but no weight matrix and no cache is ever converted,
  so none is read twice or held twice (on CPU, XLA upcasts bf16 dots itself; a GPU/TPU does
  not)."""
  config = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=768,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64)
  head = HeadConfig.for_target(config, num_layers=1, block_size=8, mask_token_id=511,
                               target_layer_ids=(0, 1))
  target_abs = abstract_params(config, jnp.bfloat16)
  head_abs = jax.eval_shape(lambda: init_head_params(head, jax.random.key(0), jnp.bfloat16))
  drafter = HeadDrafter(head, jnp.bfloat16, impl)
  spec = RoundSpec(config=config, drafter=drafter, tree_shape=TreeShape("top_n", 16, 4),
                   impl=impl, sampled=False, filtered=False)
  rows = batch_rows([[1] * 31], 16, 64, Greedy(), 0, ())
  state = prefill.lower(target_abs, head_abs, *jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), rows.args()), config=config,
      drafter=drafter, slots=64 + head.depth + 1, capacity=64, sampled=False,
      filtered=False).out_info
  text = lower(monkeypatch, impl, functools.partial(decode_rounds, spec=spec), target_abs,
               head_abs, state, abstract((), jnp.int32))
  converts = re.findall(r"stablehlo.convert %[\w#]+ : \(tensor<(\w+)xbf16>\) -> "
                        r"tensor<\w+xf32>", text)
  assert converts  # activations are upcast: the pattern finds what it looks for
  shape = lambda x: "x".join(map(str, x.shape))
  weights = {shape(x) for x in jax.tree.leaves((target_abs, head_abs)) if x.ndim >= 2}
  caches = {shape(x) for x in jax.tree.leaves((state.cache, state.drafter_state))}
  assert not (set(converts) & (weights | caches))
