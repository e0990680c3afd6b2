"""The device loop: rounds in one jitted `lax.while_loop` until every row is done, and the host
driver that decodes a batch of prompts with it (compiled ahead of time, optionally streamed).

`max_new_tokens` is a traced value and prompts are padded to power-of-two buckets, so neither
recompiles.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jetflow_jax.config import Qwen3Config
from jetflow_jax.decoding.auto import (auto_specs, drafts_ahead, head_record_key, round_seconds,
                                       run_auto)
from jetflow_jax.decoding.budget import (HeadRecord, cost_tables_path, load_head_record,
                                         save_head_record)
from jetflow_jax.decoding.prefill import prefill
from jetflow_jax.decoding.round import RoundSpec, TreeShape, decode_round, flush_pending
from jetflow_jax.decoding.state import (DecodeState, StopReason, default_cache_size, pad_prompts,
                                        stop_rows, stop_tokens_for)
from jetflow_jax.distributed import agreed, to_host
from jetflow_jax.drafters import Drafter, NoDrafter, drafter_prior
from jetflow_jax.errors import InputError
from jetflow_jax.mesh import DecodeMesh
from jetflow_jax.model import params_dtype
from jetflow_jax.partitioning import KEEP, abstract, kernel_layout
from jetflow_jax.sampling import Greedy, RowSampling, Sampler, sampling_flags

STREAM_INTERVAL_S = 0.1  # streamed text arrives at least this often once chunks have grown


def decode_rounds(target_params, drafter_params, state: DecodeState, max_rounds, *,
                  spec: RoundSpec) -> DecodeState:
  """Up to `max_rounds` rounds (traced) in one `lax.while_loop`, until every row is done."""

  def cond(carry):
    count, s = carry
    return (count < max_rounds) & ~jnp.all(s.done_b)

  def body(carry):
    count, s = carry
    return count + 1, decode_round(target_params, drafter_params, s, spec)

  return jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state))[1]


decode = jax.jit(decode_rounds, static_argnames=("spec",), donate_argnames=("state",))


# What a streamed loop hands the host, copied on device (the next chunk takes the state).
snapshot = jax.jit(lambda state: (jnp.copy(state.tokens_bs), jnp.copy(state.lengths_b),
                                  jnp.all(state.done_b)))


@dataclasses.dataclass
class Generation:
  """Generated token ids per prompt (stop token included) and how they were made.

  What `generate`, `speculative_generate` and `decode_prompts` return.

  Attributes:
    tokens: per row, the generated token ids (the prompt left out, a stop token kept).
    committed_per_round: per row, the tokens each round committed (bonus included).
    stop_reasons: per row, why it stopped (`StopReason`: `stop_token`, `max_tokens`,
      `cache_full`, `cancelled`).
    num_forwards: target forward passes, prefill included.
    compile_s: ahead-of-time compilation of prefill and the loop.
    wall_s: prefill + decoding; compilation, warm-up and a budget calibration excluded.
    budgets: with auto, each round's budget.
    calibrate_s: with auto, timing each budget's round, when the cost table did not have it.
    warmup_s: first executions of the programs, on scratch state (auto, `warmup`).
    budget_reason: with auto, why its first round's budget (`auto.Chooser.why`).
  """

  tokens: list[list[int]]
  committed_per_round: list[list[int]]  # per row: tokens each round committed (bonus included)
  stop_reasons: list[StopReason]  # per row
  num_forwards: int  # target forward passes, prefill included
  compile_s: float  # ahead-of-time compilation of prefill and the loop
  wall_s: float  # prefill + decoding, compilation (and a budget calibration) excluded
  budgets: list[int] = dataclasses.field(default_factory=list)  # with auto: each round's budget
  calibrate_s: float = 0.0  # with auto: timing each budget's round, when not known already
  warmup_s: float = 0.0  # first executions of the programs, on scratch state (auto, `warmup`)
  budget_reason: str = ""  # with auto: why its first round's budget

  @property
  def num_tokens(self) -> int:
    """Generated tokens, all rows."""
    return sum(len(t) for t in self.tokens)

  @property
  def tau(self) -> float:
    """Tokens committed per verifying target forward, bonus included, over all rows."""
    rounds = sum(len(r) for r in self.committed_per_round)
    return sum(map(sum, self.committed_per_round)) / rounds if rounds else 0.0

  def row_tau(self, row: int) -> float:
    """`tau` of one row."""
    rounds = self.committed_per_round[row]
    return sum(rounds) / len(rounds) if rounds else 0.0


@dataclasses.dataclass(frozen=True)
class Rows:
  """A batch's host-side inputs of `prefill`, one row per prompt."""

  prompt_bt: np.ndarray
  lengths_b: np.ndarray
  max_lengths_b: np.ndarray
  keys_b: jax.Array
  sampling: RowSampling
  stop_tokens_bk: np.ndarray

  def args(self):
    return (self.prompt_bt, self.lengths_b, self.max_lengths_b, self.keys_b, self.sampling,
            self.stop_tokens_bk)


