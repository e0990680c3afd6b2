"""`budget="auto"`: each round's tree budget chosen on a ladder, and decoding still lossless with
the budget changing between the rounds of one request: greedy equals AR token for token,
sampling follows the target's exact distribution."""

import jax
import numpy as np

import jetflow_jax
from jetflow_jax.decoding import TreeShape, decode_prompts
from jetflow_jax.drafters import HeadDrafter
from jetflow_jax.head import init_head_params
from jetflow_jax.sampling import Sampling
from test_speculative import (PROMPTS, SAMPLES, ar_greedy, assert_matches, exact_first_three,
                              head_config, small_target, target, trained_head)  # noqa: F401


def test_greedy_equals_ar_whatever_the_budgets(target, trained_head):
  config, params = target
  head, head_params = trained_head
  reference = ar_greedy(config, params, PROMPTS, 24)
  drafter = HeadDrafter(head)
  # AR rounds keep the head's context current: trees after them draft from it.
  for schedule in ((1, 16, 4, 1, 1, 8), (8, 1)):
    result = decode_prompts(params, config, drafter, head_params, PROMPTS, 24,
                            tree_shape=TreeShape("top_n", 16, 3), stop_tokens=(), auto=schedule)
    assert result.tokens == reference
    assert set(result.budgets) == set(schedule)
  chosen = jetflow_jax.speculative_generate(params, config, head_params, head, PROMPTS, 24,
                                            budget="auto", max_budget=16, top_k=3,
                                            stop_tokens=())
  assert chosen.tokens == reference
  assert len(chosen.budgets) == len(chosen.committed_per_round[0]) and chosen.calibrate_s > 0


def test_sampling_follows_the_target_when_budgets_change(small_target):
  config, params, model = small_target
  prompt, sampler = [3, 1, 4, 1], Sampling(1.0)
  head = head_config(config, block_size=4)
  result = decode_prompts(params, config, HeadDrafter(head), init_head_params(head,
                                                                              jax.random.key(5)),
                          [prompt] * SAMPLES, 3, tree_shape=TreeShape("top_n", 8, 3),
                          sampler=sampler, stop_tokens=(), auto=(4, 1))
  assert result.budgets[:2] == [4, 1]
  assert_matches(np.array(result.tokens), exact_first_three(model, np.array(prompt), sampler))
