"""Head attention masks against brute-force constructions."""

import numpy as np
import pytest

from jetflow_jax.masks import packed_causal_mask, segment_starts, training_mask


def brute_force_training_mask(anchors, num_context, block, causal, starts=None):
  rows = len(anchors) * block
  mask = np.zeros((rows, num_context + rows), bool)
  starts = np.zeros(len(anchors), int) if starts is None else starts
  for a_index, anchor in enumerate(anchors):
    for i in range(block):
      row = a_index * block + i
      for j in range(num_context):
        # Context rows strictly before the anchor, from its sample's start.
        mask[row, j] = starts[a_index] <= j < anchor
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


@pytest.mark.parametrize("causal", [True, False])
def test_training_mask_with_sample_starts_equals_brute_force(causal):
  rng = np.random.default_rng(4)
  anchors = rng.integers(0, 30, size=(2, 5))
  starts = rng.integers(0, anchors + 1)
  got = np.asarray(training_mask(anchors, 30, 3, causal, starts))
  for b in range(2):
    np.testing.assert_array_equal(got[b], brute_force_training_mask(anchors[b], 30, 3, causal,
                                                                    starts[b]))
  assert not np.array_equal(got, np.asarray(training_mask(anchors, 30, 3, causal)))


def test_segment_starts_and_packed_causal_mask_equal_brute_force():
  segment_ids = np.array([[1, 1, 1, 2, 2, 3, 0, 0], [1] * 8, [1, 2, 2, 2, 3, 3, 3, 0]])
  starts = np.asarray(segment_starts(segment_ids))
  mask = np.asarray(packed_causal_mask(starts))
  for b, row in enumerate(segment_ids):
    for t in range(len(row)):
      assert starts[b, t] == min(s for s in range(t + 1) if (row[s:t + 1] == row[t]).all())
      for s in range(len(row)):
        assert mask[b, t, s] == (s <= t and (row[s:t + 1] == row[t]).all())
