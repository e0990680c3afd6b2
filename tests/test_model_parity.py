"""Logits and every layer's hidden states against transformers, in float32."""

import numpy as np
import pytest
import torch

import jetflow_jax
from jetflow_jax.model import forward, lm_logits

LOGIT_ATOL = 1e-4  # float32, O(1)-O(10) logits
HIDDEN_ATOL = 1e-4

CASES = {
    "dense_untied": dict(),
    "dense_tied": dict(tie_word_embeddings=True),
    "gqa_1": dict(num_key_value_heads=4),
    "gqa_2": dict(num_key_value_heads=2),
    "gqa_4": dict(num_key_value_heads=1),
    "head_dim_not_hidden_over_heads": dict(head_dim=24),
    "moe_norm_topk": dict(moe=True, norm_topk_prob=True),
    "moe_no_norm_topk": dict(moe=True, norm_topk_prob=False),
    "moe_sparse_step_and_mlp_only": dict(moe=True, decoder_sparse_step=2, mlp_only_layers=[2],
                                         num_hidden_layers=4),
    "sharded_bf16": dict(dtype=torch.bfloat16, max_shard_size="40KB"),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_and_hidden_states_match_transformers(case, make_checkpoint, rng):
  directory, hf_model = make_checkpoint(**CASES[case])
  config, params = jetflow_jax.load_qwen3(directory)
  tokens = rng.integers(0, config.vocab_size, (2, 11))

  with torch.no_grad():
    hf_out = hf_model(torch.tensor(tokens), output_hidden_states=True)
  all_layers = tuple(range(config.num_hidden_layers))
  logits, taps = jetflow_jax.qwen3_forward(params, config, tokens, tap_layers=all_layers)

  np.testing.assert_allclose(np.asarray(logits), hf_out.logits.numpy(), atol=LOGIT_ATOL, rtol=0)
  assert np.abs(hf_out.logits.numpy()).max() > 1.0  # the comparison is not between near-zeros
  # HF hidden_states[i + 1] is the raw output of layer i, except the last, which is final-normed.
  for layer in all_layers[:-1]:
    np.testing.assert_allclose(np.asarray(taps[:, :, layer]),
                               hf_out.hidden_states[layer + 1].numpy(), atol=HIDDEN_ATOL, rtol=0)
  final_hidden, _, _ = forward(params, config, tokens)
  np.testing.assert_allclose(np.asarray(final_hidden), hf_out.hidden_states[-1].numpy(),
                             atol=HIDDEN_ATOL, rtol=0)
  np.testing.assert_allclose(np.asarray(lm_logits(params, config, final_hidden)), np.asarray(logits),
                             atol=LOGIT_ATOL, rtol=0)
  if config.num_experts:  # the training pass's experts implementation, against the same oracle
    blocked_hidden, _, _ = forward(params, config, tokens, experts="blocked")
    np.testing.assert_allclose(np.asarray(blocked_hidden), hf_out.hidden_states[-1].numpy(),
                               atol=HIDDEN_ATOL, rtol=0)


def test_sharded_checkpoint_really_is_sharded(make_checkpoint):
  import os
  directory, _ = make_checkpoint(**CASES["sharded_bf16"])
  assert os.path.isfile(os.path.join(directory, "model.safetensors.index.json"))
  assert len([f for f in os.listdir(directory) if f.endswith(".safetensors")]) > 1


def test_bfloat16_params_track_float32(make_checkpoint, rng):
  directory, _ = make_checkpoint()
  config, params32 = jetflow_jax.load_qwen3(directory)
  _, params16 = jetflow_jax.load_qwen3(directory, dtype=jax_bfloat16())
  assert params16["embed_tokens"]["embedding"].dtype == jax_bfloat16()
  tokens = rng.integers(0, config.vocab_size, (1, 9))
  logits32 = np.asarray(jetflow_jax.qwen3_forward(params32, config, tokens))
  logits16 = np.asarray(jetflow_jax.qwen3_forward(params16, config, tokens))
  assert logits16.dtype == np.float32
  # bf16 has ~3 significant digits; 3 layers of it stay within a few percent of the logit scale.
  assert np.abs(logits16 - logits32).max() < 0.05 * np.abs(logits32).max()


def jax_bfloat16():
  import jax.numpy as jnp
  return jnp.bfloat16


def test_rope_theta_read_from_either_place(tmp_path):
  from jetflow_jax.config import Qwen3Config
  base = dict(model_type="qwen3", vocab_size=8, hidden_size=8, num_hidden_layers=1,
              num_attention_heads=2, intermediate_size=8)
  assert Qwen3Config.from_hf_dict({**base, "rope_theta": 123.0}).rope_theta == 123.0
  assert Qwen3Config.from_hf_dict(
      {**base, "rope_parameters": {"rope_theta": 456.0, "rope_type": "default"}}).rope_theta == 456.0


@pytest.mark.parametrize("tied", [True, False])
def test_bf16_lm_head_accumulates_and_returns_float32(tied):
  """Logits of bf16 params equal float64 NumPy over the same bf16 values to float32 accuracy:
  one matmul accumulating in float32, no rounding of the logits to bf16 (which at |logit| ~ 20
  errs by up to ~0.06)."""
  import jax
  import jax.numpy as jnp

  from jetflow_jax.config import Qwen3Config
  from jetflow_jax.model import init_params
  config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, tie_word_embeddings=tied)
  params = init_params(config, jax.random.key(0), jnp.bfloat16)
  hidden = (jax.random.normal(jax.random.key(1), (2, 3, 64)) * 20).astype(jnp.bfloat16)
  logits = lm_logits(params, config, hidden)
  assert logits.dtype == jnp.float32
  kernel = params["embed_tokens"]["embedding"].T if tied else params["lm_head"]["kernel"]
  want = np.asarray(hidden, np.float64) @ np.asarray(kernel, np.float64)
  assert np.abs(want).max() > 10  # large enough that bf16 logits would miss the bound below
  np.testing.assert_allclose(np.asarray(logits), want, atol=2e-4 * np.abs(want).max())
