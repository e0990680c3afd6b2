"""The engine: a fixed number of slots and four jitted functions over an explicit `EngineState`.

In JetStream's shape: `prefill` runs one request's prompt (padded to a power-of-two bucket, so
few shapes compile) and samples its first token; `insert` copies that prefix into a free slot;
`step` runs `rounds_per_step` speculative rounds over every slot (done and free slots commit
nothing) and hands back only the new tokens; `evict` frees a slot. The host loop that calls
them is `engine.loop`.

With a `DecodeMesh`, the slots split over its `data` axis (each device group runs its share of
the slots against its own copy of the target, split over `tp` / `ep` as `mesh.param_shardings`
places it); every function keeps the state there, and XLA partitions the rest.

Randomness is per request: a slot's key is `key(seed)`, and every draw folds in the row's
committed length at that point (unique per round), so a request's tokens depend on its seed
alone, not on the slot it lands in or what shares the batch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jetflow_jax.config import Qwen3Config
from jetflow_jax.drafters import Drafter, NoDrafter
from jetflow_jax.engine.state import EngineState, Prefix, StepOutput
from jetflow_jax.errors import InputError
from jetflow_jax.generate import bucket_length, is_stop, stop_tokens_for
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.mesh import DecodeMesh
from jetflow_jax.model import KVCache, params_dtype
from jetflow_jax.sampling import RowSampling, make_sampler
from jetflow_jax.speculative import (SpecState, TreeShape, commit_choices, draft_and_verify,
                                     drafter_for, prefill_rows, tree_shape_for)
from jetflow_jax.tree import validate_tree_args


@dataclasses.dataclass(frozen=True)
class Request:
  """One prompt (token ids) and how to continue it; temperature 0 is greedy."""

  prompt: Sequence[int]
  max_tokens: int
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  stop_tokens: Sequence[int] | None = None  # None: the target config's EOS ids


def placed(state: EngineState, config: Qwen3Config, mesh: DecodeMesh | None) -> EngineState:
  """`state` kept where `mesh` runs it: slots over `data`, the target's K/V also over kv heads."""
  if mesh is None:
    return state
  shardings = jax.tree.map(lambda x: mesh.rows() if x.ndim else mesh.replicated(), state)
  cache = jax.tree.map(lambda _: mesh.cache_sharding(config), state.rows.cache)
  return jax.lax.with_sharding_constraint(
      state, shardings.replace(rows=shardings.rows.replace(cache=cache)))


@functools.partial(jax.jit, static_argnames=("config", "drafter", "mesh"))
def prefill(target_params, drafter_params, prompt_bt, prompt_length_b, max_length_b, seed_b,
            sampling: RowSampling, stop_tokens, *, config: Qwen3Config, drafter: Drafter,
            mesh: DecodeMesh | None = None) -> Prefix:
  """One request (batch of 1) through the target and drafter, and its first token."""
  cache, logits_bv, drafter_state = prefill_rows(
      target_params, drafter_params, prompt_bt, prompt_length_b, prompt_bt.shape[1],
      config=config, drafter=drafter, mesh=mesh)
  key_b = jax.vmap(jax.random.key)(seed_b)
  # The prompt's length: below every length a round folds in (see `step`).
  first_b = sampling(jax.vmap(jax.random.fold_in)(key_b, prompt_length_b), logits_bv)
  return Prefix(prompt_bt=prompt_bt, prompt_length_b=prompt_length_b, first_b=first_b,
                max_length_b=max_length_b, cache=cache, drafter_state=drafter_state,
                key_b=key_b, sampling=sampling, stop_tokens=stop_tokens)


