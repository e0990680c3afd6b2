"""The engine's explicit state over a fixed number of slots, a prefilled request, a step's output.

Axis letters as in `attention.py`: B is the slot axis (the engine's batch, one request per slot),
S a slot's token and cache positions, T a prompt bucket; W (here only) a step's window of tokens.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax

from jetflow_jax.model import KVCache
from jetflow_jax.sampling import RowSampling
from jetflow_jax.speculative import SpecState


@flax.struct.dataclass
class EngineState:
  """Every slot's decoding state: the rows a speculative round runs over, plus each slot's
  request settings. A free slot is a done row (rounds commit nothing there)."""

  rows: SpecState  # one row per slot; `rows.rng` holds each slot's request key `[B]`
  sampling: RowSampling  # each slot's temperature / top-k / top-p
  stop_tokens: jax.Array  # `[B, max_stop_tokens]` int32 stop ids per slot, -1 pads
  reported_b: jax.Array  # each slot's tokens already handed to the host (prompt included)


@flax.struct.dataclass
class Prefix:
  """One prefilled request, batch axis of 1: everything `insert` copies into a slot."""

  prompt_bt: jax.Array  # int32, right-padded to a bucket of T tokens
  prompt_length_b: jax.Array
  first_b: jax.Array  # the first generated token
  max_length_b: jax.Array  # prompt + max_tokens
  cache: KVCache  # target K/V of the prompt, `[1, T, K, H]` per layer
  drafter_state: Any  # the drafter's state after the prompt (leaves `[1, T, ...]`)
  key_b: jax.Array  # the request's key (from its seed alone)
  sampling: RowSampling
  stop_tokens: jax.Array  # `[1, max_stop_tokens]`, -1 pads


@flax.struct.dataclass
class StepOutput:
  """What the host reads back after a step: small arrays, no cache."""

  new_bw: jax.Array  # each slot's tokens since its last report, left-aligned; junk past num_new_b
  num_new_b: jax.Array
  done_b: jax.Array
  rounds_b: jax.Array  # rounds each slot's request has taken part in
