"""The decoding state over rows, why a row stopped, and the host-side shaping of prompts.

Axis letters as in `attention.py`: B rows, S a row's token and cache slots, T a prompt bucket,
K a row's stop ids (here only), R rounds.
"""

from __future__ import annotations

import enum
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jetflow_jax.config import Qwen3Config
from jetflow_jax.errors import InputError
from jetflow_jax.model import KVCache
from jetflow_jax.sampling import RowSampling

MIN_BUCKET = 16


class StopReason(enum.StrEnum):
  """Why a row stopped: the one vocabulary of the batch loop, the engine and the server.

  A string enum: `stop_token` (it committed one of its stop tokens), `max_tokens` (it holds
  the new tokens it asked for), `cache_full` (its buffer has no room for another round),
  `cancelled` (the host ended it).
  """

  STOP_TOKEN = "stop_token"  # it committed one of its stop tokens
  MAX_TOKENS = "max_tokens"  # it holds the new tokens it asked for (--max-new-tokens)
  CACHE_FULL = "cache_full"  # its buffer has no room for another round
  CANCELLED = "cancelled"  # the host ended it (and every free engine slot)

  @property
  def code(self) -> int:
    """The int32 the device keeps in `DecodeState.stop_b` (0 while the row runs)."""
    return list(StopReason).index(self) + 1

  @classmethod
  def of_code(cls, code: int) -> "StopReason | None":
    """The reason a device code stands for; None for a running row."""
    return None if code == RUNNING else list(cls)[code - 1]


RUNNING = 0


@flax.struct.dataclass
class DecodeState:
  """Everything a round reads and writes, for every row; each row is its own request.

  Per row: `lengths_b` tokens are committed; the target cache holds the K/V of all but the
  last (the anchor), and so does the drafter's context. A round writes `depth + 1` slots after
  the committed prefix (slots past what is committed are junk that later rounds overwrite), so
  every buffer keeps `depth + 1` spare slots past `capacity`.

  A pytree (`flax.struct.dataclass`); every round takes it and returns the next one.

  Attributes:
    tokens_bs: committed tokens (prompt included), junk past `lengths_b`.
    lengths_b: committed tokens per row.
    max_lengths_b: a row stops once it holds this many tokens.
    stop_b: int32 `StopReason.code`, 0 while the row decodes.
    cache: the target's K/V (`KVCache`).
    drafter_state: the drafter's state (the head's context K/V; None for AR).
    keys_b: each row's request key; a draw folds in the row's committed length.
    sampling: each row's temperature / top-k / top-p (`RowSampling`).
    stop_tokens_bk: each row's stop ids, -1 pads.
    num_forwards: target forward passes so far, prefill included (scalar).
    rounds_b: rounds each row took part in.
    committed_br: tokens committed by row b in its round r (bonus included).
    logprobs_bs: the target's own log-probability of the token at each position, where a round
      or a prefill was asked for them (`RoundSpec.logprobs`); junk elsewhere.
    top_ids_bsx: the target's `top` likeliest tokens at each position (`[B, S, top]`).
    top_logprobs_bsx: their log-probabilities.
    predicted_bl: the last drafting round's expected committed tokens at each budget of
      `RoundSpec.ladder` (`[B, 0]` without one).
    pending_taps_bpld: taps of AR rounds not yet committed to the drafter (`[B, P, taps, D]`).
    pending_from_b: where each row's pending taps start.
  """

  tokens_bs: jax.Array  # committed tokens (prompt included), junk past lengths_b
  lengths_b: jax.Array
  max_lengths_b: jax.Array  # a row stops once it holds this many tokens
  stop_b: jax.Array  # int32 `StopReason.code`, RUNNING while the row decodes
  cache: KVCache  # target K/V
  drafter_state: Any
  keys_b: jax.Array  # each row's request key; a draw folds in the row's committed length
  sampling: RowSampling  # each row's temperature / top-k / top-p
  stop_tokens_bk: jax.Array  # each row's stop ids, -1 pads
  num_forwards: jax.Array  # target forward passes so far, prefill included (scalar)
  rounds_b: jax.Array  # rounds each row took part in
  committed_br: jax.Array  # tokens committed by row b in its round r (bonus included)
  # The target's own log-probabilities (its logits before temperature and filters) of the token
  # at each position, and its `top` likeliest tokens there, `[B, S, top]` (top may be 0). Written
  # only where a round, or a prefill, is asked for them (`RoundSpec.logprobs`); junk elsewhere.
  logprobs_bs: jax.Array
  top_ids_bsx: jax.Array
  top_logprobs_bsx: jax.Array
  # The last drafting round's expected committed tokens at each budget of `RoundSpec.ladder`
  # (`[B, 0]` without one): what the loop choosing budgets calibrates against what was accepted.
  predicted_bl: jax.Array
  # Taps of AR rounds not yet committed to the drafter (`[B, P, taps, D]`, P = 0 when AR rounds
  # commit them at once): one row a round from `pending_from_b`, committed together by the next
  # drafting round (`round.flush_pending`); the host keeps AR runs within P rounds of a flush.
  pending_taps_bpld: jax.Array
  pending_from_b: jax.Array

  @property
  def done_b(self) -> jax.Array:
    """Which rows have stopped."""
    return self.stop_b != RUNNING

  @property
  def top(self) -> int:
    """How many likeliest tokens a position's log-probabilities keep."""
    return self.top_ids_bsx.shape[2]

  @property
  def capacity(self) -> int:
    """Committed tokens a row may hold at most: every live round commits one or more, so
    `committed_br` has one column per possible round."""
    return self.committed_br.shape[1]


