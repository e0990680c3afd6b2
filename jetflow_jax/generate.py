"""Autoregressive decoding: a jitted prefill and a jitted `lax.while_loop` of decode steps.

All state lives in `DecodeState`, a pytree passed in and returned, so the loop
never talks to the host. `max_new_tokens` is a traced value and prompts are
padded to power-of-two buckets, so neither recompiles.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jetflow_jax.config import Qwen3Config
from jetflow_jax.distributed import to_host
from jetflow_jax.errors import InputError
from jetflow_jax.mesh import DecodeMesh
from jetflow_jax.model import KVCache, abstract_params, forward, lm_logits, params_dtype
from jetflow_jax.sampling import Greedy, Sampler

MIN_BUCKET = 16
# Prompt tokens per row forwarded at once: a longer prompt runs in chunks of this many, so
# prefill activations stay bounded (batch x chunk rows) whatever the context length.
PREFILL_CHUNK = 2048
STREAM_INTERVAL_S = 0.1  # streamed text arrives at least this often once chunks have grown


@flax.struct.dataclass
class DecodeState:
  """Everything one decode step reads and writes.

  `tokens_bs` holds prompt and generated tokens; row b has `lengths_b[b]`
  committed tokens, of which all but the last have their K/V in `cache`.
  """

  tokens_bs: jax.Array
  lengths_b: jax.Array
  max_lengths_b: jax.Array  # stop once a row holds this many tokens
  done_b: jax.Array
  cache: KVCache
  rng: jax.Array
  num_forwards: jax.Array  # target forward passes so far (scalar)


def bucket_length(n: int, limit: int) -> int:
  """Smallest power of two >= n (at least MIN_BUCKET), capped at `limit`."""
  return min(limit, max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length()))


def is_stop(tokens_b, stop_tokens):
  """Which tokens `[B, ...]` stop their row: `stop_tokens` a tuple of ids for every row, or an
  array `[B, K]` of each row's ids (-1 pads)."""
  if isinstance(stop_tokens, (tuple, list)):
    if not stop_tokens:
      return jnp.zeros(tokens_b.shape, bool)
    return jnp.isin(tokens_b, jnp.asarray(stop_tokens, jnp.int32))
  stops_bxk = stop_tokens.reshape(stop_tokens.shape[:1] + (1,) * (tokens_b.ndim - 1)
                                  + stop_tokens.shape[1:])
  return jnp.any(tokens_b[..., None] == stops_bxk, axis=-1)


def _append(state: DecodeState, new_b: jax.Array, stop_tokens) -> DecodeState:
  """Commits one sampled token per unfinished row and updates `done`."""
  rows = jnp.arange(new_b.shape[0])
  live = ~state.done_b
  tokens = state.tokens_bs.at[rows, state.lengths_b].set(
      jnp.where(live, new_b, state.tokens_bs[rows, state.lengths_b]))
  lengths = state.lengths_b + live.astype(jnp.int32)
  done = (state.done_b | (live & is_stop(new_b, stop_tokens)) | (lengths >= state.max_lengths_b)
          | (lengths >= tokens.shape[1]))
  return state.replace(tokens_bs=tokens, lengths_b=lengths, done_b=done)


