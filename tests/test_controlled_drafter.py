"""The controlled drafter: greedy decoding with it equals AR, each round commits exactly the drawn
depth plus the bonus, the measured tau meets the requested one; the e2e bench's tiny preset."""

import dataclasses
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT
from jetflow_jax.controlled_drafter import (ControlledDrafter, controlled_params,
                                            depth_distribution_for_tau, expected_tau,
                                            tau_variance)
from jetflow_jax.decoding import TreeShape, decode_prompts
from jetflow_jax.decoding.auto import drafter_fingerprint, head_record_key
from jetflow_jax.decoding.budget import draft_expected_tau
from jetflow_jax.decoding.round import RoundSpec
from jetflow_jax.errors import InputError
from test_speculative import PROMPTS, ar_greedy, target  # noqa: F401 (fixture)

DEPTH = 8
NEW_TOKENS = 160


@pytest.mark.parametrize("kind", ["geometric", "two_point"])
@pytest.mark.parametrize("tau", [1.0, 2.0, 4.5, 6.0, DEPTH + 1.0])
def test_distribution_for_tau_has_that_mean(kind, tau):
  distribution = depth_distribution_for_tau(tau, DEPTH, kind)
  assert len(distribution) == DEPTH + 1 and min(distribution) >= 0
  assert math.isclose(sum(distribution), 1.0, abs_tol=1e-12)
  assert math.isclose(expected_tau(distribution), tau, abs_tol=1e-9)
  if kind == "two_point":
    assert tau_variance(distribution) <= 0.25 + 1e-12


def test_bad_taus_and_distributions_raise():
  for tau in (0.5, DEPTH + 1.5):
    with pytest.raises(InputError, match="tau must lie"):
      depth_distribution_for_tau(tau, DEPTH)
  with pytest.raises(InputError, match="kind"):
    depth_distribution_for_tau(2.0, DEPTH, "uniform")
  with pytest.raises(InputError, match="summing to 1"):
    expected_tau([0.5, 0.6])
  params = controlled_params([[1, 2, 3]], depth_distribution_for_tau(2.0, DEPTH - 1))
  with pytest.raises(InputError, match="0..8 correct tokens"):
    ControlledDrafter(depth=DEPTH).correct_depths(params, jnp.zeros((1,), jnp.int32))


def test_draft_copies_the_reference_up_to_the_drawn_depth(target):
  config, _ = target
  vocab = config.vocab_size
  reference_bs = np.random.default_rng(0).integers(0, vocab, (4, 40)).astype(np.int32)
  params = controlled_params(reference_bs, depth_distribution_for_tau(4.0, DEPTH), seed=3)
  drafter = ControlledDrafter(depth=DEPTH)
  context_len_b = jnp.array([0, 5, 17, 30], jnp.int32)
  logprobs_bdv = np.asarray(drafter.draft(params, None, config, None, None, context_len_b))
  k_b = np.asarray(drafter.correct_depths(params, context_len_b))
  assert logprobs_bdv.shape == (4, DEPTH, vocab)
  for b, (context_len, k) in enumerate(zip(context_len_b.tolist(), k_b)):
    for d in range(DEPTH):
      want = reference_bs[b, min(context_len + 1 + d, 39)]
      ranked = np.argsort(-logprobs_bdv[b, d], kind="stable")
      assert logprobs_bdv[b, d, ranked[0]] > -1e-6  # the top-1 is near-certain
      if d < k:
        assert ranked[0] == want
      else:  # the reference is last: outside any top-k below the vocabulary
        assert ranked[0] != want and ranked[-1] == want
  # Calibrated: the same ranks, the top-1 as sure as its depth's chance of acceptance, so
  # that the chain's expected tokens are tau (a budget of depth + 1 holds just the chain).
  calibrated = ControlledDrafter(depth=DEPTH, calibrated=True)
  sure_bdv = np.asarray(calibrated.draft(params, None, config, None, None, context_len_b))
  np.testing.assert_array_equal(np.argmax(sure_bdv, -1), np.argmax(logprobs_bdv, -1))
  np.testing.assert_array_equal(np.argmin(sure_bdv, -1), np.argmin(logprobs_bdv, -1))
  at_least_k = np.cumsum(np.asarray(params.depth_probs_k, np.float64)[::-1])[::-1]
  np.testing.assert_allclose(np.exp(sure_bdv.max(-1)), np.broadcast_to(
      at_least_k[1:] / at_least_k[:-1], (4, DEPTH)), rtol=1e-4)
  np.testing.assert_allclose(draft_expected_tau(sure_bdv, (1, DEPTH + 1), 3), [[1.0, 4.0]] * 4,
                             rtol=1e-4)
  # What it expects of itself, greedy: a round of n nodes commits 1 + E[min(k, n - 1)] (by
  # brute force over k); its drafts predict that when calibrated, else the whole chain.
  ladder = (1, 4, DEPTH + 1)
  probs_k = np.asarray(params.depth_probs_k, np.float64)
  brute_l = [1 + sum(p * min(k, n - 1) for k, p in enumerate(probs_k)) for n in ladder]
  for who, draft_bdv in ((drafter, logprobs_bdv), (calibrated, sure_bdv)):
    prior = who.acceptance_prior(params, ladder)
    np.testing.assert_allclose(prior.tau_l, brute_l, rtol=1e-5)
    np.testing.assert_allclose(prior.predicted_l, draft_expected_tau(draft_bdv, ladder, 3)[0],
                               rtol=1e-3)
  # The draws depend on the seed, the row and its context length only.
  again = drafter.correct_depths(params, jnp.array([0, 5, 99, 30], jnp.int32))
  np.testing.assert_array_equal(np.asarray(again)[[0, 1, 3]], k_b[[0, 1, 3]])
  many = jnp.arange(256, dtype=jnp.int32)
  other_seed = dataclasses.replace(params, seed=jnp.int32(4))
  assert np.any(np.asarray(drafter.correct_depths(other_seed, many))
                != np.asarray(drafter.correct_depths(params, many)))
  # A seed is another request of the same drafter: auto keeps one record for all of them.
  assert drafter_fingerprint(other_seed) == drafter_fingerprint(params) != drafter_fingerprint(
      controlled_params(reference_bs, depth_distribution_for_tau(5.0, DEPTH), seed=3))
  # A calibrated drafter's drafts predict otherwise than a certain one's: records of their own.
  record_key = lambda d: head_record_key(RoundSpec(config, d, TreeShape("top_n", 16, 3)), params)
  assert record_key(calibrated) != record_key(drafter) == record_key(ControlledDrafter(DEPTH))


