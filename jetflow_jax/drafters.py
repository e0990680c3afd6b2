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
  depth: int
  tap_layers: tuple[int, ...]

  def init_state(self, params, target_params, taps_btld, cache_size: int) -> Any: ...

  def draft(self, params, target_params, target_config: Qwen3Config, state, anchor_b,
            context_len_b) -> jax.Array: ...

  def commit(self, params, state, taps_btld, start_b) -> Any: ...


@dataclasses.dataclass(frozen=True)
class HeadDrafter:
  """The causal-parallel (JetFlow) or bidirectional (DFlash) draft head; state: its context K/V."""

  config: HeadConfig
  dtype: Any = jnp.float32
  impl: AttentionImpl = "xla"

  @property
  def depth(self) -> int:
    return self.config.depth

  @property
  def tap_layers(self) -> tuple[int, ...]:
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
