"""The engine: a fixed number of slots and four jitted functions over an explicit `EngineState`.

In JetStream's shape: `prefill` runs one request's prompt (padded to a power-of-two bucket, so
few shapes compile) and samples its first token; `insert` copies that prefix into a free slot;
`step` runs `rounds_per_step` rounds (`decoding.round`, the one every method and driver runs)
over every slot (done and free slots commit nothing) and hands back only the new tokens;
`evict` frees a slot. The host loop that calls them is `engine.loop`. An engine made with a
budget `ladder` compiles a step per budget of it, and its host loop picks one every step
(`engine.budgets`).

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
from jetflow_jax.decoding import prefill as prefill_lib
from jetflow_jax.decoding.budget import budget_ladder
from jetflow_jax.decoding.policy import (DEFAULT_BUDGET, DEFAULT_TOP_K, drafter_for,
                                         tree_shape_for)
from jetflow_jax.decoding.round import RoundSpec, TreeShape, decode_round
from jetflow_jax.decoding.state import (DecodeState, StopReason, bucket_length, stop_rows,
                                        stop_tokens_for)
from jetflow_jax.drafters import Drafter, NoDrafter
from jetflow_jax.engine.state import EngineState, StepOutput
from jetflow_jax.errors import InputError
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.mesh import DecodeMesh
from jetflow_jax.model import KVCache, params_dtype
from jetflow_jax.sampling import RowSampling, Sampler, make_sampler


@dataclasses.dataclass(frozen=True)
class Request:
  """One prompt (token ids) and how to continue it; temperature 0 is greedy.

  Attributes:
    prompt: the prompt's token ids.
    max_tokens: the most tokens to generate (stop token included).
    temperature: 0 for greedy, else sampled from the target's distribution at it.
    top_k: keep the k likeliest tokens; 0: all.
    top_p: nucleus mass; 1.0: all.
    seed: the request's key (its tokens depend on it alone, not on its slot or neighbours).
    stop_tokens: the tokens that end it; None: the target config's EOS ids.
    logprobs: the target's log-probabilities of each generated token, and this many likeliest
      alternatives (at most the engine's `top_logprobs`); None: none.
    prompt_logprobs: the same for every prompt token after the first.
  """

  prompt: Sequence[int]
  max_tokens: int
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  stop_tokens: Sequence[int] | None = None  # None: the target config's EOS ids
  # The target's log-probabilities of each generated token, and this many likeliest
  # alternatives (at most the engine's `top_logprobs`); None: none.
  logprobs: int | None = None
  prompt_logprobs: bool = False  # the same for every prompt token after the first

  @property
  def sampler(self) -> Sampler:
    """`Greedy()` or the `Sampling` its settings make."""
    return make_sampler(self.temperature, self.top_k, self.top_p)


def placed(state: EngineState, config: Qwen3Config, mesh: DecodeMesh | None) -> EngineState:
  """`state` kept where `mesh` runs it: slots over `data`, the target's K/V also over kv heads."""
  if mesh is None:
    return state
  shardings = jax.tree.map(lambda x: mesh.rows() if x.ndim else mesh.replicated(), state)
  cache = jax.tree.map(lambda _: mesh.cache_sharding(config), state.rows.cache)
  return jax.lax.with_sharding_constraint(
      state, shardings.replace(rows=shardings.rows.replace(cache=cache)))


@functools.partial(jax.jit, static_argnames=("config", "drafter", "capacity", "top", "ladder",
                                             "prompt_logprobs", "impl", "mesh"))
def prefill(target_params, drafter_params, prompt_bt, prompt_length_b, max_length_b, seed_b,
            sampling: RowSampling, stop_tokens_bk, *, config: Qwen3Config, drafter: Drafter,
            capacity: int, top: int, ladder: int = 0, prompt_logprobs: bool = False,
            impl: str = "xla", mesh: DecodeMesh | None = None) -> DecodeState:
  """One request (a row of its own) through the target and drafter, and its first token: its
  buffers hold the prompt bucket and that token, its capacity is a slot's."""
  return prefill_lib.prefill(
      target_params, drafter_params, prompt_bt, prompt_length_b, max_length_b,
      jax.vmap(jax.random.key)(seed_b), sampling, stop_tokens_bk, config=config,
      drafter=drafter, slots=prompt_bt.shape[1] + 1, capacity=capacity, top=top, ladder=ladder,
      prompt_logprobs=prompt_logprobs, impl=impl, mesh=mesh)


@functools.partial(jax.jit, static_argnames=("config", "mesh"), donate_argnames=("state",))
def insert(state: EngineState, prefix: DecodeState, slot, *, config: Qwen3Config,
           mesh: DecodeMesh | None = None) -> EngineState:
  """`prefix` (one prefilled row) into slot `slot` (traced): every per-row array of it."""

  def put(full, one):  # one's row at the start of the slot's row; scalars stay the engine's
    if not full.ndim:
      return full
    return jax.lax.dynamic_update_slice(full, one.astype(full.dtype),
                                        (slot,) + (0,) * (full.ndim - 1))

  rows = jax.tree.map(put, state.rows, prefix)
  return placed(state.replace(rows=rows, reported_b=put(state.reported_b,
                                                        prefix.lengths_b - 1)), config, mesh)


@functools.partial(jax.jit, static_argnames=("config", "mesh"), donate_argnames=("state",))
def evict(state: EngineState, slot, *, config: Qwen3Config,
          mesh: DecodeMesh | None = None) -> EngineState:
  """Frees slot `slot` (traced): a cancelled row of length 1, so attention no longer reads it."""
  rows = state.rows
  rows = rows.replace(stop_b=rows.stop_b.at[slot].set(StopReason.CANCELLED.code),
                      lengths_b=rows.lengths_b.at[slot].set(1))
  return placed(state.replace(rows=rows, reported_b=state.reported_b.at[slot].set(1)), config,
                mesh)


@functools.partial(jax.jit, static_argnames=("spec", "rounds"), donate_argnames=("state",))
def step(target_params, drafter_params, state: EngineState, *, spec: RoundSpec,
         rounds: int) -> tuple[EngineState, StepOutput]:
  """`rounds` rounds over every slot, and the new tokens.

  The trip count is static and nothing branches on device values (`spec.sampled` /
  `spec.filtered` are host-side promises): on a GPU, a loop or conditional that reads a device
  value makes the host wait for it, and the step would no longer overlap the host loop.
  With `spec.ladder`, each round's prediction and commit count come back too.
  """
  slots = state.reported_b.shape[0]

  def one_round(r, carry):
    rows, predicted_brl, committed_br = carry
    after = decode_round(target_params, drafter_params, rows, spec)
    if spec.ladder:
      predicted_brl = predicted_brl.at[:, r].set(after.predicted_bl)
      committed_br = committed_br.at[:, r].set(
          jnp.where(rows.done_b, -1, after.lengths_b - rows.lengths_b))
    return after, predicted_brl, committed_br

  rows, predicted_brl, committed_br = jax.lax.fori_loop(
      0, rounds, one_round, (state.rows, jnp.zeros((slots, rounds, len(spec.ladder))),
                             jnp.zeros((slots, rounds), jnp.int32)))
  # Between reports a slot gains at most its first token and `rounds` rounds of depth + 1.
  width = rounds * (spec.drafter.depth + 1) + 1
  index_bw = jnp.minimum(state.reported_b[:, None] + jnp.arange(width, dtype=jnp.int32),
                         rows.tokens_bs.shape[1] - 1)
  window = lambda x: jnp.take_along_axis(
      x, index_bw.reshape(index_bw.shape + (1,) * (x.ndim - 2)), axis=1)
  output = StepOutput(new_bw=window(rows.tokens_bs), num_new_b=rows.lengths_b - state.reported_b,
                      stop_b=rows.stop_b, rounds_b=rows.rounds_b)
  if spec.logprobs:
    output = output.replace(logprobs_bw=window(rows.logprobs_bs),
                            top_ids_bwx=window(rows.top_ids_bsx),
                            top_logprobs_bwx=window(rows.top_logprobs_bsx))
  if spec.ladder:
    output = output.replace(predicted_brl=predicted_brl, committed_br=committed_br)
  return placed(EngineState(rows=rows, reported_b=rows.lengths_b), spec.config,
                spec.mesh), output


@functools.partial(jax.jit, static_argnames=("config", "drafter", "num_slots", "capacity",
                                             "max_stop_tokens", "top", "ladder", "mesh"))
def init_state(target_params, drafter_params, *, config: Qwen3Config, drafter: Drafter,
               num_slots: int, capacity: int, max_stop_tokens: int, top: int, ladder: int = 0,
               mesh: DecodeMesh | None = None) -> EngineState:
  """Every slot free: cancelled rows of length 1, zero caches."""
  size = capacity + drafter.depth + 1  # a round writes depth + 1 rows past what is committed
  taps = (jnp.zeros((num_slots, 1, len(drafter.tap_layers), config.hidden_size),
                    params_dtype(target_params)) if drafter.tap_layers else None)
  drafter_state = jax.tree.map(
      lambda x: jnp.zeros(x.shape, x.dtype),
      jax.eval_shape(lambda: drafter.init_state(drafter_params, target_params, taps, size)))
  zeros_b = jnp.zeros((num_slots,), jnp.int32)
  rows = DecodeState(
      tokens_bs=jnp.zeros((num_slots, size), jnp.int32), lengths_b=zeros_b + 1,
      max_lengths_b=zeros_b, stop_b=zeros_b + StopReason.CANCELLED.code,
      cache=KVCache.zeros(config, num_slots, size, params_dtype(target_params)),
      drafter_state=drafter_state, keys_b=jax.vmap(jax.random.key)(zeros_b),
      sampling=RowSampling(temperature_b=jnp.zeros((num_slots,), jnp.float32), top_k_b=zeros_b,
                           top_p_b=jnp.ones((num_slots,), jnp.float32)),
      stop_tokens_bk=jnp.full((num_slots, max_stop_tokens), -1, jnp.int32),
      num_forwards=jnp.zeros((), jnp.int32), rounds_b=zeros_b,
      committed_br=jnp.zeros((num_slots, capacity), jnp.int32),
      logprobs_bs=jnp.zeros((num_slots, size), jnp.float32),
      top_ids_bsx=jnp.zeros((num_slots, size, top), jnp.int32),
      top_logprobs_bsx=jnp.zeros((num_slots, size, top), jnp.float32),
      predicted_bl=jnp.ones((num_slots, ladder), jnp.float32),
      pending_taps_bpld=jnp.zeros((num_slots, 0, len(drafter.tap_layers), config.hidden_size),
                                  params_dtype(target_params)),
      pending_from_b=zeros_b)
  return placed(EngineState(rows=rows, reported_b=zeros_b + 1), config, mesh)


class Engine:
  """A target (and drafter) behind `num_slots` slots of `max_context` tokens each.

  Shapes are fixed here: slots, context, tree, rounds per step. `prefill` compiles once per
  prompt bucket (powers of two from 16), `insert` likewise, `step` and `evict` once. With a
  `ladder` of budgets (`budget.budget_ladder`, the largest `tree_shape.budget`), `step` runs any
  of them, each compiled apart; its rounds then predict every budget's tokens. With
  `mesh`, `target_params` sit where `mesh.param_shardings` says and the slots (a multiple of
  its `data` size) split over `data`; a prefill runs on every copy of the target.

  Most code builds one with `make_engine` and drives it with an `Orchestrator`.

  Args:
    target_params: the target's params.
    config: the target's config.
    drafter: the `Drafter` (`NoDrafter` for AR).
    drafter_params: its params.
    tree_shape: the tree a round verifies (with a ladder: its largest budget).
    num_slots: requests decoded at once.
    max_context: tokens a slot holds, prompt and generated.
    rounds_per_step: rounds a `step` runs before handing back tokens.
    max_stop_tokens: the most stop tokens a request may have.
    top_logprobs: the most alternatives a request's log-probabilities may ask for.
    impl: the attention path (`xla`, `pallas`, `pallas_tpu`).
    ladder: budgets a step may run at, from AR (1) up to `tree_shape.budget`; () for one.
    mesh: a `DecodeMesh`, or None.

  Raises:
    InputError: a ladder without a tree of its largest budget, fewer than one slot or round,
      a context under 2, slots that do not split over the mesh, or a tree the drafter cannot
      give.
  """

  def __init__(self, target_params, config: Qwen3Config, drafter: Drafter = NoDrafter(),
               drafter_params=None, *, tree_shape: TreeShape = TreeShape("root"),
               num_slots: int = 8, max_context: int = 1024, rounds_per_step: int = 4,
               max_stop_tokens: int = 8, top_logprobs: int = 20, impl: str = "xla",
               ladder: tuple[int, ...] = (), mesh: DecodeMesh | None = None):
    if ladder and (tree_shape.kind not in ("top_n", "accum") or ladder[0] != 1
                   or ladder[-1] != tree_shape.budget):
      raise InputError(f"a budget ladder {ladder} needs a tree (ddtree or jetflow) of its "
                       f"largest budget, from AR (1) up")
    if num_slots < 1 or rounds_per_step < 1 or max_context < 2:
      raise InputError(f"an engine needs num_slots >= 1, rounds_per_step >= 1 and max_context "
                       f">= 2 (got {num_slots}, {rounds_per_step}, {max_context})")
    if mesh is not None:
      if num_slots % mesh.size("data"):
        raise InputError(f"{num_slots} slots do not split over the mesh's {mesh.size('data')} "
                         "data-parallel copies")
      drafter_params = mesh.put(drafter_params, mesh.replicated())
    tree_shape.validate(drafter, config)
    self.target_params, self.config = target_params, config
    self.drafter, self.drafter_params = drafter, drafter_params
    self.tree_shape, self.num_slots, self.max_context = tree_shape, num_slots, max_context
    self.rounds_per_step, self.max_stop_tokens, self.impl = rounds_per_step, max_stop_tokens, impl
    self.top_logprobs, self.mesh = min(top_logprobs, config.vocab_size), mesh
    self.ladder = tuple(ladder)

  def spec(self, budget: int | None = None, *, sampled: bool = True, filtered: bool = True,
           logprobs: bool = False, taps: bool = True) -> RoundSpec:
    """The round a step runs at `budget` (a ladder value; None: `tree_shape`'s); `taps=False`
    (AR only): the drafter's context is left as it is (`RoundSpec.taps`).

    Raises:
      InputError: a budget not on the ladder, or `taps=False` with a tree.
    """
    shape = self.tree_shape
    if budget is not None and budget != shape.budget:
      if budget not in self.ladder:
        raise InputError(f"budget {budget} is not on this engine's ladder {self.ladder}")
      shape = TreeShape("root") if budget == 1 else dataclasses.replace(shape, budget=budget)
    if not taps and shape.kind != "root":
      raise InputError(f"only an AR step may leave the drafter's context behind (budget {budget})")
    if self.ladder:  # two variants a budget: greedy without log-probabilities, and any request
      sampled = filtered = logprobs = sampled or filtered or logprobs
    return RoundSpec(config=self.config, drafter=self.drafter, tree_shape=shape, impl=self.impl,
                     sampled=sampled, filtered=filtered, logprobs=logprobs, ladder=self.ladder,
                     mesh=self.mesh, taps=taps)

  def init_state(self) -> EngineState:
    """Every slot free."""
    return init_state(self.target_params, self.drafter_params, config=self.config,
                      drafter=self.drafter, num_slots=self.num_slots, capacity=self.max_context,
                      max_stop_tokens=self.max_stop_tokens, top=self.top_logprobs,
                      ladder=len(self.ladder), mesh=self.mesh)

  def check(self, request: Request) -> tuple[int, ...]:
    """Checks `request` against this engine.

    Returns:
      The request's stop ids.

    Raises:
      InputError: naming what does not fit (an empty prompt, ids outside the vocabulary,
        `max_tokens` < 1 or beyond the context, bad sampling settings, log-probabilities,
        seed or stop tokens out of range).
    """
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
    request.sampler  # raises on bad values
    if request.logprobs is not None and not 0 <= request.logprobs <= self.top_logprobs:
      raise InputError(f"logprobs must lie in [0, {self.top_logprobs}] (got {request.logprobs})")
    if not 0 <= request.seed < 2**32:
      raise InputError(f"seed must lie in [0, 2**32) (got {request.seed})")
    stop = stop_tokens_for(self.config, request.stop_tokens)
    if len(stop) > self.max_stop_tokens:
      raise InputError(f"{len(stop)} stop tokens exceed the engine's max_stop_tokens "
                       f"({self.max_stop_tokens})")
    return stop

  def prefill(self, request: Request) -> DecodeState:
    """The request's prompt through the target, its first token drawn: a row of its own, to
    `insert` into a slot; nothing else changes.

    Raises:
      InputError: what `check` refuses.
    """
    stop = self.check(request)
    length = len(request.prompt)
    prompt_bt = np.zeros((1, bucket_length(length, self.max_context)), np.int32)
    prompt_bt[0, :length] = request.prompt
    return prefill(self.target_params, self.drafter_params, prompt_bt,
                   np.array([length], np.int32), np.array([length + request.max_tokens], np.int32),
                   np.array([request.seed], np.uint32), RowSampling.of([request.sampler]),
                   stop_rows([stop], self.max_stop_tokens), config=self.config,
                   drafter=self.drafter, capacity=self.max_context, top=self.top_logprobs,
                   ladder=len(self.ladder), prompt_logprobs=request.prompt_logprobs,
                   impl=self.impl, mesh=self.mesh)

  def insert(self, state: EngineState, prefix: DecodeState, slot: int) -> EngineState:
    """`prefix` into free slot `slot` (the state is donated)."""
    return insert(state, prefix, np.int32(slot), config=self.config, mesh=self.mesh)

  def step(self, state: EngineState, budget: int | None = None, *, sampled: bool = True,
           filtered: bool = True, logprobs: bool = False,
           taps: bool = True) -> tuple[EngineState, StepOutput]:
    """`rounds_per_step` rounds at `budget` over every slot (the state is donated).

    `sampled=False` or `filtered=False` promise that no running request samples or filters
    (`sampling.sampling_flags`), `logprobs=False` that none wants log-probabilities: cheaper
    variants, compiled apart. `taps=False` (AR, with a ladder: a step over requests that will not
    draft again) neither computes nor keeps taps for the drafter: plain AR's round.

    Returns:
      `(state, output)`: the next state and the `StepOutput` (only the new tokens).
    """
    spec = self.spec(budget, sampled=sampled, filtered=filtered, logprobs=logprobs, taps=taps)
    return step(self.target_params, self.drafter_params, state, spec=spec,
                rounds=self.rounds_per_step)

  def evict(self, state: EngineState, slot: int) -> EngineState:
    """Frees slot `slot` (the state is donated)."""
    return evict(state, np.int32(slot), config=self.config, mesh=self.mesh)


def make_engine(target_params, target_config: Qwen3Config, head_params=None,
                head_config: HeadConfig | None = None, *, method: str = "jetflow",
                budget: int | str = DEFAULT_BUDGET, top_k: int = DEFAULT_TOP_K,
                max_budget: int = 256, attention: str = "xla",
                warn: Callable[[str], None] = print, **options) -> Engine:
  """An engine running `method` (ar, dflash, ddtree, jetflow) as `speculative_generate` does.

  Args:
    target_params: the target's params.
    target_config: the target's config.
    head_params: the draft head's params (None for ar).
    head_config: its config (None for ar).
    method: `ar`, `dflash`, `ddtree` or `jetflow`.
    budget: tree nodes a round verifies; `"auto"` gives ddtree and jetflow the ladder up to
      `max_budget`, one budget chosen every step by its host loop.
    top_k: candidate children per depth.
    max_budget: the top of the ladder with `budget="auto"`.
    attention: `xla`, `pallas` or `pallas_tpu`.
    warn: how the ablation warning is given (a head of the other kind).
    **options: `num_slots`, `max_context`, `rounds_per_step`, `max_stop_tokens`,
      `top_logprobs`, `mesh`: they go to `Engine`.

  Returns:
    The `Engine`.

  Raises:
    InputError: what `drafter_for` and `Engine` refuse.
    ConfigError: a head that does not fit the target.
  """
  drafter = drafter_for(method, target_config, head_params, head_config, attention, warn)
  fixed = max_budget if budget == "auto" else budget
  ladder = budget_ladder(fixed) if budget == "auto" and method in ("ddtree", "jetflow") else ()
  return Engine(target_params, target_config, drafter, None if method == "ar" else head_params,
                tree_shape=tree_shape_for(method, fixed, top_k), impl=attention, ladder=ladder,
                **options)