def prefill_forward(target_params, config: Qwen3Config, prompt_bt, prompt_lengths_b,
                    cache_size: int, *, mesh: DecodeMesh | None = None,
                    tap_layers: tuple[int, ...] = (), init_taps: Callable | None = None,
                    commit_taps: Callable | None = None, chunk: int = PREFILL_CHUNK):
  """The padded prompts through the target into a cache of `cache_size` slots.

  Returns (cache, final hidden state at each row's last prompt token `[B, D]`, taps state).
  With `tap_layers`, the taps of the prompt rows are folded into a state: `init_taps(taps)`
  for the first rows, then `commit_taps(state, taps, start_b)` for each later chunk. A prompt
  longer than `chunk` runs `chunk` tokens at a time (the last chunk what is left), each
  attending to the cache written before it.
  """
  batch, length = prompt_bt.shape
  rows = jnp.arange(batch)
  target_mesh = None if mesh is None else mesh.mesh
  sharding = None if mesh is None else mesh.cache_sharding(config, batch)
  if length <= chunk:  # one pass; the cache is built around the rows' own K/V
    hidden_btd, prompt_kv, taps = forward(target_params, config, prompt_bt,
                                          tap_layers=tap_layers, mesh=target_mesh)
    return (KVCache.from_rows(prompt_kv, cache_size, sharding),
            hidden_btd[rows, prompt_lengths_b - 1], init_taps(taps) if init_taps else None)

  def run_chunk(start, size, carry):
    """Forwards prompt tokens [start, start + size) after the cache's first `start` slots."""
    cache, last_bd, state = carry
    start_b = jnp.full((batch,), start, jnp.int32)
    tokens_bt = jax.lax.dynamic_slice_in_dim(prompt_bt, start, size, axis=1)
    hidden_btd, cache, taps = forward(target_params, config, tokens_bt, cache=cache,
                                      cache_index_b=start_b, tap_layers=tap_layers,
                                      mesh=target_mesh)
    offset_b = prompt_lengths_b - 1 - start  # the row's last prompt token, if in this chunk
    here_b = (offset_b >= 0) & (offset_b < size)
    last_bd = jnp.where(here_b[:, None], hidden_btd[rows, jnp.clip(offset_b, 0, size - 1)],
                        last_bd)
    if init_taps is not None:
      state = init_taps(taps) if state is None else commit_taps(state, taps, start_b)
    return cache, last_bd, state

  cache = KVCache.zeros(config, batch, cache_size, params_dtype(target_params))
  if sharding is not None:
    cache = jax.lax.with_sharding_constraint(cache, sharding)
  carry = run_chunk(0, chunk, (cache, jnp.zeros((batch, config.hidden_size), cache.k[0].dtype),
                               None))
  full, rest = divmod(length, chunk)
  carry = jax.lax.fori_loop(1, full, lambda i, c: run_chunk(i * chunk, chunk, c), carry)
  return run_chunk(full * chunk, rest, carry) if rest else carry


@functools.partial(jax.jit, static_argnames=("config", "sampler", "cache_size", "stop_tokens",
                                             "mesh", "chunk"))
def prefill(target_params, config: Qwen3Config, prompt_bt, prompt_lengths_b, max_new_tokens,
            rng, *, sampler: Sampler, cache_size: int, stop_tokens: tuple[int, ...] = (),
            mesh: DecodeMesh | None = None, chunk: int = PREFILL_CHUNK):
  """Runs the padded prompts through the target and samples the first new token."""
  batch, prompt_len = prompt_bt.shape
  cache, last_bd, _ = prefill_forward(target_params, config, prompt_bt, prompt_lengths_b,
                                      cache_size, mesh=mesh, chunk=chunk)
  rng, draw = jax.random.split(rng)
  first_b = sampler(draw, lm_logits(target_params, config, last_bd))
  tokens = jnp.zeros((batch, cache_size), jnp.int32).at[:, :prompt_len].set(prompt_bt)
  state = DecodeState(tokens_bs=tokens, lengths_b=prompt_lengths_b,
                      max_lengths_b=prompt_lengths_b + max_new_tokens,
                      done_b=jnp.zeros((batch,), bool), cache=cache, rng=rng,
                      num_forwards=jnp.ones((), jnp.int32))
  return _append(state, first_b, stop_tokens)


def decode_step(target_params, config: Qwen3Config, state: DecodeState, sampler: Sampler,
                stop_tokens: tuple[int, ...] = (), mesh: DecodeMesh | None = None) -> DecodeState:
  """Forwards each row's last committed token and commits the next one."""
  batch = state.lengths_b.shape[0]
  slot_b = state.lengths_b - 1
  last_b1 = state.tokens_bs[jnp.arange(batch), slot_b][:, None]
  hidden_b1d, cache, _ = forward(target_params, config, last_b1, cache=state.cache,
                                 cache_index_b=slot_b, mesh=None if mesh is None else mesh.mesh)
  rng, draw = jax.random.split(state.rng)
  next_b = sampler(draw, lm_logits(target_params, config, hidden_b1d[:, 0]))
  state = state.replace(cache=cache, rng=rng, num_forwards=state.num_forwards + 1)
  return _append(state, next_b, stop_tokens)


