"""The engine's explicit state over a fixed number of slots, and a step's output.

Axis letters as in `attention.py`: B is the slot axis (the engine's batch, one request per slot),
S a slot's token and cache positions; W (here only) a step's window of tokens.
"""

from __future__ import annotations

import flax.struct
import jax

from jetflow_jax.decoding.state import DecodeState


@flax.struct.dataclass
class EngineState:
  """Every slot's decoding state (the rows a round runs over, each with its request's settings)
  and what the host has read of it. A free slot is a row stopped as cancelled.

  Attributes:
    rows: the slots' `DecodeState`, one row per slot.
    reported_b: each slot's tokens already handed to the host (prompt included).
  """

  rows: DecodeState
  reported_b: jax.Array  # each slot's tokens already handed to the host (prompt included)


@flax.struct.dataclass
class StepOutput:
  """What the host reads back after a step: small arrays, no cache.

  Attributes:
    new_bw: each slot's tokens since its last report, left-aligned; junk past `num_new_b`.
    num_new_b: how many there are.
    stop_b: each slot's `StopReason.code` (0 while it decodes).
    rounds_b: rounds each slot's request has taken part in.
    logprobs_bw: with a step's `logprobs`, the new tokens' log-probabilities; None without.
    top_ids_bwx: their likeliest alternatives.
    top_logprobs_bwx: the alternatives' log-probabilities.
    predicted_brl: with a budget ladder, each round's `DecodeState.predicted_bl`; None without.
    committed_br: with a budget ladder, each slot's committed tokens a round (-1 where the slot
      was done); None without.
  """

  new_bw: jax.Array  # each slot's tokens since its last report, left-aligned; junk past num_new_b
  num_new_b: jax.Array
  stop_b: jax.Array  # each slot's `StopReason.code` (RUNNING while it decodes)
  rounds_b: jax.Array  # rounds each slot's request has taken part in
  # With a step's `logprobs`: the new tokens' log-probabilities and likeliest alternatives, as
  # `new_bw` (`DecodeState.logprobs_bs` and its top arrays); None without.
  logprobs_bw: jax.Array | None = None
  top_ids_bwx: jax.Array | None = None
  top_logprobs_bwx: jax.Array | None = None
  # With a budget ladder (`Engine.ladder`): each round's `DecodeState.predicted_bl` `[B, R, L]`
  # (a root-only round's is the last draft's) and each slot's committed tokens `[B, R]` (-1 where
  # the slot was done). None without.
  predicted_brl: jax.Array | None = None
  committed_br: jax.Array | None = None
