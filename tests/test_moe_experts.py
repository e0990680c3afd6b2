"""The MoE's blocked grouped matmuls: the block layout by brute force, and equality with the
ragged path, through the model and the training loss's frozen target pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetflow_jax import model, moe
from jetflow_jax.config import Qwen3Config
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.train.step import LossConfig, make_loss_fn

MOE = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6,
                  num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)


def routings(rng, num_experts):
  yield rng.integers(0, num_experts, 23)  # spread out
  yield np.full(17, 3)  # every pair on one expert: its run spans many blocks
  yield rng.choice([0, num_experts - 1], 19)  # experts in between get nothing
  yield np.arange(num_experts)  # one pair each


@pytest.mark.parametrize("block", [1, 3, 4])
def test_expert_blocks_give_each_pair_its_own_row_in_a_block_of_its_expert(block):
  rng = np.random.default_rng(block)
  num_experts = 5
  for experts_p in routings(rng, num_experts):
    rows_p, block_experts = (np.asarray(a) for a in moe.expert_blocks(
        jnp.asarray(experts_p), num_experts, block))
    num_pairs = len(experts_p)
    # The worst case: every expert's run ends one pair into a fresh block.
    assert len(block_experts) == (num_pairs + num_experts * (block - 1)) // block
    assert len(set(rows_p.tolist())) == num_pairs
    assert rows_p.min() >= 0 and rows_p.max() < len(block_experts) * block
    np.testing.assert_array_equal(block_experts[rows_p // block], experts_p)
    # Fewest blocks: each expert uses exactly ceil(pairs / block) blocks.
    used = np.bincount(block_experts[np.unique(rows_p // block)], minlength=num_experts)
    np.testing.assert_array_equal(used, -(-np.bincount(experts_p, minlength=num_experts) // block))


@pytest.mark.parametrize("block", [3, 64])
def test_blocked_experts_equal_ragged(block, monkeypatch):
  monkeypatch.setattr(moe, "EXPERT_BLOCK", block)  # 3: expert runs span several blocks
  params = model.init_params(MOE, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (3, 13), 0, MOE.vocab_size)
  ragged, _, _ = model.forward(params, MOE, tokens)
  blocked, _, _ = model.forward(params, MOE, tokens, experts="blocked")
  assert float(jnp.abs(ragged).max()) > 1.0  # not a comparison between near-zeros
  np.testing.assert_allclose(np.asarray(blocked), np.asarray(ragged), atol=1e-5, rtol=0)


def test_unknown_experts_implementation_is_named():
  params = model.init_params(MOE, jax.random.key(0))
  with pytest.raises(ValueError, match="'dense'"):
    model.forward(params, MOE, jnp.zeros((1, 4), jnp.int32), experts="dense")


def test_training_target_pass_is_the_same_with_either_experts_implementation():
  params = model.init_params(MOE, jax.random.key(0))
  head = HeadConfig.for_target(MOE, num_layers=1, block_size=4, mask_token_id=MOE.vocab_size - 1,
                               target_layer_ids=(0, 1))
  tokens = jax.random.randint(jax.random.key(2), (2, 24), 0, MOE.vocab_size - 1)
  mask = jnp.ones(tokens.shape, bool)
  passes = [make_loss_fn(head, MOE, LossConfig(num_anchors=4, target_experts=impl)).prepare(
      params, tokens, mask, jax.random.key(3))[0] for impl in ("ragged", "blocked")]
  for ragged, blocked in zip(passes[0][:2], passes[1][:2]):
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(ragged), atol=1e-5, rtol=0)
