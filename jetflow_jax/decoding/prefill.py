"""Prefill: padded prompts through the target (in chunks when long) into a new `DecodeState`."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from jetflow_jax.attention import AttentionImpl
from jetflow_jax.config import Qwen3Config
from jetflow_jax.decoding.state import DecodeState, is_stop, scores, stop_code
from jetflow_jax.drafters import Drafter
from jetflow_jax.mesh import DecodeMesh
from jetflow_jax.model import KVCache, forward, lm_logits, params_dtype, write_rows
from jetflow_jax.sampling import RowSampling

# Prompt tokens per row forwarded at once: a longer prompt runs in chunks of this many, so
# prefill activations stay bounded (batch x chunk rows) whatever the context length.
PREFILL_CHUNK = 2048


def prefill_forward(target_params, config: Qwen3Config, prompt_bt, prompt_lengths_b,
                    cache_size: int, *, mesh: DecodeMesh | None = None,
                    tap_layers: tuple[int, ...] = (), init_taps: Callable | None = None,
                    commit_taps: Callable | None = None, chunk: int = PREFILL_CHUNK,
                    keep_hidden: bool = False, impl: AttentionImpl = "xla"):
  """The padded prompts through the target into a cache of `cache_size` slots.

  Returns (cache, final hidden state at each row's last prompt token `[B, D]`, or with
  `keep_hidden` at every prompt position `[B, T, D]`, taps state).
  With `tap_layers`, the taps of the prompt rows are folded into a state: `init_taps(taps)`
  for the first rows, then `commit_taps(state, taps, start_b)` for each later chunk. A prompt
  longer than `chunk` runs `chunk` tokens at a time (the last chunk what is left), each
  attending to the cache written before it (with a kernel `impl`, through the kernel, which
  reads the cache only up to the chunk's start).
  """
  batch, length = prompt_bt.shape
  rows = jnp.arange(batch)
  target_mesh = None if mesh is None else mesh.mesh
  sharding = None if mesh is None else mesh.cache_sharding(config, batch)
  if length <= chunk:  # one pass; the cache is built around the rows' own K/V
    hidden_btd, prompt_kv, taps = forward(target_params, config, prompt_bt,
                                          tap_layers=tap_layers, mesh=target_mesh, impl=impl)
    return (KVCache.from_rows(prompt_kv, cache_size, sharding),
            hidden_btd if keep_hidden else hidden_btd[rows, prompt_lengths_b - 1],
            init_taps(taps) if init_taps else None)

  def run_chunk(start, size, carry):
    """Forwards prompt tokens [start, start + size) after the cache's first `start` slots."""
    cache, hidden, state = carry
    start_b = jnp.full((batch,), start, jnp.int32)
    tokens_bt = jax.lax.dynamic_slice_in_dim(prompt_bt, start, size, axis=1)
    hidden_btd, cache, taps = forward(target_params, config, tokens_bt, cache=cache,
                                      cache_index_b=start_b, tap_layers=tap_layers,
                                      mesh=target_mesh, impl=impl)
    if keep_hidden:
      hidden = jax.lax.dynamic_update_slice_in_dim(hidden, hidden_btd, start, axis=1)
    else:
      offset_b = prompt_lengths_b - 1 - start  # the row's last prompt token, if in this chunk
      here_b = (offset_b >= 0) & (offset_b < size)
      hidden = jnp.where(here_b[:, None], hidden_btd[rows, jnp.clip(offset_b, 0, size - 1)],
                         hidden)
    if init_taps is not None:
      state = init_taps(taps) if state is None else commit_taps(state, taps, start_b)
    return cache, hidden, state

  cache = KVCache.zeros(config, batch, cache_size, params_dtype(target_params))
  if sharding is not None:
    cache = jax.lax.with_sharding_constraint(cache, sharding)
  hidden = jnp.zeros((batch,) + ((length,) if keep_hidden else ()) + (config.hidden_size,),
                     cache.k[0].dtype)
  carry = run_chunk(0, chunk, (cache, hidden, None))
  full, rest = divmod(length, chunk)
  carry = jax.lax.fori_loop(1, full, lambda i, c: run_chunk(i * chunk, chunk, c), carry)
  return run_chunk(full * chunk, rest, carry) if rest else carry


def prompt_scores(target_params, config: Qwen3Config, hidden_btd, prompt_bt, top: int,
                  block: int = 256):
  """`scores` of every prompt token after the first, from the hidden state before it:
  (`[B, T]`, `[B, T, top]`, `[B, T, top]`) for positions 1..T (the last is junk). Runs
  `block` positions at a time, so the logits never span the whole prompt."""
  batch, length = prompt_bt.shape
  blocks = -(-length // block)
  pad = blocks * block - length
  next_bt = jnp.pad(prompt_bt[:, 1:], ((0, 0), (0, pad + 1)))
  hidden_btd = jnp.pad(hidden_btd, ((0, 0), (0, pad), (0, 0)))
  split = lambda x: jnp.moveaxis(x.reshape((batch, blocks, block) + x.shape[2:]), 1, 0)

  def one_block(args):
    hidden_bxd, next_bx = args
    return scores(lm_logits(target_params, config, hidden_bxd), next_bx, top)

  out = jax.lax.map(one_block, (split(hidden_btd), split(next_bt)))
  return tuple(jnp.moveaxis(x, 0, 1).reshape((batch, blocks * block) + x.shape[3:])[:, :length]
               for x in out)


@functools.partial(jax.jit, static_argnames=("config", "drafter", "slots", "capacity", "top",
                                             "ladder", "pending", "sampled", "filtered",
                                             "prompt_logprobs", "mesh", "chunk", "impl"))
def prefill(target_params, drafter_params, prompt_bt, prompt_lengths_b, max_lengths_b, keys_b,
            sampling: RowSampling, stop_tokens_bk, *, config: Qwen3Config, drafter: Drafter,
            slots: int, capacity: int, top: int = 0, ladder: int = 0, pending: int = 0,
            sampled: bool = True, filtered: bool = True, prompt_logprobs: bool = False,
            mesh: DecodeMesh | None = None, chunk: int = PREFILL_CHUNK,
            impl: AttentionImpl = "xla") -> DecodeState:
  """The padded prompts through the target and the drafter, and each row's first token.

  Buffers get `slots` slots, more than any prompt; a row may hold `capacity` tokens (a batch
  decodes in place, so `slots = capacity + depth + 1`; an engine's one-row prefix holds its
  prompt bucket and first token, and lands in a slot of the engine's capacity). Row b draws
  with `keys_b[b]` folded with its prompt length, below every length a round folds in.

  The first token gets its log-probabilities (and the `top` likeliest tokens); with
  `prompt_logprobs`, so does every prompt token after the first. `ladder`: how many budgets a
  round predicts for (`RoundSpec.ladder`). `pending` > 0 (the loop that chooses budgets): the
  prompt's taps, and those of up to `pending` AR rounds after it, are kept back from the
  drafter until a round drafts (`round.flush_pending`), so a run that stays on AR never pays
  for the drafter's context. `impl`: the target's attention (`RoundSpec.impl`).
  """
  batch, prompt_len = prompt_bt.shape
  rows = jnp.arange(batch)
  if pending:
    held = prompt_len + pending
    taps_shape = (batch, held, len(drafter.tap_layers), config.hidden_size)
    init_taps = lambda taps: jax.lax.dynamic_update_slice_in_dim(
        jnp.zeros(taps_shape, taps.dtype), taps, 0, axis=1)
    commit_taps = lambda buffer, taps, start_b: write_rows(buffer, taps, start_b)
  else:
    init_taps = lambda taps: drafter.init_state(drafter_params, target_params, taps, slots)
    commit_taps = lambda state, taps, start_b: drafter.commit(drafter_params, state, taps,
                                                              start_b)
  cache, hidden, taps_state = prefill_forward(
      target_params, config, prompt_bt, prompt_lengths_b, slots, mesh=mesh,
      tap_layers=drafter.tap_layers, chunk=chunk, keep_hidden=prompt_logprobs,
      init_taps=init_taps, commit_taps=commit_taps, impl=impl)
  if pending:  # an empty context with room for every kept-back row, the prompt's first
    pending_taps_bpld, drafter_state = taps_state, jax.tree.map(
        lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(lambda: drafter.init_state(
            drafter_params, target_params, taps_state[:, :1], slots + held)))
  else:
    drafter_state = taps_state
    pending_taps_bpld = jnp.zeros((batch, 0, len(drafter.tap_layers), config.hidden_size),
                                  cache.k[0].dtype)
  last_bd = hidden[rows, prompt_lengths_b - 1] if prompt_logprobs else hidden
  logits_bv = lm_logits(target_params, config, last_bd)
  draw_keys_b = jax.vmap(jax.random.fold_in)(keys_b, prompt_lengths_b)
  first_b = sampling(draw_keys_b, logits_bv, sampled=sampled, filtered=filtered)
  buffers = (jnp.zeros((batch, slots), jnp.float32), jnp.zeros((batch, slots, top), jnp.int32),
             jnp.zeros((batch, slots, top), jnp.float32))
  if prompt_logprobs:  # position t's from the hidden state at t - 1
    buffers = tuple(buffer.at[:, 1:prompt_len + 1].set(x) for buffer, x in
                    zip(buffers, prompt_scores(target_params, config, hidden, prompt_bt, top)))
  first_scores = scores(logits_bv[:, None], first_b[:, None], top)
  logprobs_bs, top_ids_bsx, top_logprobs_bsx = (
      buffer.at[rows, prompt_lengths_b].set(x[:, 0]) for buffer, x in zip(buffers, first_scores))
  tokens_bs = jnp.zeros((batch, slots), jnp.int32).at[:, :prompt_len].set(prompt_bt)
  tokens_bs = tokens_bs.at[rows, prompt_lengths_b].set(first_b)
  lengths_b = prompt_lengths_b + 1
  stop_b = stop_code(is_stop(first_b, stop_tokens_bk), lengths_b, max_lengths_b, capacity,
                     jnp.ones((batch,), bool))
  return DecodeState(
      tokens_bs=tokens_bs, lengths_b=lengths_b, max_lengths_b=max_lengths_b, stop_b=stop_b,
      cache=cache, drafter_state=drafter_state, keys_b=keys_b, sampling=sampling,
      stop_tokens_bk=stop_tokens_bk, num_forwards=jnp.ones((), jnp.int32),
      rounds_b=jnp.zeros((batch,), jnp.int32),
      committed_br=jnp.zeros((batch, capacity), jnp.int32), logprobs_bs=logprobs_bs,
      top_ids_bsx=top_ids_bsx, top_logprobs_bsx=top_logprobs_bsx,
      predicted_bl=jnp.ones((batch, ladder), jnp.float32),
      pending_taps_bpld=pending_taps_bpld,
      pending_from_b=jnp.zeros_like(prompt_lengths_b) if pending else prompt_lengths_b)
