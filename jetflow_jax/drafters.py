"""Drafters: what proposes per-depth token distributions for each speculative round.

A drafter is a small frozen (hashable, static under jit) object with four members:

- `depth`: D, the number of depths it drafts per round;
- `tap_layers`: target layers whose raw hidden states it wants for committed tokens;
- `init_state(params, target_params, taps_btld, cache_size)`: its state after the
  prefill, given the taps of the prompt rows (slots 0..T-1, padding past each row's length);
- `draft(params, target_params, target_config, state, anchor_b, context_len_b)`:
  log-probs `[B, D, V]` of the tokens at depths 1..D after the anchor, which sits at
  position `context_len_b` with that many committed tokens before it;
- `commit(params, state, taps_btld, start_b)`: the state after the tokens at positions
  `start_b + t` were committed (their taps given; junk rows past what was committed are
  allowed, and must be overwritten later rather than read).

A drafter whose log-probs cover a draft vocabulary smaller than the target's (`[B, D, K]`)
also has `vocab_size` (K) and `to_target_ids(params, ids)`, which maps its ids to the
target's: the tree is built over the draft ids, then its tokens are mapped, so verification
and acceptance see target ids only (`target_ids` below; drafters without them draft over the
target's vocabulary).

A drafter that knows what to expect of itself also has `acceptance_prior(params, ladder)`: a
`decoding.budget.AcceptancePrior` (committed and predicted tokens at each ladder budget) or
None; `--budget auto` starts a target it has never drafted for from it (`drafter_prior` below).

Its params are an explicit pytree passed in by the caller. The trained head is the
default; the tests' cheating drafter and a researcher's n-gram or EAGLE-style drafter
plug in the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jetflow_jax.attention import AttentionImpl
from jetflow_jax.config import Qwen3Config
from jetflow_jax.head import append_context, context_cache, draft_block, to_target_ids
from jetflow_jax.head_config import HeadConfig


class Drafter(Protocol):
  """What a round asks of a drafter: a frozen, hashable object (static under jit) over an
  explicit params pytree and an explicit state pytree.

  The drafter's context is the committed tokens before each row's anchor; its state holds what
  it keeps of them (the head's context K/V), built from the target's taps: the raw outputs of
  the layers in `tap_layers` for every committed token. Every method runs inside the jitted
  round: no host round trips, fixed shapes.

  Attributes:
    depth: D, the number of depths it drafts per round (the head: `block_size - 1`).
    tap_layers: target layers whose raw hidden states it wants for committed tokens; () for
      none (then `taps_btld` has no layers).
  """

  depth: int
  tap_layers: tuple[int, ...]

  def init_state(self, params, target_params, taps_btld, cache_size: int) -> Any:
    """Its state after the prefill.

    Args:
      params: its params.
      target_params: the target's params.
      taps_btld: `[B, T, len(tap_layers), D]` taps of the prompt rows at slots 0..T-1,
        padding past each row's length.
      cache_size: the slots a row's context may need (static).

    Returns:
      The state, a pytree (None for none).
    """
    ...

  def draft(self, params, target_params, target_config: Qwen3Config, state, anchor_b,
            context_len_b) -> jax.Array:
    """Per-depth log-probs after each row's anchor.

    Args:
      params: its params.
      target_params: the target's params (a head uses its embedding and LM head).
      target_config: the target's config.
      state: its state; only read.
      anchor_b: `[B]` int32, each row's last committed token.
      context_len_b: `[B]` int32: the anchor sits at this position, with that many committed
        tokens before it.

    Returns:
      `[B, D, V]` log-probs of the tokens at depths 1..D after the anchor.
    """
    ...

  def commit(self, params, state, taps_btld, start_b) -> Any:
    """Its state after the tokens at positions `start_b + t` were committed.

    Args:
      params: its params.
      state: its state.
      taps_btld: `[B, T, len(tap_layers), D]` taps of the committed tokens; rows past what a
        row committed are junk, which a later commit overwrites and which must not be read.
      start_b: `[B]` int32, the position of each row's first committed token here.

    Returns:
      The new state (same structure).
    """
    ...


@dataclasses.dataclass(frozen=True)
class HeadDrafter:
  """The causal-parallel (JetFlow) or bidirectional (DFlash) draft head; state: its context K/V.

  Its params are the head's params (`load_head`); `drafter_for` builds it for a method.

  Attributes:
    config: the head's config.
    dtype: the compute dtype (that of its params).
    impl: the attention path of the head's block (`xla`, `pallas`, `pallas_tpu`).
  """

  config: HeadConfig
  dtype: Any = jnp.float32
  impl: AttentionImpl = "xla"

  @property
  def depth(self) -> int:
    """`block_size - 1`."""
    return self.config.depth

  @property
  def tap_layers(self) -> tuple[int, ...]:
    """The head's `target_layer_ids`."""
    return tuple(self.config.target_layer_ids)

  def init_state(self, params, target_params, taps_btld, cache_size: int):
    del target_params
    return context_cache(params, self.config, taps_btld, cache_size, self.dtype)

  def draft(self, params, target_params, target_config, state, anchor_b, context_len_b):
    logits_bdv = draft_block(params, self.config, target_params, target_config, state,
                             context_len_b, anchor_b, self.dtype, self.impl)
    return jax.nn.log_softmax(logits_bdv, axis=-1)

  def commit(self, params, state, taps_btld, start_b):
    return append_context(params, self.config, state, taps_btld, start_b, self.dtype)

  def acceptance_prior(self, params, ladder):
    """What it measured of itself on held-out text (`HeadConfig.acceptance`), if it did."""
    del params
    acceptance = self.config.acceptance
    return None if acceptance is None else acceptance.prior(ladder)

  @property
  def vocab_size(self) -> int:
    return self.config.output_vocab_size

  def to_target_ids(self, params, ids):
    return to_target_ids(params, self.config, ids)


@dataclasses.dataclass(frozen=True)
class NoDrafter:
  """Drafts nothing (depth 0, no state): with `TreeShape("root")` a round is one AR step, so
  plain decoding runs through the same round as the speculative methods."""

  depth: int = 0
  tap_layers: tuple[int, ...] = ()

  def init_state(self, params, target_params, taps_btld, cache_size: int):
    return None

  def draft(self, params, target_params, target_config, state, anchor_b, context_len_b):
    return jnp.zeros((anchor_b.shape[0], 0, target_config.vocab_size), jnp.float32)

  def commit(self, params, state, taps_btld, start_b):
    return state


def draft_vocab_size(drafter: Drafter, config: Qwen3Config) -> int:
  """Tokens the drafter's log-probs cover."""
  return getattr(drafter, "vocab_size", None) or config.vocab_size


def target_ids(drafter: Drafter, params, ids):
  """The target ids of token ids the drafter drafted (its draft vocabulary's, if it has one)."""
  to_target = getattr(drafter, "to_target_ids", None)
  return ids if to_target is None else to_target(params, ids)


def drafter_prior(drafter: Drafter, params, ladder):
  """The drafter's `acceptance_prior` at these ladder budgets, None where it has none."""
  prior = getattr(drafter, "acceptance_prior", None)
  return None if prior is None else prior(params, tuple(ladder))
