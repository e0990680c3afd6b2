"""A long prompt prefilled in chunks (each attending to the cache the chunks before it wrote)
gives the state of a one-pass prefill: the same cache, head context and first token."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetflow_jax
from jetflow_jax.decoding.loop import decode
from jetflow_jax.decoding.policy import tree_shape_for
from jetflow_jax.decoding.prefill import PREFILL_CHUNK, prefill
from jetflow_jax.decoding.round import RoundSpec
from jetflow_jax.decoding.state import stop_rows
from jetflow_jax.drafters import NoDrafter
from jetflow_jax.drafters import HeadDrafter
from jetflow_jax.head import init_head_params
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.sampling import Greedy, RowSampling

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


def run_prefill(params, config, drafter, drafter_params, tokens, lengths, max_new, chunk):
  """Greedy rows of `tokens` through `prefill`, buffers for CACHE tokens and a round's room."""
  batch = len(lengths)
  return prefill(params, drafter_params, tokens, lengths, lengths + max_new,
                 jax.vmap(jax.random.key)(jnp.arange(batch)), RowSampling.of([Greedy()] * batch),
                 stop_rows([()] * batch), config=config, drafter=drafter,
                 slots=CACHE + drafter.depth + 1, capacity=CACHE, sampled=False, filtered=False,
                 chunk=chunk)


def assert_trees_close(got, want):
  jax.tree.map(lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5,
                                                       rtol=2e-5), got, want)


@pytest.mark.parametrize("width", [64, 50])  # a whole number of chunks, and a shorter last one
def test_chunked_ar_prefill_equals_one_pass(target, width):
  config, params = target
  tokens, lengths = prompts(config, width)
  run = lambda chunk: run_prefill(params, config, NoDrafter(), None, tokens, lengths, 8, chunk)
  whole, chunked = run(PREFILL_CHUNK), run(16)
  # Slots at or past a row's prompt hold padding K/V, never read: compare the prompt slots.
  valid = (np.arange(CACHE + 1)[None, :] < lengths[:, None])[:, :, None, None]
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
  run = lambda chunk: run_prefill(params, config, drafter, head_params, tokens, lengths, 24,
                                  chunk)
  whole, chunked = run(PREFILL_CHUNK), run(16)
  valid = (np.arange(CACHE + head.depth + 1)[None, :] < lengths[:, None])[:, :, None, None]
  masked = lambda cache: jax.tree.map(lambda x: x * valid, cache)
  assert_trees_close(masked(chunked.cache), masked(whole.cache))
  assert_trees_close(masked(chunked.drafter_state), masked(whole.drafter_state))
  np.testing.assert_array_equal(chunked.tokens_bs, whole.tokens_bs)

  spec = RoundSpec(config, drafter, tree_shape_for("jetflow", 8, 3), sampled=False,
                   filtered=False)
  run = lambda state: decode(params, head_params, state, 24, spec=spec)
  np.testing.assert_array_equal(run(chunked).tokens_bs, run(whole).tokens_bs)
