"""Projection kernels stored "out_in" (HF's order, faster few-row matmuls on CPU) compute what
"in_out" ones (Flax's, as params load) do: forward, taps and logits of dense, tied and MoE
targets; a tree converts both ways exactly, and a decode mesh refuses out_in. (Drafting and
whole speculative decodes: test_speculative.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetflow_jax.config import Qwen3Config
from jetflow_jax.errors import InputError
from jetflow_jax.mesh import DecodeMesh
from jetflow_jax.model import forward, init_params, kernel_layout, lm_logits, with_kernel_layout

CONFIG = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def copied(tree):
  return jax.tree.map(jnp.copy, tree)


@pytest.mark.parametrize("tied,moe", [(False, False), (True, False), (False, True)])
def test_out_in_computes_what_in_out_does(tied, moe):
  config = dataclasses.replace(CONFIG, tie_word_embeddings=tied,
                               **(dict(num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=16, mlp_only_layers=(1,))
                                  if moe else {}))
  params = init_params(config, jax.random.key(0))
  out_in = with_kernel_layout(copied(params), "out_in")
  assert kernel_layout(params) == "in_out" and kernel_layout(out_in) == "out_in"
  assert out_in["layers_0"]["self_attn"]["q_proj"]["kernel"].shape == (4, 16, 64)
  assert out_in["layers_0"]["self_attn"]["o_proj"]["kernel"].shape == (64, 4, 16)
  tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 128)
  run = jax.jit(lambda p: (lambda h, _, t: (lm_logits(p, config, h), t))(
      *forward(p, config, tokens, tap_layers=(0, 2))))
  (want_logits, want_taps), (got_logits, got_taps) = run(params), run(out_in)
  np.testing.assert_allclose(got_logits, want_logits, atol=1e-5, rtol=0)
  np.testing.assert_allclose(got_taps, want_taps, atol=1e-5, rtol=0)
  back = with_kernel_layout(out_in, "in_out")
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)))
  with pytest.raises(InputError, match="stored in_out"):
    DecodeMesh.create(data=1).param_specs(config, with_kernel_layout(back, "out_in"))
