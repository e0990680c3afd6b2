"""Token samplers: small frozen dataclasses, hashable so they are static under jit."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jetflow_jax.errors import InputError


@dataclasses.dataclass(frozen=True)
class Greedy:
  """Always the most likely token."""

  def __call__(self, rng: jax.Array, logits_bv: jax.Array) -> jax.Array:
    del rng
    return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Sampling:
  """Draws from softmax(logits / temperature) restricted to the top-k, then the top-p nucleus.

  `top_k=0` and `top_p=1.0` switch the respective filter off.
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if not self.temperature > 0:
      raise InputError(f"temperature must be > 0 for sampling (got {self.temperature}); "
                       "use Greedy for temperature 0")
    if self.top_k < 0:
      raise InputError(f"top_k must be >= 0 (got {self.top_k})")
    if not 0.0 < self.top_p <= 1.0:
      raise InputError(f"top_p must be in (0, 1] (got {self.top_p})")

  def processed_logits(self, logits_bv: jax.Array) -> jax.Array:
    """float32 logits of the distribution actually sampled from; -inf outside the filters."""
    logits = logits_bv.astype(jnp.float32) / self.temperature
    if self.top_k:
      kth_largest = jax.lax.top_k(logits, min(self.top_k, logits.shape[-1]))[0][..., -1:]
      logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
    if self.top_p < 1.0:
      descending = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)
      probs = jax.nn.softmax(descending, axis=-1)
      mass_before = jnp.cumsum(probs, axis=-1) - probs
      # The nucleus is the shortest prefix whose mass reaches top_p; the top token always stays.
      smallest_kept = jnp.min(jnp.where(mass_before < self.top_p, descending, jnp.inf), axis=-1,
                              keepdims=True)
      logits = jnp.where(logits < smallest_kept, -jnp.inf, logits)
    return logits

  def __call__(self, rng: jax.Array, logits_bv: jax.Array) -> jax.Array:
    return jax.random.categorical(rng, self.processed_logits(logits_bv), axis=-1).astype(jnp.int32)


Sampler = Greedy | Sampling


def make_sampler(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> Sampler:
  """Greedy for temperature 0, else `Sampling`; bad values raise InputError."""
  if temperature < 0:
    raise InputError(f"temperature must be >= 0 (got {temperature})")
  if temperature == 0:
    return Greedy()
  return Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