@functools.partial(jax.jit, static_argnames=("config", "sampler", "stop_tokens", "mesh"),
                   donate_argnames=("state",))
def decode(target_params, config: Qwen3Config, state: DecodeState, max_steps, *,
           sampler: Sampler, stop_tokens: tuple[int, ...] = (),
           mesh: DecodeMesh | None = None) -> DecodeState:
  """Up to `max_steps` decode steps (traced), stopping early once every row is done."""
  return steps_until_done(
      lambda s: decode_step(target_params, config, s, sampler, stop_tokens, mesh), state,
      max_steps)


def steps_until_done(step: Callable, state, max_steps):
  """`state = step(state)` in one `lax.while_loop`, at most `max_steps` times or until every
  row's `done_b` is set."""

  def cond(carry):
    count, s = carry
    return (count < max_steps) & ~jnp.all(s.done_b)

  def body(carry):
    count, s = carry
    return count + 1, step(s)

  return jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state))[1]


def default_cache_size(config: Qwen3Config, prompts: Sequence[Sequence[int]],
                       max_new_tokens: int) -> int:
  """A power of two that fits the longest prompt plus `max_new_tokens` (fewer recompiles)."""
  needed = max((len(p) for p in prompts), default=0) + max_new_tokens
  return bucket_length(needed, max(config.max_position_embeddings, needed))


def stop_tokens_for(config: Qwen3Config, stop_tokens: Sequence[int] | None) -> tuple[int, ...]:
  """The given stop tokens, or the config's EOS ids."""
  return tuple(config.eos_token_ids if stop_tokens is None else stop_tokens)


@dataclasses.dataclass
class Generation:
  """Generated token ids per prompt (stop token included) and how they were made."""

  tokens: list[list[int]]
  num_forwards: int
  compile_s: float  # ahead-of-time compilation of prefill and decode
  wall_s: float  # prefill + decoding, compilation excluded

  @property
  def num_tokens(self) -> int:
    return sum(len(t) for t in self.tokens)


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


def placed(tree, sharding):
  """Abstract values of `tree` carrying `sharding` (a pytree like `tree`, or one for all)."""
  if not isinstance(sharding, jax.sharding.Sharding):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                        sharding)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


@functools.lru_cache(maxsize=32)
def _compiled(config: Qwen3Config, dtype, prompt_shape: tuple[int, int], sampler: Sampler,
              cache_size: int, stop_tokens: tuple[int, ...], mesh: DecodeMesh | None = None):
  """Ahead-of-time compiled (prefill, decode) for one shape; kept so repeated calls are free.

  With `mesh`, params, rows and the KV cache are placed as `DecodeMesh` says.
  """
  params = abstract_params(config, dtype)
  int_scalar = jax.ShapeDtypeStruct((), jnp.int32)
  prompt_bt = jax.ShapeDtypeStruct(prompt_shape, jnp.int32)
  lengths_b = jax.ShapeDtypeStruct(prompt_shape[:1], jnp.int32)
  rng = jax.eval_shape(jax.random.key, 0)
  if mesh is not None:
    params = placed(params, mesh.param_shardings(config, params))
    int_scalar, rng = placed((int_scalar, rng), mesh.replicated())
    prompt_bt, lengths_b = placed((prompt_bt, lengths_b), mesh.rows())
  prefill_compiled = prefill.lower(params, config, prompt_bt, lengths_b, int_scalar, rng,
                                   sampler=sampler, cache_size=cache_size,
                                   stop_tokens=stop_tokens, mesh=mesh).compile()
  state = prefill_compiled.out_info
  if mesh is not None:
    state = placed(state, prefill_compiled.output_shardings)
  decode_lowered = decode.lower(params, config, state, int_scalar, sampler=sampler,
                                stop_tokens=stop_tokens, mesh=mesh)
  return prefill_compiled, decode_lowered.compile()


