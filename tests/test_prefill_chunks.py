"""A long prompt prefilled in chunks (each attending to the cache the chunks before it wrote)
gives the state of a one-pass prefill: the same cache, head context and first token."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetflow_jax
from jetflow_jax import generate, speculative
from jetflow_jax.drafters import HeadDrafter
from jetflow_jax.head import init_head_params
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.sampling import Greedy

CACHE = 96


@pytest.fixture(scope="module")
def target(tmp_path_factory):
  from conftest import make_hf_model
  directory = str(tmp_path_factory.mktemp("target"))
  make_hf_model(num_hidden_layers=3).save_pretrained(directory)
  return jetflow_jax.load_qwen3(directory)


def prompts(config, width):
  """Rows of different lengths (one ends inside the first chunk), right-padded to `width`."""
  rng = np.random.default_rng(0)
  lengths = np.array([width, 13, width - 9], np.int32)
  tokens = rng.integers(0, config.vocab_size, (3, width)).astype(np.int32)
  return tokens * (np.arange(width)[None] < lengths[:, None]), lengths


def assert_trees_close(got, want):
  jax.tree.map(lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5,
                                                       rtol=2e-5), got, want)


@pytest.mark.parametrize("width", [64, 50])  # a whole number of chunks, and a shorter last one
def test_chunked_ar_prefill_equals_one_pass(target, width):
  config, params = target
  tokens, lengths = prompts(config, width)
  run = lambda chunk: generate.prefill(params, config, tokens, lengths, 8, jax.random.key(0),
                                       sampler=Greedy(), cache_size=CACHE, chunk=chunk)
  whole, chunked = run(generate.PREFILL_CHUNK), run(16)
  # Slots at or past a row's prompt hold padding K/V, never read: compare the prompt slots.
  valid = (np.arange(CACHE)[None, :] < lengths[:, None])[:, :, None, None]
  assert_trees_close(jax.tree.map(lambda x: x * valid, chunked.cache),
                     jax.tree.map(lambda x: x * valid, whole.cache))
  np.testing.assert_array_equal(chunked.tokens_bs, whole.tokens_bs)


def test_chunked_speculative_prefill_equals_one_pass_and_decodes_alike(target):
  config, params = target
  head = HeadConfig.for_target(config, num_layers=2, block_size=4, mask_token_id=95,
                               target_layer_ids=(0, 1))
  head_params = init_head_params(head, jax.random.key(1))
  drafter = HeadDrafter(head)
  tokens, lengths = prompts(config, 50)
  statics = dict(config=config, drafter=drafter, sampler=Greedy(), stop_tokens=(),
                 capacity=CACHE)
  run = lambda chunk: speculative.prefill(params, head_params, tokens, lengths, 24,
                                          jax.random.key(0), chunk=chunk, **statics)
  whole, chunked = run(generate.PREFILL_CHUNK), run(16)
  valid = (np.arange(CACHE + head.depth + 1)[None, :] < lengths[:, None])[:, :, None, None]
  masked = lambda cache: jax.tree.map(lambda x: x * valid, cache)
  assert_trees_close(masked(chunked.cache), masked(whole.cache))
  assert_trees_close(masked(chunked.drafter_state), masked(whole.drafter_state))
  np.testing.assert_array_equal(chunked.tokens_bs, whole.tokens_bs)

  decode = lambda state: speculative.decode(
      params, head_params, state, 24, config=config, drafter=drafter,
      tree_shape=speculative.tree_shape_for("jetflow", 8, 3), sampler=Greedy(), stop_tokens=(),
      impl="xla")
  np.testing.assert_array_equal(decode(chunked).tokens_bs, decode(whole).tokens_bs)
