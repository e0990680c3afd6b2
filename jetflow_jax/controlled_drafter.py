"""A drafter of known acceptance: it copies a reference continuation for a drawn number of
depths, then proposes a token the target is known to refuse.

For benchmarks where no trained head exists (random target weights): given the target's own
greedy continuation of every row, computed beforehand by plain decoding, a round drafts the
reference tokens at depths 1..k and, from depth k + 1 on, a wrong token as the top-1 with the
reference token pushed to the bottom of the vocabulary (out of any top-k). A greedy verify then
accepts exactly k tokens plus the bonus, whatever the tree, as long as the tree holds the
top-1 chain down to depth k (a budget of at least depth + 1 nodes does). k is drawn per row
and round from a distribution over 0..depth, with a key made of the params' seed, the row index
and its context length: deterministic, no state, no taps, nothing sent to the host.

How sure the drafter says it is: certain of every top-1 token by default (log-prob ~0), the
hardest case for a chooser that calibrates what drafts predict against what rounds accept;
or, `calibrated`, as sure as the distribution warrants, as a well-trained head is on average:
the top-1 at depth d gets the chance that depth is accepted once the one above was, so what a
draft predicts (`decoding.budget.expected_tau`) is tau. (Its other tokens share the rest: with
a vocabulary of a few hundred, they can outrank the deepest nodes of the chain when those are
unlikely, so a tree of depth + 1 nodes may stop the chain short of a rare long k.)

The distribution and the seed are traced params (`ControlledParams`), not static fields: one
compiled round serves every requested tau and every draw sequence (a seed stands for another
request of the same difficulty), which matters when each compile of an 8B round costs tens of
seconds of a GPU lease.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jetflow_jax.decoding.budget import AcceptancePrior
from jetflow_jax.distributed import to_host
from jetflow_jax.errors import InputError


@flax.struct.dataclass
class ControlledParams:
  """The drafter's params: what it copies and how far."""

  reference_bs: jax.Array  # int32: each row's prompt, then the target's greedy continuation
  depth_probs_k: jax.Array  # float32 [depth + 1]: P(k correct tokens a round), k = 0..depth
  seed: jax.Array  # int32 []: the key the draws derive from


def controlled_params(reference: Sequence[Sequence[int]] | np.ndarray,
                      distribution: Sequence[float], seed: int = 0) -> ControlledParams:
  """Params from per-row token lists (prompt + continuation; ragged rows are zero-padded).

  Args:
    reference: per row, the prompt then the target's greedy continuation.
    distribution: P(k correct tokens a round) for k = 0..depth (`depth_distribution_for_tau`
      gives one for a tau).
    seed: which draws: two seeds are two requests of the same acceptance.

  Returns:
    The `ControlledParams`.

  Raises:
    InputError: a distribution that is not one.
  """
  if isinstance(reference, np.ndarray):
    reference_bs = reference.astype(np.int32)
  else:
    width = max(len(row) for row in reference)
    reference_bs = np.zeros((len(reference), width), np.int32)
    for b, row in enumerate(reference):
      reference_bs[b, :len(row)] = row
  return ControlledParams(reference_bs=jnp.asarray(reference_bs),
                          depth_probs_k=jnp.asarray(check_distribution(distribution),
                                                    jnp.float32),
                          seed=jnp.asarray(seed, jnp.int32))