@functools.partial(jax.jit, static_argnames=("config", "mesh"), donate_argnames=("state",))
def insert(state: EngineState, prefix: Prefix, slot, *, config: Qwen3Config,
           mesh: DecodeMesh | None = None) -> EngineState:
  """`prefix` into slot `slot` (traced): its rows, length, key and settings."""

  def put(full, one):  # one's row at the start of the slot's row
    return jax.lax.dynamic_update_slice(full, one, (slot,) + (0,) * (full.ndim - 1))

  rows = state.rows
  length_b = prefix.prompt_length_b + 1
  tokens_bs = put(rows.tokens_bs, prefix.prompt_bt).at[slot, length_b[0] - 1].set(
      prefix.first_b[0])
  done_b = (is_stop(prefix.first_b, prefix.stop_tokens) | (length_b >= prefix.max_length_b)
            | (length_b >= rows.capacity))
  rows = rows.replace(
      tokens_bs=tokens_bs, lengths_b=put(rows.lengths_b, length_b),
      max_lengths_b=put(rows.max_lengths_b, prefix.max_length_b),
      done_b=put(rows.done_b, done_b), cache=jax.tree.map(put, rows.cache, prefix.cache),
      drafter_state=jax.tree.map(put, rows.drafter_state, prefix.drafter_state),
      rng=put(rows.rng, prefix.key_b), rounds_b=rows.rounds_b.at[slot].set(0))
  return placed(state.replace(rows=rows,
                              sampling=jax.tree.map(put, state.sampling, prefix.sampling),
                              stop_tokens=put(state.stop_tokens, prefix.stop_tokens),
                              reported_b=put(state.reported_b, prefix.prompt_length_b)),
                config, mesh)


@functools.partial(jax.jit, static_argnames=("config", "mesh"), donate_argnames=("state",))
def evict(state: EngineState, slot, *, config: Qwen3Config,
          mesh: DecodeMesh | None = None) -> EngineState:
  """Frees slot `slot` (traced): a done row of length 1, so attention no longer reads it."""
  rows = state.rows
  rows = rows.replace(done_b=rows.done_b.at[slot].set(True),
                      lengths_b=rows.lengths_b.at[slot].set(1))
  return placed(state.replace(rows=rows, reported_b=state.reported_b.at[slot].set(1)), config,
                mesh)


@functools.partial(jax.jit, static_argnames=("config", "drafter", "tree_shape", "rounds", "impl",
                                             "sampled", "filtered", "mesh"),
                   donate_argnames=("state",))
def step(target_params, drafter_params, state: EngineState, *, config: Qwen3Config,
         drafter: Drafter, tree_shape: TreeShape, rounds: int, impl: str = "xla",
         sampled: bool = True, filtered: bool = True,
         mesh: DecodeMesh | None = None) -> tuple[EngineState, StepOutput]:
  """`rounds` rounds over every slot, and the new tokens.

  The trip count is static and nothing branches on device values (`sampled` / `filtered`
  are `RowSampling`'s host-side promises): on a GPU, a loop or conditional that reads a device
  value makes the host wait for it, and the step would no longer overlap the host loop.
  """

  def one_round(s: EngineState) -> EngineState:
    verified = draft_and_verify(target_params, drafter_params, s.rows, config=config,
                                drafter=drafter, tree_shape=tree_shape, impl=impl, mesh=mesh)
    with jax.named_scope("accept"):
      # A row's committed length is new every round: with its request's key, a fresh draw.
      keys_b = jax.vmap(jax.random.fold_in)(s.rows.rng, s.rows.lengths_b)
      choices_bn = s.sampling(keys_b, verified.logits_bnv, sampled=sampled, filtered=filtered)
    return s.replace(rows=commit_choices(drafter_params, s.rows, verified, choices_bn,
                                         drafter=drafter, stop_tokens=s.stop_tokens))

  state = jax.lax.fori_loop(0, rounds, lambda _, s: one_round(s), state)
  rows = state.rows
  # Between reports a slot gains at most its first token and `rounds` rounds of depth + 1.
  width = rounds * (drafter.depth + 1) + 1
  index_bw = jnp.minimum(state.reported_b[:, None] + jnp.arange(width, dtype=jnp.int32),
                         rows.tokens_bs.shape[1] - 1)
  output = StepOutput(new_bw=jnp.take_along_axis(rows.tokens_bs, index_bw, axis=1),
                      num_new_b=rows.lengths_b - state.reported_b, done_b=rows.done_b,
                      rounds_b=rows.rounds_b)
  return placed(state.replace(reported_b=rows.lengths_b), config, mesh), output


@functools.partial(jax.jit, static_argnames=("config", "drafter", "num_slots", "capacity",
                                             "max_stop_tokens", "mesh"))