def batch_rows(prompts: Sequence[Sequence[int]], max_new_tokens: int, cache_size: int,
               sampler: Sampler, seed: int, stop_tokens: tuple[int, ...]) -> Rows:
  """Every prompt with the same settings; row b's key is `key(seed)` folded with b."""
  prompt_bt, lengths_b = pad_prompts(prompts, cache_size)
  batch = len(prompts)
  return Rows(prompt_bt=prompt_bt, lengths_b=lengths_b, max_lengths_b=lengths_b + max_new_tokens,
              keys_b=jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed),
                                                             jnp.arange(batch)),
              sampling=RowSampling.of([sampler] * batch),
              stop_tokens_bk=stop_rows([stop_tokens] * batch))


PENDING_ROUNDS = 256


def pending_rounds(spec: RoundSpec, prompt_width: int, capacity: int) -> int:
  """How many AR rounds in a row may keep their taps back from the drafter, for the loop that
  chooses budgets (its AR runs go back to the host this seldom at least; 0 otherwise).

  From the shapes alone (a compiled loop is reused for any prompt of its bucket): the longest
  prompt of a batch padded to `prompt_width` is longer than half of it (above the smallest
  bucket), so its row runs fewer than `capacity - prompt_width // 2` rounds; shorter rows may
  flush more often.
  """
  if not (spec.ladder and spec.drafter.tap_layers):
    return 0
  return max(1, min(PENDING_ROUNDS, capacity - prompt_width // 2))


MAPS_SHARE = 0.75  # of the memory maps Linux allows a process, past which executables are let go


def memory_maps() -> tuple[int, int] | None:
  """(memory maps this process holds, the most Linux allows it: vm.max_map_count), or None
  where /proc does not tell."""
  try:
    with open("/proc/self/maps", "rb") as f:
      held = f.read().count(b"\n")
    with open("/proc/sys/vm/max_map_count") as f:
      return held, int(f.read())
  except (OSError, ValueError):
    return None


class CompileCache:
  """Executables by shapes and statics, with counts (what ran can be told from what is new),
  and which of them have run once (`warmed`)."""

  def __init__(self):
    self.entries, self.hits, self.misses = {}, 0, 0
    self.warmed: set[int] = set()

  def get(self, key, build: Callable[[], Any]):
    if key in self.entries:
      self.hits += 1
    else:
      self.misses += 1
      self.release_if_crowded()
      self.entries[key] = build()
    return self.entries[key]

  def release_if_crowded(self, share: float = MAPS_SHARE) -> bool:
    """Lets go of every executable kept here and in jax's caches once this process holds more
    than `share` of the memory maps it may: an XLA:CPU executable holds a few hundred (the code
    and data of its kernels), and at the limit building or loading one more fails ("LLVM
    compilation error: Cannot allocate memory", then a crash). A long-lived process that
    compiles many shapes (a benchmark's sweep, a test worker) would get there; what runs next
    is compiled again or read from the persistent compilation cache. Returns whether it did."""
    maps = memory_maps()
    if maps is None or maps[0] <= share * maps[1]:
      return False
    self.entries.clear()
    self.warmed.clear()
    jax.clear_caches()
    return True


compiled = CompileCache()


def compile_flush(drafter_params, prefill_fn, drafter: Drafter, mesh: DecodeMesh | None):
  """`flush_pending` compiled for the state `prefill_fn` makes (kept with it), the state coming
  out where the prefill put it (over a mesh, the rounds' programs take it only there)."""
  shardings = None if mesh is None else prefill_fn.output_shardings

  def build():
    flush = jax.jit(flush_pending, static_argnames=("drafter",), donate_argnames=("state",),
                    out_shardings=shardings)
    return flush.lower(abstract(drafter_params, KEEP if mesh is not None else None),
                       abstract(prefill_fn.out_info, shardings), drafter=drafter).compile()

  # The entry holds the prefill too, so that its id names no other program while it is kept.
  return compiled.get(("flush", id(prefill_fn), drafter), lambda: (prefill_fn, build()))[1]


def compile_decode(target_params, drafter_params, rows: Rows, spec: RoundSpec, capacity: int,
                   compiler_options: tuple[tuple[str, Any], ...] = ()):
  """Ahead-of-time compiled (prefill, decode) for these shapes; kept for reuse.

  The params may be arrays or abstract values; with `spec.mesh`, they are taken where they are
  (the caller placed them) and the rows and decode state where the mesh puts them.
  `compiler_options` (pairs) go to XLA (the memory report asks for buffer dumps).
  """
  mesh = spec.mesh
  params = abstract((target_params, drafter_params), KEEP if mesh is not None else None)
  row_args = abstract(rows.args(), None if mesh is None else mesh.rows())
  int_scalar = abstract(jnp.int32(0), None if mesh is None else mesh.replicated())
  shapes = (jax.tree.structure(params), tuple((x.shape, x.dtype) for x in jax.tree.leaves(params)),
            tuple((x.shape, x.dtype) for x in jax.tree.leaves(row_args)), capacity,
            compiler_options)
  options = dict(compiler_options) or None
  prefill_statics = dict(config=spec.config, drafter=spec.drafter,
                         slots=capacity + spec.drafter.depth + 1, capacity=capacity,
                         ladder=len(spec.ladder),
                         pending=pending_rounds(spec, rows.prompt_bt.shape[1], capacity),
                         sampled=spec.sampled, filtered=spec.filtered, impl=spec.impl,
                         mesh=mesh)

  def build_prefill():
    executable = prefill.lower(*params, *row_args, **prefill_statics).compile(options)
    state = executable.out_info
    return executable, state if mesh is None else abstract(state, executable.output_shardings)

  # One prefill for every tree shape (the budgets of auto share it).
  prefill_fn, state = compiled.get(shapes + tuple(prefill_statics.items()), build_prefill)

  def build_decode():
    # Over a mesh the state comes out where it went in: a loop run in several calls (streaming,
    # auto) feeds each call's state to the next, and a compiled program takes it only there.
    program = decode if mesh is None else jax.jit(
        decode_rounds, static_argnames=("spec",), donate_argnames=("state",),
        out_shardings=jax.tree.map(lambda x: x.sharding, state))
    return program.lower(*params, state, int_scalar, spec=spec).compile(options)

  decode_fn = compiled.get(shapes + (spec,), build_decode)
  return prefill_fn, decode_fn


def warm_up(prefill_fn, decode_fns: Sequence, flush_fn, target_params, drafter_params,
            args) -> float:
  """Runs each program not run before in this process once, on scratch state; returns the
  seconds it took. A program's first execution costs far more than the next (the CPU
  runtime readies its kernels then, whether it was just compiled or read from the
  compilation cache), and it belongs to no request's clock."""
  cold = [fn for fn in (prefill_fn, *decode_fns, flush_fn)
          if fn is not None and id(fn) not in compiled.warmed]
  if not cold:
    return 0.0
  start = time.perf_counter()
  state = prefill_fn(target_params, drafter_params, *args)
  for decode_fn in decode_fns:
    if id(decode_fn) not in compiled.warmed:
      jax.block_until_ready(decode_fn(target_params, drafter_params,
                                      jax.tree.map(jnp.copy, state), 1))
  jax.block_until_ready(snapshot(state))  # streaming's copy, compiled at its first call
  if flush_fn is not None:
    jax.block_until_ready(flush_fn(drafter_params, state))
  else:
    jax.block_until_ready(state)
  compiled.warmed.update(id(fn) for fn in cold)
  return time.perf_counter() - start


def decode_prompts(target_params, config: Qwen3Config, drafter: Drafter, drafter_params,
                   prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                   tree_shape: TreeShape, sampler: Sampler = Greedy(), seed: int = 0,
                   cache_size: int | None = None, stop_tokens: Sequence[int] | None = None,
                   impl: str = "xla",
                   on_tokens: Callable[[list[list[int]]], None] | None = None,
                   stream_every: int = 4, mesh: DecodeMesh | None = None,
                   auto: bool | Sequence[int] = False, warmup: bool = False) -> Generation:
  """Decodes a batch of prompts (lists of token ids) with any drafter and tree shape.

  `generate` and `speculative_generate` are thin calls of this; a drafter of your own plugs
  in here (`jetflow_jax.drafters.Drafter`). Whatever the drafter proposes, greedy output is the
  target's greedy output and sampled output follows the target's distribution.

  Args:
    target_params: the target's params.
    config: the target's config.
    drafter: a `Drafter` (hashable: it is static in the compiled round).
    drafter_params: its params pytree (None for `NoDrafter`).
    prompts: one list of token ids per row; rows of any lengths stop independently.
    max_new_tokens: the most tokens a row generates (stop token included).
    tree_shape: how a round turns the draft into a tree (`TreeShape("root")` with
      `NoDrafter` is AR).
    sampler: `Greedy()` or `Sampling(temperature, top_k, top_p)`.
    seed: row b draws with `fold_in(key(seed), b)`.
    cache_size: KV cache slots; by default a power of two that fits the longest prompt plus
      `max_new_tokens`.
    stop_tokens: the tokens that end a row; by default the config's EOS ids.
    impl: the attention path, `xla` or a Pallas kernel (`pallas`, `pallas_tpu`).
    on_tokens: with it, the host regains control every `stream_every` rounds and is given the
      tokens so far, per row (streaming); otherwise one jitted loop runs to the end. Both give
      the same tokens.
    stream_every: rounds between calls of `on_tokens`, at first.
    mesh: a `DecodeMesh`; `target_params` must be placed as `mesh.param_shardings` says; the
      drafter's params are replicated over it here and the rows split over its `data` axis. In
      a multi-process job every process passes the same arguments (`on_tokens` on all or none).
    auto: True chooses each round's budget on the ladder up to `tree_shape.budget`
      (`decoding.auto`): the round of each budget compiles, and is timed once per shape; a
      request that will not draft (`auto.drafts_ahead`) runs plain AR's programs instead. A
      sequence of ladder budgets runs them in turn.
    warmup: with it (or `auto`), every program runs once on scratch state before the clock
      starts (`warm_up`; its time is `Generation.warmup_s`), so `wall_s` holds no first
      executions.

  Returns:
    A `Generation`: each row's tokens, the tokens each round committed, why each row stopped,
    and timings.

  Raises:
    InputError: `max_new_tokens` < 1, a budget or top-k the tree cannot hold, an empty
      prompt, a prompt that does not fit the cache, or prompts that do not split over the
      mesh.
  """
  if max_new_tokens < 1:
    raise InputError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
  tree_shape.validate(drafter, config)
  if cache_size is None:
    cache_size = default_cache_size(config, prompts, max_new_tokens)
  stop = stop_tokens_for(config, stop_tokens)
  rows = batch_rows(prompts, max_new_tokens, cache_size, sampler, seed, stop)
  args = rows.args()
  if mesh is not None:
    if len(prompts) % mesh.size("data"):
      raise InputError(f"{len(prompts)} prompts do not split over the mesh's "
                       f"{mesh.size('data')} data-parallel rows")
    drafter_params = mesh.put(drafter_params, mesh.replicated())
    args = mesh.put(args, mesh.rows())
  spec = RoundSpec(config=config, drafter=drafter, tree_shape=tree_shape, impl=impl, mesh=mesh,
                   **sampling_flags([sampler]))
  specs = auto_specs(spec) if auto else [spec]
  width = rows.prompt_bt.shape[1]
  pending = pending_rounds(specs[0], width, cache_size)
  ready = functools.cache(lambda: ready_programs(target_params, drafter_params, rows, args, specs,
                                                 cache_size, pending, bool(auto or warmup)))
  calibrate_s, budgets, reason = 0.0, [], ""
  seconds_l, flush_s = np.ones(len(specs)), 0.0  # a schedule's: no times
  record = HeadRecord({}, specs[0].ladder)
  if auto is True:
    calibrating = time.perf_counter()
    seconds_l, flush_s = round_seconds(
        specs, lambda: ready().scratch(target_params, drafter_params, args), len(prompts),
        str(params_dtype(target_params)), width, cache_size, kernel_layout(target_params),
        pending > 0)
    record = load_head_record(cost_tables_path(), head_record_key(specs[-1], drafter_params),
                              specs[-1].ladder,
                              drafter_prior(specs[-1].drafter, drafter_params, specs[-1].ladder))
    timed = ready() if ready.cache_info().currsize else None  # built to time their rounds
    calibrate_s = time.perf_counter() - calibrating - (timed.ready_s if timed else 0.0)
    drafts, reason = drafts_ahead(record, specs[0].ladder, seconds_l, flush_s, pending,
                                  len(prompts), max_new_tokens)
    if not drafts:
      return plain_ar_for_auto(target_params, config, prompts, max_new_tokens, record,
                               float(seconds_l[0]), calibrate_s, timed, reason, sampler=sampler,
                               seed=seed, cache_size=cache_size, stop_tokens=stop_tokens,
                               impl=impl, on_tokens=on_tokens, stream_every=stream_every,
                               mesh=mesh)
  programs = ready()
  start = time.perf_counter()
  state = programs.prefill(target_params, drafter_params, *args)
  if auto:
    state, budgets, reason = run_auto(state, programs.advance_l, programs.flush, specs[0].ladder,
                                      seconds_l, flush_s, pending, rows.lengths_b, record,
                                      on_tokens, None if auto is True else auto, programs.finish)
  else:
    state = run_loop(state, programs.advance_l[0], max_new_tokens, rows.lengths_b, on_tokens,
                     stream_every)
  tokens = new_tokens(state, rows.lengths_b)
  wall_s = time.perf_counter() - start
  if auto is True:
    save_head_record(cost_tables_path(), record)
  rounds, committed, stop_b, num_forwards = to_host(
      (state.rounds_b, state.committed_br, state.stop_b, state.num_forwards))
  return Generation(
      tokens=tokens,
      committed_per_round=[committed[b, :rounds[b]].tolist() for b in range(len(prompts))],
      stop_reasons=[StopReason.of_code(int(code)) for code in stop_b],
      num_forwards=int(num_forwards), compile_s=programs.compile_s, wall_s=wall_s,
      budgets=budgets, calibrate_s=calibrate_s, warmup_s=programs.warmup_s,
      budget_reason=reason)


@dataclasses.dataclass
class LoopPrograms:
  """One `decode_prompts` call's compiled programs, params bound: the prefill, a loop per
  spec (taking (state, rounds)), and, for a drafter with taps under auto, the flush of the
  held-back context and `finish` (AR rounds that keep no taps); with the seconds it took to
  compile and to warm them up."""

  prefill: Callable
  advance_l: list[Callable]
  flush: Callable | None
  finish: Callable | None
  compile_s: float
  warmup_s: float

  @property
  def ready_s(self) -> float:
    return self.compile_s + self.warmup_s

  def scratch(self, target_params, drafter_params, args):
    """What `auto.round_seconds` measures: the loops, the flush, and a state to copy."""
    return self.advance_l, self.flush, self.prefill(target_params, drafter_params, *args)


def ready_programs(target_params, drafter_params, rows: Rows, args, specs: Sequence[RoundSpec],
                   cache_size: int, pending: int, warm: bool) -> LoopPrograms:
  """Compiles (or takes from the cache) every program a call may run and, with `warm`, runs
  each not run before once on scratch state (`warm_up`)."""
  start = time.perf_counter()
  compiled_l = [compile_decode(target_params, drafter_params, rows, s, cache_size) for s in specs]
  prefill_fn = compiled_l[0][0]
  decode_fns = [fn for _, fn in compiled_l]
  flush_exe = flush_fn = finish_fn = None
  if pending:  # a drafter with taps, under auto
    flush_exe = compile_flush(drafter_params, prefill_fn, specs[0].drafter, specs[0].mesh)
    flush_fn = functools.partial(flush_exe, drafter_params)
    # AR rounds that keep no taps: a request's rest once nothing will draft in it again.
    _, finish_exe = compile_decode(target_params, drafter_params, rows,
                                   dataclasses.replace(specs[0], taps=False), cache_size)
    finish_fn = functools.partial(finish_exe, target_params, drafter_params)
    decode_fns.append(finish_exe)
  compile_s = time.perf_counter() - start
  warmup_s = (warm_up(prefill_fn, decode_fns, flush_exe, target_params, drafter_params, args)
              if warm else 0.0)
  return LoopPrograms(
      prefill=prefill_fn, compile_s=compile_s, warmup_s=warmup_s, flush=flush_fn,
      finish=finish_fn, advance_l=[functools.partial(decode_fn, target_params, drafter_params)
                                   for _, decode_fn in compiled_l])


def plain_ar_for_auto(target_params, config: Qwen3Config, prompts, max_new_tokens: int,
                      record: HeadRecord, ar_round_s: float, calibrate_s: float,
                      timed: LoopPrograms | None, reason: str, **options) -> Generation:
  """A request under auto that will not draft (`auto.drafts_ahead`), decoded by plain AR's
  programs from the prefill on, as `generate` would; `record` counts its AR time and is
  kept. `timed`: the ladder's programs where they were built to time their rounds (their
  compilation and warm-up are this call's too)."""
  result = decode_prompts(target_params, config, NoDrafter(), None, prompts, max_new_tokens,
                          tree_shape=TreeShape("root"), warmup=True, **options)
  rounds = max(map(len, result.committed_per_round))
  record.add_unseen(rounds * ar_round_s)
  save_head_record(cost_tables_path(), record)
  return dataclasses.replace(
      result, budgets=[1] * rounds, calibrate_s=calibrate_s, budget_reason=reason,
      compile_s=result.compile_s + (timed.compile_s if timed else 0.0),
      warmup_s=result.warmup_s + (timed.warmup_s if timed else 0.0))


def new_tokens(state: DecodeState, prompt_lengths_b) -> list[list[int]]:
  """Each row's generated tokens."""
  tokens, lengths = to_host((state.tokens_bs, state.lengths_b))
  return [tokens[b, p:lengths[b]].tolist() for b, p in enumerate(prompt_lengths_b)]


def run_loop(state: DecodeState, advance: Callable, max_rounds: int, prompt_lengths_b,
             on_tokens, stream_every: int) -> DecodeState:
  """Runs `advance(state, rounds)` until every row is done.

  Without `on_tokens`, one call. With it, chunks of at first `stream_every` rounds; the
  tokens so far are copied on device and handed to the host while the device already runs
  the next chunk. Each chunk launch has a fixed cost, so chunks grow until they last about
  `STREAM_INTERVAL_S`: streaming then costs a few percent at most. A chunk dispatched
  after the last row finished does nothing.
  """
  if on_tokens is None:
    return advance(state, max_rounds)
  rounds = stream_every
  last = time.perf_counter()
  while True:
    before = snapshot(state)
    state = advance(state, rounds)
    tokens, lengths, all_done = to_host(before)
    on_tokens([tokens[b, p:lengths[b]].tolist() for b, p in enumerate(prompt_lengths_b)])
    if all_done:
      return state
    now = time.perf_counter()
    if agreed(np.int32(now - last < STREAM_INTERVAL_S)):
      rounds = min(2 * rounds, max_rounds)
    last = now