def test_greedy_equals_ar_and_commits_the_drawn_depths(target):
  """One compiled round serves every tau (the distribution is a traced param). Each round
  commits exactly k + 1 tokens (k drawn for the row at its context length) unless the token
  limit cuts it short; over the full rounds, the mean is within 4 standard errors of tau."""
  config, params = target
  reference = ar_greedy(config, params, PROMPTS, NEW_TOKENS)
  drafter = ControlledDrafter(depth=DEPTH)
  shape = TreeShape("top_n", 16, 3)  # 16 nodes hold the depth-8 top-1 chain
  context_sb = jnp.arange(max(map(len, PROMPTS)) + NEW_TOKENS)[:, None] + jnp.zeros(
      (1, len(PROMPTS)), jnp.int32)
  draws = jax.jit(lambda p: jax.vmap(lambda c: drafter.correct_depths(p, c))(context_sb))
  for kind, tau in [("geometric", 2.0), ("geometric", 4.0), ("geometric", 6.0),
                    ("two_point", 4.5)]:
    distribution = depth_distribution_for_tau(tau, DEPTH, kind)
    drafter_params = controlled_params([p + r for p, r in zip(PROMPTS, reference)],
                                       distribution, seed=1)
    result = decode_prompts(params, config, drafter, drafter_params, PROMPTS, NEW_TOKENS,
                            tree_shape=shape, stop_tokens=())
    assert result.tokens == reference, (kind, tau)
    k_sb = np.asarray(draws(drafter_params))
    full_rounds = []
    for b, (prompt, rounds) in enumerate(zip(PROMPTS, result.committed_per_round)):
      context_len, end = len(prompt), len(prompt) + NEW_TOKENS
      for count in rounds:
        assert count == min(k_sb[context_len, b] + 1, end - context_len - 1), (kind, tau, b)
        context_len += count
      assert context_len == end - 1  # the first new token came from the prefill
      full_rounds += rounds[:-1]
    stderr = math.sqrt(tau_variance(distribution) / len(full_rounds))
    assert abs(np.mean(full_rounds) - tau) <= 4 * stderr + 1e-9, (kind, tau, len(full_rounds))


def test_e2e_bench_tiny_preset_writes_every_row(tmp_path):
  sys.path.insert(0, os.path.join(ROOT, "bench"))
  try:
    import gpu_e2e
  finally:
    sys.path.remove(os.path.join(ROOT, "bench"))
  out = tmp_path / "e2e.json"
  gpu_e2e.main(["--preset", "tiny", "--new-tokens", "12", "--prompt-len", "8", "--batches", "2",
                "--taus", "2,3", "--budgets", "8", "--depth", "4", "--top-k", "3", "--auto",
                "--compile-workers", "2", "--out", str(out)])
  record = json.loads(out.read_text())
  assert record["preset"] == "tiny" and record["new_tokens"] == 12
  assert record["compiles_after_precompile"] == 0  # the bench compiled what decode_prompts runs
  runs = {(r["batch"], r["method"], r["budget"], r["tau"]): r for r in record["rows"]}
  assert set(runs) == {(2, "ar", 1, 1.0), (2, "jetflow", 8, 2.0), (2, "jetflow", 8, 3.0),
                       (2, "jetflow", "auto", 2.0), (2, "jetflow", "auto", 3.0)}
  assert all(sum(r["rounds_by_budget"].values()) > 0 for r in record["rows"]
             if r["budget"] == "auto")
  for key, r in runs.items():
    assert r["tokens_per_s"] > 0 and r["num_tokens"] == 12 * key[0], key
    assert r["matches_ar"], key  # float32 on CPU: the same tokens as AR
  # A two-point distribution at an integer tau commits exactly tau every full round.
  assert all(r["full_round_tau"] == r["tau"] for r in record["rows"] if r["budget"] == 8)
