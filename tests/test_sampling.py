"""Sampler filters against a NumPy reference, and the sampled distribution against softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetflow_jax.errors import InputError
from jetflow_jax.sampling import Greedy, Sampling, make_sampler


def reference_processed(logits, temperature, top_k, top_p):
  """Direct float64 NumPy transcription of temperature -> top-k -> top-p."""
  out = logits.astype(np.float64) / temperature
  for row in out:
    if top_k:
      order = np.argsort(-row)
      row[order[top_k:]] = -np.inf
    if top_p < 1.0:
      order = np.argsort(-row)
      probs = np.exp(row[order] - row[order[0]])
      probs /= probs.sum()
      mass = 0.0
      for rank, index in enumerate(order):
        if mass >= top_p and rank > 0:
          row[index] = -np.inf
        mass += probs[rank]
  return out


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 5, 1.0), (1.0, 0, 0.8), (1.3, 12, 0.5), (0.5, 1, 1.0), (1.0, 0, 0.01),
    (2.0, 40, 0.95)])
def test_filters_match_numpy_reference(temperature, top_k, top_p):
  logits = np.random.default_rng(1).normal(size=(6, 40)).astype(np.float32) * 3
  got = np.asarray(Sampling(temperature, top_k, top_p).processed_logits(jnp.asarray(logits)))
  want = reference_processed(logits, temperature, top_k, top_p)
  np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
  kept = ~np.isinf(want)
  np.testing.assert_allclose(got[kept], want[kept], rtol=1e-6)


def test_sample_frequencies_match_processed_softmax():
  logits = jnp.asarray([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
  sampler = Sampling(temperature=0.8, top_k=4, top_p=0.9)
  keys = jax.random.split(jax.random.key(0), 40000)
  draws = np.asarray(jax.vmap(lambda k: sampler(k, logits)[0])(keys))
  expected = np.asarray(jax.nn.softmax(sampler.processed_logits(logits)[0]))
  observed = np.bincount(draws, minlength=6) / len(draws)
  assert observed[expected == 0].sum() == 0
  # 40k draws: standard error <= 0.0025 per bin; 0.01 is four of them.
  np.testing.assert_allclose(observed, expected, atol=0.01)


def test_greedy_is_argmax():
  logits = jnp.asarray([[0.1, 3.0, -1.0], [5.0, 4.0, 4.9]])
  assert Greedy()(jax.random.key(0), logits).tolist() == [1, 0]


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=-1.0), "temperature"), (dict(temperature=1.0, top_p=0.0), "top_p"),
    (dict(temperature=1.0, top_p=1.5), "top_p"), (dict(temperature=1.0, top_k=-2), "top_k")])
def test_bad_sampler_values_are_named(kwargs, message):
  with pytest.raises(InputError, match=message):
    make_sampler(**kwargs)