def generate(target_params, config: Qwen3Config, prompts: Sequence[Sequence[int]],
             max_new_tokens: int, *, sampler: Sampler = Greedy(), seed: int = 0,
             cache_size: int | None = None, stop_tokens: Sequence[int] | None = None,
             on_tokens: Callable[[list[list[int]]], None] | None = None,
             stream_every: int = 8, mesh: DecodeMesh | None = None) -> Generation:
  """Decodes a batch of prompts (lists of token ids of any lengths).

  `cache_size` defaults to a power of two that fits the longest prompt plus
  `max_new_tokens`. `stop_tokens` defaults to the config's EOS ids. With
  `on_tokens`, the host regains control every `stream_every` steps and is given
  the tokens generated so far (for streaming); otherwise one jitted loop runs to
  the end. With `mesh` (a `DecodeMesh`), the rows split over its `data` axis (the number
  of prompts must be a multiple of its size) and the target over `tp` / `ep`;
  `target_params` must already be placed as `mesh.param_shardings` says.
  """
  if max_new_tokens < 1:
    raise InputError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
  if cache_size is None:
    cache_size = default_cache_size(config, prompts, max_new_tokens)
  stop = stop_tokens_for(config, stop_tokens)
  prompt_bt, prompt_lengths_b = pad_prompts(prompts, cache_size)
  if mesh is not None and len(prompts) % mesh.size("data"):
    raise InputError(f"{len(prompts)} prompts do not split over the mesh's "
                     f"{mesh.size('data')} data-parallel rows")
  start = time.perf_counter()
  dtype = params_dtype(target_params)
  prefill_fn, decode_fn = _compiled(config, dtype, prompt_bt.shape, sampler, cache_size, stop,
                                    mesh)
  compile_s = time.perf_counter() - start
  rng = jax.random.key(seed)

  start = time.perf_counter()
  state = prefill_fn(target_params, *placed_rows(mesh, prompt_bt, prompt_lengths_b),
                     max_new_tokens, rng)
  state = run_loop(state, lambda s, steps: decode_fn(target_params, s, steps), max_new_tokens,
                   prompt_lengths_b, on_tokens, stream_every)
  tokens = new_tokens(state, prompt_lengths_b)
  return Generation(tokens=tokens, num_forwards=int(to_host(state.num_forwards)),
                    compile_s=compile_s, wall_s=time.perf_counter() - start)


def placed_rows(mesh: DecodeMesh | None, *rows_b):
  """Per-row host arrays where the mesh splits rows (a no-op without one)."""
  return rows_b if mesh is None else mesh.put(rows_b, mesh.rows())


def new_tokens(state, prompt_lengths_b) -> list[list[int]]:
  """Each row's generated tokens from a state with `tokens_bs` and `lengths_b`."""
  tokens, lengths = to_host((state.tokens_bs, state.lengths_b))
  return [tokens[b, p:lengths[b]].tolist() for b, p in enumerate(prompt_lengths_b)]


def run_loop(state, advance: Callable, max_steps: int, prompt_lengths_b, on_tokens,
             stream_every: int):
  """Runs `advance(state, steps)` until every row is done.

  Without `on_tokens`, one call. With it, chunks of at first `stream_every` steps; the
  tokens so far are copied on device and handed to the host while the device already runs
  the next chunk. Each chunk launch has a fixed cost, so chunks grow until they last about
  `STREAM_INTERVAL_S`: streaming then costs a few percent at most. A chunk dispatched
  after the last row finished does nothing.
  """
  if on_tokens is None:
    return advance(state, max_steps)
  steps = stream_every
  last = time.perf_counter()
  while True:
    snapshot = (jnp.copy(state.tokens_bs), jnp.copy(state.lengths_b), jnp.all(state.done_b))
    state = advance(state, steps)
    tokens, lengths, all_done = to_host(snapshot)
    on_tokens([tokens[b, p:lengths[b]].tolist() for b, p in enumerate(prompt_lengths_b)])
    if all_done:
      return state
    now = time.perf_counter()
    if now - last < STREAM_INTERVAL_S:
      steps = min(2 * steps, max_steps)
    last = now