def init_state(target_params, drafter_params, *, config: Qwen3Config, drafter: Drafter,
               num_slots: int, capacity: int, max_stop_tokens: int,
               mesh: DecodeMesh | None = None) -> EngineState:
  """Every slot free: done rows of length 1, zero caches."""
  size = capacity + drafter.depth + 1  # a round writes depth + 1 rows past what is committed
  taps = (jnp.zeros((num_slots, 1, len(drafter.tap_layers), config.hidden_size),
                    params_dtype(target_params)) if drafter.tap_layers else None)
  drafter_state = jax.tree.map(
      lambda x: jnp.zeros(x.shape, x.dtype),
      jax.eval_shape(lambda: drafter.init_state(drafter_params, target_params, taps, size)))
  zeros_b = jnp.zeros((num_slots,), jnp.int32)
  rows = SpecState(
      tokens_bs=jnp.zeros((num_slots, size), jnp.int32), lengths_b=zeros_b + 1,
      max_lengths_b=zeros_b, done_b=jnp.ones((num_slots,), bool),
      cache=KVCache.zeros(config, num_slots, size, params_dtype(target_params)),
      drafter_state=drafter_state, rng=jax.vmap(jax.random.key)(zeros_b),
      num_forwards=jnp.zeros((), jnp.int32), rounds_b=zeros_b,
      committed_br=jnp.zeros((num_slots, capacity), jnp.int32))
  sampling = RowSampling(temperature_b=jnp.zeros((num_slots,), jnp.float32), top_k_b=zeros_b,
                         top_p_b=jnp.ones((num_slots,), jnp.float32))
  return placed(EngineState(rows=rows, sampling=sampling,
                            stop_tokens=jnp.full((num_slots, max_stop_tokens), -1, jnp.int32),
                            reported_b=zeros_b + 1), config, mesh)