@dataclasses.dataclass(frozen=True)
class ControlledDrafter:
  """Copies `ControlledParams.reference_bs` for a drawn number of depths per row and round.

  A `Drafter` of known acceptance for benchmarks without a trained head (the module docstring
  says how); its params come from `controlled_params`.

  Attributes:
    depth: D, the depths it drafts.
    confidence: logit margin of the top-1 token: log-prob ~0, others ~-confidence (and how
      far below the rest the reference token is pushed where it is refused).
    calibrated: the top-1's probability is the chance of its depth being accepted given the
      one above was (`depth_chances`), not ~1.
    tap_layers: none: it reads no taps.
  """

  depth: int
  confidence: float = 30.0
  calibrated: bool = False
  tap_layers: tuple[int, ...] = ()

  def init_state(self, params, target_params, taps_btld, cache_size: int):
    return None

  def correct_depths(self, params: ControlledParams, context_len_b) -> jax.Array:
    """`[B]` int32: how many leading depths this round drafts right, for each row."""
    if params.depth_probs_k.shape != (self.depth + 1,):
      raise InputError(f"a depth-{self.depth} drafter needs a distribution over 0..{self.depth} "
                       f"correct tokens (got {params.depth_probs_k.shape[0]} probabilities)")
    rows_b = jnp.arange(context_len_b.shape[0])
    base = jax.random.key(params.seed)
    keys_b = jax.vmap(lambda b, n: jax.random.fold_in(jax.random.fold_in(base, b), n))(
        rows_b, context_len_b)
    log_probs_k = jnp.log(params.depth_probs_k)
    return jax.vmap(lambda key: jax.random.categorical(key, log_probs_k))(keys_b).astype(
        jnp.int32)

  def draft(self, params: ControlledParams, target_params, target_config, state, anchor_b,
            context_len_b):
    vocab = target_config.vocab_size
    reference_bs = params.reference_bs
    depth_d = jnp.arange(self.depth)
    # The token at depth d + 1 sits at position context_len + 1 + d (the anchor at context_len).
    index_bd = jnp.minimum(context_len_b[:, None] + 1 + depth_d[None, :],
                           reference_bs.shape[1] - 1)
    reference_bd = jnp.take_along_axis(reference_bs, index_bd, axis=1)
    right_bd = depth_d[None, :] < self.correct_depths(params, context_len_b)[:, None]
    top_bdv = jax.nn.one_hot(jnp.where(right_bd, reference_bd, (reference_bd + 1) % vocab),
                             vocab, dtype=jnp.float32)
    refused_bdv = jnp.where(right_bd, 0.0, 1.0)[..., None] * jax.nn.one_hot(
        reference_bd, vocab, dtype=jnp.float32)
    if self.calibrated:
      chance_d = jnp.clip(self.depth_chances(params), 1e-6, 1.0 - 1e-6)
      # The rest share what the top-1 leaves, the refused reference apart.
      rest_logp_bd = jnp.log1p(-chance_d) - jnp.log(jnp.where(right_bd, vocab - 1.0,
                                                              vocab - 2.0))
      logits_bdv = (rest_logp_bd[..., None]
                    + top_bdv * (jnp.log(chance_d) - rest_logp_bd)[..., None]
                    - self.confidence * refused_bdv)
    else:
      logits_bdv = self.confidence * (top_bdv - refused_bdv)
    return jax.nn.log_softmax(logits_bdv, axis=-1)

  def depth_chances(self, params: ControlledParams) -> jax.Array:
    """`[depth]`: P(depth d accepted | depth d - 1 was), d = 1..depth (0 past the support)."""
    at_least_k = jnp.cumsum(params.depth_probs_k[::-1])[::-1]  # P(k >= j), j = 0..depth
    return jnp.where(at_least_k[:-1] > 0, at_least_k[1:] / jnp.maximum(at_least_k[:-1], 1e-30),
                     0.0)

  def acceptance_prior(self, params: ControlledParams, ladder: Sequence[int]):
    """What it commits and predicts at each ladder budget, greedy, from its distribution: a
    tree of n nodes holds the top-1 chain down to depth n - 1, so a round commits
    1 + E[min(k, n - 1)]; its drafts predict that too when `calibrated`, else (sure of every
    top-1) 1 + min(n - 1, depth)."""
    probs_k = check_distribution(to_host(params.depth_probs_k))
    at_least_d = np.cumsum(probs_k[::-1])[::-1][1:]  # P(k >= d), d = 1..depth
    chain_l = np.minimum(np.asarray(ladder) - 1, self.depth)
    tau_l = 1.0 + np.concatenate([[0.0], np.cumsum(at_least_d)])[chain_l]
    return AcceptancePrior(tau_l=tau_l, predicted_l=tau_l if self.calibrated else 1.0 + chain_l)

  def commit(self, params, state, taps_btld, start_b):
    return state


def check_distribution(distribution: Sequence[float]) -> np.ndarray:
  """The distribution as float64, or InputError unless it is one over 0..depth."""
  probs = np.asarray(distribution, np.float64)
  if probs.ndim != 1 or probs.size < 1 or np.any(probs < 0) or not math.isclose(
      probs.sum(), 1.0, abs_tol=1e-6):
    raise InputError(f"a depth distribution needs non-negative probabilities of 0..depth correct "
                     f"tokens summing to 1 (got {list(distribution)})")
  return probs / probs.sum()


def expected_tau(distribution: Sequence[float]) -> float:
  """Expected tokens committed per round, bonus included: E[k] + 1."""
  probs = check_distribution(distribution)
  return float(np.dot(probs, np.arange(probs.size)) + 1.0)


def tau_variance(distribution: Sequence[float]) -> float:
  """Variance of the tokens one round commits (that of k)."""
  probs = check_distribution(distribution)
  k = np.arange(probs.size)
  return float(np.dot(probs, k**2) - np.dot(probs, k) ** 2)


def _truncated_geometric(rate: float, depth: int) -> np.ndarray:
  """P(k) when each depth is accepted with probability `rate` until the first miss."""
  probs = rate ** np.arange(depth + 1) * (1.0 - rate)
  probs[depth] = rate**depth
  return probs


def depth_distribution_for_tau(tau: float, depth: int,
                               kind: Literal["geometric", "two_point"] = "geometric"
                               ) -> tuple[float, ...]:
  """A distribution over 0..depth correct tokens with `expected_tau` equal to `tau`.

  `geometric` (truncated): every depth is accepted with the same rate until the first miss,
  the shape a draft of constant per-depth quality gives; the rate is found by bisection (the
  expectation grows with it, from 1 at rate 0 to depth + 1 at rate 1). Its spread is wide
  (standard deviation ~3-5 tokens at tau 4-10, depth 15). `two_point`: k is floor(tau - 1) or
  the next integer (standard deviation at most 0.5), for a measured tau close to the one asked.
  """
  if depth < 0 or not 1.0 <= tau <= depth + 1:
    raise InputError(f"tau must lie in [1, depth + 1] = [1, {depth + 1}] (got {tau})")
  if kind == "two_point":
    low_k = min(int(math.floor(tau - 1)), depth)
    upper = tau - 1 - low_k
    probs = np.zeros(depth + 1)
    probs[low_k] = 1.0 - upper
    if upper > 0:
      probs[low_k + 1] = upper
    return tuple(float(p) for p in probs)
  if kind != "geometric":
    raise InputError(f"unknown depth distribution kind {kind!r} (geometric or two_point)")
  low, high = 0.0, 1.0
  for _ in range(200):
    mid = (low + high) / 2
    if expected_tau(_truncated_geometric(mid, depth)) < tau:
      low = mid
    else:
      high = mid
  return tuple(float(p) for p in _truncated_geometric((low + high) / 2, depth))
