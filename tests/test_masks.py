"""Head attention masks against brute-force constructions."""

import numpy as np
import pytest

from jetflow_jax.masks import training_mask


def brute_force_training_mask(anchors, num_context, block, causal):
  rows = len(anchors) * block
  mask = np.zeros((rows, num_context + rows), bool)
  for a_index, anchor in enumerate(anchors):
    for i in range(block):
      row = a_index * block + i
      for j in range(num_context):
        mask[row, j] = j < anchor  # context rows strictly before the anchor
      for b_index in range(len(anchors)):
        for k in range(block):
          if b_index == a_index and (k <= i or not causal):
            mask[row, num_context + b_index * block + k] = True
  return mask


@pytest.mark.parametrize("causal", [True, False])
def test_training_mask_equals_brute_force(causal):
  rng = np.random.default_rng(3)
  for _ in range(5):
    num_context, block = int(rng.integers(5, 40)), int(rng.integers(2, 7))
    anchors = rng.integers(0, num_context, size=(3, int(rng.integers(1, 6))))
    got = np.asarray(training_mask(anchors, num_context, block, causal))
    for b in range(anchors.shape[0]):
      np.testing.assert_array_equal(got[b], brute_force_training_mask(anchors[b], num_context,
                                                                      block, causal))
