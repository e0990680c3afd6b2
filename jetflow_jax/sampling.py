"""Token samplers: small frozen dataclasses, hashable so they are static under jit; and
`RowSampling`, the same settings as per-row arrays (an engine's slots, each its own request)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.struct
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

  Attributes:
    temperature: > 0 (`Greedy` is temperature 0).
    top_k: keep the k likeliest tokens; 0: all.
    top_p: keep the shortest prefix of the sorted distribution whose mass reaches p; 1.0: all.

  Raises:
    InputError: a temperature <= 0, a negative top-k, or a top-p outside (0, 1].
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
  """Greedy for temperature 0, else `Sampling`.

  Raises:
    InputError: a negative temperature, or settings `Sampling` refuses.
  """
  if temperature < 0:
    raise InputError(f"temperature must be >= 0 (got {temperature})")
  if temperature == 0:
    return Greedy()
  return Sampling(temperature=temperature, top_k=top_k, top_p=top_p)


def sampling_flags(samplers: Sequence[Sampler]) -> dict[str, bool]:
  """The static promises `RowSampling.__call__` takes for rows drawn by `samplers`: does any
  sample (`sampled`), does any filter by top-k or top-p (`filtered`)?"""
  sampled = [s for s in samplers if isinstance(s, Sampling)]
  return dict(sampled=bool(sampled), filtered=any(s.top_k > 0 or s.top_p < 1.0 for s in sampled))


@flax.struct.dataclass
class RowSampling:
  """One sampler per row, its settings arrays (a pytree, not static): temperature 0 is greedy,
  `top_k` 0 and `top_p` 1.0 switch the filters off, as in `Sampling`.

  A sampled row draws from exactly `Sampling(t, k, p).processed_logits`; a greedy row takes the
  argmax. Each row draws with its own key, so its tokens depend on nothing else in the batch.

  Attributes:
    temperature_b: float32 `[B]`; 0 for a greedy row.
    top_k_b: int32 `[B]`; 0: no top-k filter.
    top_p_b: float32 `[B]`; 1.0: no top-p filter.
  """

  temperature_b: jax.Array  # float32
  top_k_b: jax.Array  # int32
  top_p_b: jax.Array  # float32

  @classmethod
  def of(cls, samplers: Sequence[Sampler]) -> "RowSampling":
    """The rows of `Greedy()` / `Sampling(...)` objects, in order."""
    settings = [(s.temperature, s.top_k, s.top_p) if isinstance(s, Sampling) else (0.0, 0, 1.0)
                for s in samplers]
    temperature, top_k, top_p = zip(*settings)
    return cls(temperature_b=jnp.asarray(temperature, jnp.float32),
               top_k_b=jnp.asarray(top_k, jnp.int32), top_p_b=jnp.asarray(top_p, jnp.float32))

  def _rows(self, x_b, ndim: int):
    """A per-row setting shaped to broadcast against `[B, ..., V]` of `ndim` axes."""
    return x_b.reshape(x_b.shape + (1,) * (ndim - 1))

  def processed_logits(self, logits_bxv: jax.Array, filtered: bool = True) -> jax.Array:
    """float32 logits each sampled row draws from (greedy rows: temperature 1, no filters).

    `filtered=False` (static) promises no row has a top-k or top-p filter: no sort is made.
    """
    ndim = logits_bxv.ndim
    temperature = self._rows(jnp.where(self.temperature_b > 0, self.temperature_b, 1.0), ndim)
    logits = logits_bxv.astype(jnp.float32) / temperature
    if not filtered:
      return logits
    return _filtered(logits, self._rows(self.top_k_b, ndim), self._rows(self.top_p_b, ndim))

  def __call__(self, keys_b: jax.Array, logits_bxv: jax.Array, *, sampled: bool = True,
               filtered: bool = True) -> jax.Array:
    """Token ids `[B, ...]`: row b draws from its logits with `keys_b[b]` (one key per row).

    `sampled=False` / `filtered=False` (static) promise that no row samples / filters, which
    skips that work (a branch chosen on the host, not a device conditional: on a GPU those
    wait for the device).
    """
    greedy = jnp.argmax(logits_bxv, axis=-1).astype(jnp.int32)
    if not sampled:
      return greedy
    processed = self.processed_logits(logits_bxv, filtered)
    draws = jax.vmap(lambda key, x: jax.random.categorical(key, x, axis=-1))(keys_b, processed)
    return jnp.where(self._rows(self.temperature_b > 0, greedy.ndim), draws.astype(jnp.int32),
                     greedy)


def _filtered(logits, top_k, top_p):
  """`Sampling`'s top-k then top-p filters with per-row k and p (k 0, p 1.0: off)."""
  vocab = logits.shape[-1]
  descending = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)
  kth_largest = jnp.take_along_axis(descending, jnp.clip(top_k, 1, vocab) - 1, axis=-1)
  # Past the k-th largest, the sorted row of the filtered logits is the sorted row masked.
  logits = jnp.where((top_k > 0) & (logits < kth_largest), -jnp.inf, logits)
  descending = jnp.where((top_k > 0) & (descending < kth_largest), -jnp.inf, descending)
  probs = jax.nn.softmax(descending, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  smallest_kept = jnp.min(jnp.where(mass_before < top_p, descending, jnp.inf), axis=-1,
                          keepdims=True)
  return jnp.where((top_p < 1.0) & (logits < smallest_kept), -jnp.inf, logits)