class Engine:
  """A target (and drafter) behind `num_slots` slots of `max_context` tokens each.

  Shapes are fixed here: slots, context, tree, rounds per step. `prefill` compiles once per
  prompt bucket (powers of two from 16), `insert` likewise, `step` and `evict` once. With
  `mesh`, `target_params` sit where `mesh.param_shardings` says and the slots (a multiple of
  its `data` size) split over `data`; a prefill runs on every copy of the target.
  """

  def __init__(self, target_params, config: Qwen3Config, drafter: Drafter = NoDrafter(),
               drafter_params=None, *, tree_shape: TreeShape = TreeShape("root"),
               num_slots: int = 8, max_context: int = 1024, rounds_per_step: int = 4,
               max_stop_tokens: int = 8, impl: str = "xla", mesh: DecodeMesh | None = None):
    if num_slots < 1 or rounds_per_step < 1 or max_context < 2:
      raise InputError(f"an engine needs num_slots >= 1, rounds_per_step >= 1 and max_context "
                       f">= 2 (got {num_slots}, {rounds_per_step}, {max_context})")
    if mesh is not None:
      if num_slots % mesh.size("data"):
        raise InputError(f"{num_slots} slots do not split over the mesh's {mesh.size('data')} "
                         "data-parallel copies")
      drafter_params = mesh.put(drafter_params, mesh.replicated())
    if tree_shape.kind == "top_n":
      validate_tree_args(drafter.depth, config.vocab_size, tree_shape.budget, tree_shape.top_k)
    self.target_params, self.config = target_params, config
    self.drafter, self.drafter_params = drafter, drafter_params
    self.tree_shape, self.num_slots, self.max_context = tree_shape, num_slots, max_context
    self.rounds_per_step, self.max_stop_tokens, self.impl = rounds_per_step, max_stop_tokens, impl
    self.mesh = mesh

  def init_state(self) -> EngineState:
    """Every slot free."""
    return init_state(self.target_params, self.drafter_params, config=self.config,
                      drafter=self.drafter, num_slots=self.num_slots, capacity=self.max_context,
                      max_stop_tokens=self.max_stop_tokens, mesh=self.mesh)

  def check(self, request: Request) -> tuple[int, ...]:
    """Raises InputError naming what does not fit; returns the request's stop ids."""
    prompt = np.asarray(request.prompt)
    if prompt.ndim != 1 or prompt.size == 0:
      raise InputError("a request needs a prompt of at least one token id")
    if prompt.min() < 0 or prompt.max() >= self.config.vocab_size:
      raise InputError(f"prompt token ids must lie in [0, {self.config.vocab_size})")
    if request.max_tokens < 1:
      raise InputError(f"max_tokens must be >= 1 (got {request.max_tokens})")
    if prompt.size + request.max_tokens > self.max_context:
      raise InputError(f"a prompt of {prompt.size} tokens plus max_tokens {request.max_tokens} "
                       f"exceeds the engine's context of {self.max_context} tokens per slot")
    make_sampler(request.temperature, request.top_k, request.top_p)  # raises on bad values
    if not 0 <= request.seed < 2**32:
      raise InputError(f"seed must lie in [0, 2**32) (got {request.seed})")
    stop = stop_tokens_for(self.config, request.stop_tokens)
    if len(stop) > self.max_stop_tokens:
      raise InputError(f"{len(stop)} stop tokens exceed the engine's max_stop_tokens "
                       f"({self.max_stop_tokens})")
    return stop

  def prefill(self, request: Request) -> Prefix:
    """The request's prompt through the target, its first token drawn; nothing else changes."""
    stop = self.check(request)
    length = len(request.prompt)
    prompt_bt = np.zeros((1, bucket_length(length, self.max_context)), np.int32)
    prompt_bt[0, :length] = request.prompt
    stop_tokens = np.full((1, self.max_stop_tokens), -1, np.int32)
    stop_tokens[0, :len(stop)] = stop
    sampling = RowSampling(temperature_b=np.array([request.temperature], np.float32),
                           top_k_b=np.array([request.top_k], np.int32),
                           top_p_b=np.array([request.top_p], np.float32))
    return prefill(self.target_params, self.drafter_params, prompt_bt,
                   np.array([length], np.int32), np.array([length + request.max_tokens], np.int32),
                   np.array([request.seed], np.uint32), sampling, stop_tokens,
                   config=self.config, drafter=self.drafter, mesh=self.mesh)

  def insert(self, state: EngineState, prefix: Prefix, slot: int) -> EngineState:
    """`prefix` into free slot `slot` (the state is donated)."""
    return insert(state, prefix, np.int32(slot), config=self.config, mesh=self.mesh)

  def step(self, state: EngineState, *, sampled: bool = True,
           filtered: bool = True) -> tuple[EngineState, StepOutput]:
    """`rounds_per_step` rounds over every slot (the state is donated). `sampled=False` or
    `filtered=False` promise that no running request samples or filters (`sampling_flags`):
    a cheaper variant, compiled apart."""
    return step(self.target_params, self.drafter_params, state, config=self.config,
                drafter=self.drafter, tree_shape=self.tree_shape, rounds=self.rounds_per_step,
                impl=self.impl, sampled=sampled, filtered=filtered, mesh=self.mesh)

  def evict(self, state: EngineState, slot: int) -> EngineState:
    """Frees slot `slot` (the state is donated)."""
    return evict(state, np.int32(slot), config=self.config, mesh=self.mesh)


def sampling_flags(requests: Sequence[Request]) -> dict[str, bool]:
  """`Engine.step`'s promises for the requests in the slots: does any sample, any filter?"""
  sampled = [r for r in requests if r.temperature > 0]
  return dict(sampled=bool(sampled),
              filtered=any(r.top_k > 0 or r.top_p < 1.0 for r in sampled))


def make_engine(target_params, target_config: Qwen3Config, head_params=None,
                head_config: HeadConfig | None = None, *, method: str = "jetflow",
                budget: int = 64, top_k: int = 7, attention: str = "xla",
                warn: Callable[[str], None] = print, **options) -> Engine:
  """An engine running `method` (ar, dflash, ddtree, jetflow) as `speculative_generate` does;
  `options` (num_slots, max_context, rounds_per_step, max_stop_tokens, mesh) go to `Engine`."""
  drafter = drafter_for(method, target_config, head_params, head_config, attention, warn)
  return Engine(target_params, target_config, drafter, head_params,
                tree_shape=tree_shape_for(method, budget, top_k), impl=attention, **options)
