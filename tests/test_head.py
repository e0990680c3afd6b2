"""The draft head: inference path vs training path, vs an independent torch oracle, mask flag."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import Qwen3Config as HFQwen3Config

import jetflow_jax
from jetflow_jax import head as head_lib
from jetflow_jax.head import draft_logits, init_head_cache, init_head_params
from jetflow_jax.head_checkpoint import save_hf_head
from jetflow_jax.head_config import HeadConfig, default_target_layer_ids
from torch_head_oracle import OracleHead

TARGET = dict(num_hidden_layers=4, vocab_size=96)
# The library's building blocks run inside jitted steps; jit them here too (eager is slow).
training_logits = jax.jit(head_lib.training_logits, static_argnums=(1, 3))
append_context = jax.jit(head_lib.append_context, static_argnums=(1,))
draft_block = jax.jit(head_lib.draft_block, static_argnums=(1, 3))


@functools.partial(jax.jit, static_argnums=(0, 1))
def random_head(config: HeadConfig, seed=0):
  """Random params with O(1) norms, so every part of the head matters."""
  params = init_head_params(config, jax.random.key(seed))
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  leaves = [x * (0.5 + jax.random.uniform(k, x.shape)) if x.ndim == 1 else
            x + 0.02 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
  return jax.tree.unflatten(tree, leaves)


@pytest.fixture
def target(make_checkpoint):
  directory, hf_model = make_checkpoint(**TARGET)
  config, params = jetflow_jax.load_qwen3(directory)
  return config, params, hf_model


def test_default_taps_follow_the_reference_rule():
  assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
  assert default_target_layer_ids(48, 5) == (1, 12, 23, 34, 45)
  assert default_target_layer_ids(28, 1) == (14,)


@pytest.mark.parametrize("causal", [True, False])
def test_inference_forward_equals_training_forward_per_anchor(target, causal, rng):
  config, params, _ = target
  head = HeadConfig.for_target(config, num_layers=2, block_size=5, mask_token_id=95, causal=causal,
                               target_layer_ids=(0, 2))
  head_params = random_head(head)
  tokens = rng.integers(0, 95, (2, 24))
  anchors = np.array([[2, 13, 23], [23, 2, 13]])  # rows order their anchors differently
  _, taps = jetflow_jax.qwen3_forward(params, config, tokens, tap_layers=head.target_layer_ids)
  packed = training_logits(head_params, head, params, config, taps, tokens, anchors)
  assert packed.shape == (2, 3, head.depth, config.vocab_size)
  for anchor in anchors[0]:
    alone = draft_logits(head_params, head, params, config, tokens[:, :anchor + 1])
    for b in range(2):
      i = list(anchors[b]).index(anchor)
      np.testing.assert_allclose(alone[b], packed[b, i], atol=1e-4, rtol=0)


def test_context_appended_in_pieces_equals_all_at_once(target, rng):
  config, params, _ = target
  head = HeadConfig.for_target(config, num_layers=2, block_size=4, mask_token_id=95,
                               target_layer_ids=(0, 2))
  head_params = random_head(head)
  tokens = rng.integers(0, 95, (2, 15))
  _, taps = jetflow_jax.qwen3_forward(params, config, tokens[:, :-1],
                                      tap_layers=head.target_layer_ids)
  zero = jnp.zeros((2,), jnp.int32)
  cache = init_head_cache(head, 2, 32, jnp.float32)
  whole = append_context(head_params, head, cache, taps, zero)
  pieces = append_context(head_params, head, cache, taps[:, :6], zero)
  pieces = append_context(head_params, head, pieces, taps[:, 6:], zero + 6)
  args = (params, config)
  length = jnp.full((2,), 14, jnp.int32)
  np.testing.assert_allclose(draft_block(head_params, head, *args, whole, length, tokens[:, -1]),
                             draft_block(head_params, head, *args, pieces, length, tokens[:, -1]),
                             atol=1e-5)
  np.testing.assert_allclose(draft_block(head_params, head, *args, whole, length, tokens[:, -1]),
                             draft_logits(head_params, head, *args, tokens), atol=1e-4)


@pytest.mark.parametrize("causal", [True, False])
def test_draft_logits_match_independent_torch_head(target, causal, tmp_path, rng):
  config, params, hf_target = target
  head = HeadConfig.for_target(config, num_layers=2, block_size=6, mask_token_id=95, causal=causal,
                               target_layer_ids=(0, 2))
  head_params = random_head(head, seed=4)
  save_hf_head(head_params, head, str(tmp_path), dtype=jnp.float32)

  hf_layers = HFQwen3Config(**{k: v for k, v in head.to_hf_dict().items()
                               if k not in ("dflash_config", "architectures")})
  oracle = OracleHead(hf_layers, head.num_taps, causal).eval()
  from safetensors.torch import load_file
  # strict: every exported name and shape is one the reference layout has, and nothing is missing.
  oracle.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=True)

  tokens = rng.integers(0, 95, (1, 17))
  with torch.no_grad():
    out = hf_target(torch.tensor(tokens[:, :-1]), output_hidden_states=True)
    taps = torch.cat([out.hidden_states[i + 1] for i in head.target_layer_ids], -1)
    block = torch.tensor([[tokens[0, -1]] + [head.mask_token_id] * head.depth])
    hidden = oracle(taps, hf_target.model.embed_tokens(block))
    expected = hf_target.lm_head(hidden[:, 1:]).numpy()
  got = np.asarray(draft_logits(head_params, head, params, config, tokens))
  assert np.abs(expected).max() > 1.0
  np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_draft_logits_needs_a_context(target):
  config, params, _ = target
  head = HeadConfig.for_target(config, num_layers=1, block_size=4, mask_token_id=95)
  with pytest.raises(jetflow_jax.InputError, match="at least 2 tokens"):
    draft_logits(init_head_params(head, jax.random.key(0)), head, params, config, [[5]])


def test_mask_flag_changes_exactly_what_it_should(target, rng):
  """One head layer: the last block row sees every block row either way, earlier rows differ."""
  config, params, _ = target
  causal = HeadConfig.for_target(config, num_layers=1, block_size=5, mask_token_id=95)
  bidirectional = HeadConfig.for_target(config, num_layers=1, block_size=5, mask_token_id=95,
                                        causal=False)
  head_params = random_head(causal)
  tokens = rng.integers(0, 95, (1, 12))
  a = np.asarray(draft_logits(head_params, causal, params, config, tokens))
  b = np.asarray(draft_logits(head_params, bidirectional, params, config, tokens))
  np.testing.assert_allclose(a[:, -1], b[:, -1], atol=1e-5)
  assert np.abs(a[:, :-1] - b[:, :-1]).max(axis=-1).min() > 1e-3
