"""Kernels stored out_in (`model.with_kernel_layout`): the same model, only faster on CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetflow_jax
from jetflow_jax import model, partitioning
from jetflow_jax.head import draft_logits, init_head_params
from jetflow_jax.head_config import HeadConfig

VOCAB = 96
PROMPTS = [[5, 17, 3, 88, 40], [9, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11], [60, 61, 62]]


def copy(tree):
  return jax.tree.map(jnp.copy, tree)  # `with_kernel_layout` consumes what it converts


def load_target(kind, tmp_path_factory):
  from conftest import make_hf_model
  directory = str(tmp_path_factory.mktemp(kind))
  make_hf_model(moe=kind == "moe", num_hidden_layers=3, vocab_size=VOCAB,
                tie_word_embeddings=kind == "tied").save_pretrained(directory)
  return jetflow_jax.load_qwen3(directory)


@pytest.fixture(scope="module", params=["tied", "untied", "moe"])
def target(request, tmp_path_factory):
  return load_target(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def tied_target(tmp_path_factory):
  return load_target("tied", tmp_path_factory)


def test_out_in_computes_what_in_out_does_and_converts_back_exactly(target):
  config, params = target
  out_in = model.with_kernel_layout(copy(params), "out_in")
  assert partitioning.kernel_layout(params) == "in_out"
  assert partitioning.kernel_layout(out_in) == "out_in"
  attention = out_in["layers_0"]["self_attn"]
  assert attention["q_proj"]["kernel"].shape == (config.num_attention_heads * config.head_dim,
                                                 config.hidden_size)
  assert attention["o_proj"]["kernel"].shape == (config.hidden_size,
                                                 config.num_attention_heads * config.head_dim)
  tokens = jnp.asarray([PROMPTS[1]], jnp.int32)
  want, want_taps = model.qwen3_forward(params, config, tokens, tap_layers=(0, 2))
  got, got_taps = model.qwen3_forward(out_in, config, tokens, tap_layers=(0, 2))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got_taps, want_taps, rtol=1e-5, atol=1e-5)
  back = model.with_kernel_layout(out_in, "in_out")
  jax.tree.map(np.testing.assert_array_equal, back, params)


def test_out_in_head_drafts_the_same_and_decoding_stays_lossless(tied_target):
  config, params = tied_target
  head = HeadConfig.for_target(config, num_layers=2, block_size=5, mask_token_id=VOCAB - 1,
                               target_layer_ids=(0, 1))
  head_params = init_head_params(head, jax.random.key(3))
  out_in, head_out_in = (model.with_kernel_layout(copy(p), "out_in")
                         for p in (params, head_params))
  assert partitioning.kernel_layout(head_out_in) == "out_in"
  tokens = jnp.asarray([PROMPTS[0]], jnp.int32)
  np.testing.assert_allclose(draft_logits(head_out_in, head, out_in, config, tokens),
                             draft_logits(head_params, head, params, config, tokens),
                             rtol=1e-5, atol=1e-5)
  ar = jetflow_jax.generate(params, config, PROMPTS, 16, stop_tokens=()).tokens
  result = jetflow_jax.speculative_generate(out_in, config, head_out_in, head, PROMPTS, 16,
                                            budget=12, top_k=3, stop_tokens=(),
                                            warn=lambda _: None)
  assert result.tokens == ar


def test_a_decode_mesh_refuses_out_in_params(tied_target):
  from jetflow_jax.errors import InputError
  from jetflow_jax.mesh import DecodeMesh
  config, params = tied_target
  out_in = model.with_kernel_layout(copy(params), "out_in")
  with pytest.raises(InputError, match="in_out"):
    DecodeMesh.create(tp=1).param_specs(config, out_in)


def test_decoding_on_cpu_prefers_out_in():
  assert model.decode_kernel_layout("cpu") == "out_in"
  assert model.decode_kernel_layout("gpu") == model.decode_kernel_layout("tpu") == "in_out"