def stop_code(hit_stop_b, lengths_b, max_lengths_b, capacity: int, running_b):
  """The code of rows that were running and stop now (RUNNING for the others): a stop token
  first, then the request's length, then the buffer's."""
  code = jnp.where(hit_stop_b, StopReason.STOP_TOKEN.code,
                   jnp.where(lengths_b >= max_lengths_b, StopReason.MAX_TOKENS.code,
                             jnp.where(lengths_b >= capacity, StopReason.CACHE_FULL.code,
                                       RUNNING)))
  return jnp.where(running_b, code, RUNNING).astype(jnp.int32)


def scores(logits_bxv, tokens_bx, top: int):
  """The target's log-probabilities of `tokens` `[B, X]` and its `top` likeliest tokens at each
  of those positions: (`[B, X]`, ids `[B, X, top]`, log-probabilities `[B, X, top]`)."""
  logprobs_bxv = jax.nn.log_softmax(logits_bxv.astype(jnp.float32), axis=-1)
  chosen_bx = jnp.take_along_axis(logprobs_bxv, tokens_bx[..., None], axis=-1)[..., 0]
  top_logprobs, top_ids = jax.lax.top_k(logprobs_bxv, top)
  return chosen_bx, top_ids.astype(jnp.int32), top_logprobs


def is_stop(tokens_b, stop_tokens_bk):
  """Which tokens `[B, ...]` stop their row, given each row's stop ids `[B, K]` (-1 pads)."""
  stops = stop_tokens_bk.reshape(stop_tokens_bk.shape[:1] + (1,) * (tokens_b.ndim - 1)
                                 + stop_tokens_bk.shape[1:])
  return jnp.any(tokens_b[..., None] == stops, axis=-1)


def stop_rows(stop_tokens: Sequence[Sequence[int]], width: int | None = None) -> np.ndarray:
  """Rows of stop ids `[B, K]` padded with -1 (K: `width`, or the longest row, at least 1)."""
  width = max([width or 1] + [len(s) for s in stop_tokens])
  rows = np.full((len(stop_tokens), width), -1, np.int32)
  for b, stop in enumerate(stop_tokens):
    rows[b, :len(stop)] = stop
  return rows


def stop_tokens_for(config: Qwen3Config, stop_tokens: Sequence[int] | None) -> tuple[int, ...]:
  """The given stop tokens, or the config's EOS ids."""
  return tuple(config.eos_token_ids if stop_tokens is None else stop_tokens)


def bucket_length(n: int, limit: int) -> int:
  """Smallest power of two >= n (at least MIN_BUCKET), capped at `limit`."""
  return min(limit, max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length()))


def default_cache_size(config: Qwen3Config, prompts: Sequence[Sequence[int]],
                       max_new_tokens: int) -> int:
  """A power of two that fits the longest prompt plus `max_new_tokens` (fewer recompiles)."""
  needed = max((len(p) for p in prompts), default=0) + max_new_tokens
  return bucket_length(needed, max(config.max_position_embeddings, needed))


def check_context_window(config: Qwen3Config, prompts: Sequence[Sequence[int]],
                         max_new_tokens: int) -> None:
  """Refuses a prompt plus `max_new_tokens` beyond the model's `max_position_embeddings`."""
  longest = max((len(p) for p in prompts), default=0)
  if longest + max_new_tokens > config.max_position_embeddings:
    raise InputError(f"a prompt of {longest} tokens plus {max_new_tokens} new tokens exceeds the "
                     f"model's context window of {config.max_position_embeddings} positions "
                     "(max_position_embeddings); shorten them, or pass --allow-long-context")


def pad_prompts(prompts: Sequence[Sequence[int]], cache_size: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads prompts to a shared bucket length; checks they fit the cache."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise InputError("every prompt needs at least one token")
  longest = max(len(p) for p in prompts)
  if longest >= cache_size:
    raise InputError(f"prompt of {longest} tokens does not fit a KV cache of {cache_size} slots "
                     "(one slot is needed for the first new token); raise --cache-size")
  width = bucket_length(longest, cache_size)
  padded = np.zeros((len(prompts), width), np.int32)
  for row, prompt in enumerate(prompts):
    padded[row, :len(prompt)] = prompt
  return padded, np.array([len(p) for p in prompts], np.int32)
