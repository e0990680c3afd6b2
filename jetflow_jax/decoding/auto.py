"""`--budget auto` in the device loop's host driver: each round's tree budget chosen on a ladder
(AR, 4, 8, ..., the largest) from what a round of each budget costs here and what each row's
draft predicts, calibrated against what the row accepted (`budget.py` holds those pieces).

The host decides between short runs of the device loop: one round at a time while trees pay
(each round's prediction and acceptance update the model), longer runs of AR rounds while they
do not (no draft runs then, so nothing new is learnt), with a tree probe now and then whose
cost is held to a small share of the AR time. Every budget's round is one compiled variant;
its time is measured once per shape (a few rounds on copies of the state) and kept, in this
process and in the cost tables file (`budget.cost_tables_path()`) for the next.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jetflow_jax.decoding.budget import (AcceptanceModel, best_budget, budget_ladder, cost_key,
                                         cost_tables_path, kept_seconds)
from jetflow_jax.decoding.round import RoundSpec, TreeShape
from jetflow_jax.decoding.state import DecodeState
from jetflow_jax.distributed import agreed, to_host
from jetflow_jax.errors import InputError

TIMED_RUNS = 5  # timed 2-round runs per budget, after a warm-up; the fastest counts (a busy
# machine only ever adds time)
AR_RUN_S = 0.5  # AR rounds run back to back for about this long between two decisions
PROBE_SHARE = 0.02  # a probe's cost at most this share of the AR rounds between probes
STREAM_INTERVAL_S = 0.05

_seconds: dict = {}  # round times by (specs, shapes), measured or read in this process
# What a probe from AR cost, flush of the held-back context included, by shapes: the
# flush is not in the round times, and spacing probes by the round alone probed too often.
_probe_seconds: dict = {}


def auto_specs(spec: RoundSpec) -> list[RoundSpec]:
  """One round per budget of the ladder up to `spec.tree_shape.budget`, each predicting the
  draft's expected tokens at every budget (AR first: the root alone, no draft)."""
  shape = spec.tree_shape
  if shape.kind not in ("top_n", "accum"):
    raise InputError(f"budget auto needs a tree (ddtree or jetflow), not the {shape.kind} shape")
  ladder = budget_ladder(shape.budget)
  return [dataclasses.replace(
      spec, ladder=ladder,
      tree_shape=TreeShape("root") if n == 1 else dataclasses.replace(shape, budget=n))
      for n in ladder]


def prior_tau(ladder: Sequence[int]) -> np.ndarray:
  """Expected tokens of a row not drafted yet: what a modest head gets (it decides whether the
  first rounds draft at all; a drafting round replaces it)."""
  ladder = np.asarray(ladder, np.float64)
  return np.minimum(ladder, 1.0 + 0.5 * np.log2(ladder))


def loop_cost_key(specs: Sequence[RoundSpec], rows: int, dtype: str, prompt_width: int,
                  capacity: int) -> dict:
  """What the device loop's round times depend on: the device, the model's and head's shapes,
  the rows, and the loop's tree, ladder, prompt bucket, cache and kernel."""
  spec = specs[-1]  # the largest tree
  key = cost_key(jax.devices()[0].device_kind, spec.config, getattr(spec.drafter, "config", None),
                 rows, dtype)
  key["loop"] = {"drafter": type(spec.drafter).__name__, "depth": spec.drafter.depth,
                 "taps": len(spec.drafter.tap_layers),
                 "drafter_impl": str(getattr(spec.drafter, "impl", "")),
                 "tree": spec.tree_shape.kind, "top_k": spec.tree_shape.top_k,
                 "ladder": list(spec.ladder), "prompt_width": prompt_width, "capacity": capacity,
                 "attention": spec.impl, "sampled": spec.sampled, "filtered": spec.filtered,
                 "logprobs": spec.logprobs,
                 "mesh": None if spec.mesh is None else str(spec.mesh.mesh.shape)}
  return key


def round_seconds(specs: Sequence[RoundSpec], advance_l: Sequence[Callable], state: DecodeState,
                  prompt_width: int, capacity: int) -> np.ndarray:
  """Seconds of a round at each spec's budget on this device and these shapes: measured on
  copies of `state` the first time, and kept (in this process, and in the cost tables file
  `budget.cost_tables_path()` for the next)."""
  memo = (tuple(specs), jax.tree.structure(state),
          tuple(x.shape for x in jax.tree.leaves(state)), prompt_width, capacity)
  if memo not in _seconds:
    before = to_host(state.rounds_b)

    def timed(advance) -> float:
      fresh = jax.block_until_ready(jax.tree.map(jnp.copy, state))
      start = time.perf_counter()
      after = jax.block_until_ready(advance(fresh, 2))
      elapsed = time.perf_counter() - start
      return elapsed / max(int(np.max(to_host(after.rounds_b) - before)), 1)

    def measure() -> np.ndarray:
      for advance in advance_l:
        timed(advance)  # warm-up
      return np.array([min(timed(advance) for _ in range(TIMED_RUNS)) for advance in advance_l])

    rows = state.lengths_b.shape[0]
    key = loop_cost_key(specs, rows, str(state.cache.k[0].dtype), prompt_width, capacity)
    _seconds[memo], _ = kept_seconds(key, specs[-1].ladder, rows, measure, cost_tables_path(),
                                     "seconds of one round of the device loop")
  return _seconds[memo]


def run_auto(state: DecodeState, advance_l: Sequence[Callable], flush: Callable | None,
             ladder: tuple[int, ...], seconds_l: np.ndarray, pending: int, prompt_lengths_b,
             on_tokens=None, schedule: Sequence[int] | None = None):
  """Rounds until every row is done, each run's budget chosen as the module docstring says, or
  taken in turn from `schedule` (ladder budgets, one round each: for tests and experiments).
  The prompt's taps and AR rounds' are kept back from the drafter, at most `pending` AR rounds
  in a row, until `flush` commits them: before a drafting round, or when the buffer is full
  (0: AR rounds commit their own, and `flush` may be None). Returns (state, the budget of every
  round).
  """
  rows = len(prompt_lengths_b)
  probe_key = (tuple(ladder), tuple(seconds_l), rows)  # the round times stand for the shapes
  cheapest_tree = float(np.min(seconds_l[1:])) if len(ladder) > 1 else float(seconds_l[0])
  spacing = lambda probe_s: max(8, math.ceil(probe_s / (PROBE_SHARE * seconds_l[0])))
  model = AcceptanceModel(ladder, rows, prior_tau(ladder), explore_every=spacing(
      max(cheapest_tree, _probe_seconds.get(probe_key, 0.0))))
  ar_run = max(1, int(AR_RUN_S / seconds_l[0]))
  budgets: list[int] = []
  done_b, rounds_b = to_host((state.done_b, state.rounds_b))
  streamed = time.perf_counter()
  held, flushed = 0, False  # AR rounds since the drafter last took their taps; did it ever
  while not done_b.all():
    live_b = ~done_b
    tau_bl = model.estimate()[live_b]
    tokens_l = tau_bl.sum(axis=0)
    tokens_l[0] = live_b.sum()
    if schedule is None:
      index = best_budget(tokens_l, seconds_l, ladder, probe=model.probe_due(live_b)).index
      runs = 1 if index else min(ar_run, model.explore_every - int(
          model.ar_rounds_b[live_b].max()))
    else:
      index, runs = ladder.index(schedule[len(budgets) % len(schedule)]), 1
    budget = ladder[index]
    probing = schedule is None and budget > 1 and model.probe_due(live_b)
    began = time.perf_counter()
    if pending and (held == pending or (budget > 1 and (held or not flushed))):
      state, held, flushed = flush(state), 0, True
    if budget == 1 and pending:
      runs = min(runs, pending - held)
    state = advance_l[index](state, max(runs, 1))
    done_b, new_rounds_b = to_host((state.done_b, state.rounds_b))
    if probing:  # later probes (of this and later runs of these shapes) wait for what it cost
      _probe_seconds[probe_key] = float(agreed(np.float32(time.perf_counter() - began)))
      model.explore_every = max(model.explore_every, spacing(_probe_seconds[probe_key]))
    ran_b = new_rounds_b - rounds_b
    if budget > 1:  # any drafting round predicts every budget of the ladder
      committed_br, predicted_bl = to_host((state.committed_br, state.predicted_bl))
      observed_b = committed_br[np.arange(rows), np.maximum(new_rounds_b - 1, 0)]
      model.update(predicted_bl, observed_b, budget, ran_b > 0)
    else:
      for r in range(int(ran_b.max())):
        model.update(None, None, 1, ran_b > r)
    budgets += [budget] * int(ran_b.max())
    held = held + int(ran_b.max()) if budget == 1 else 0
    rounds_b = new_rounds_b
    if on_tokens is not None and (done_b.all() or agreed(
        np.int32(time.perf_counter() - streamed >= STREAM_INTERVAL_S))):
      tokens, lengths = to_host((state.tokens_bs, state.lengths_b))
      on_tokens([tokens[b, p:lengths[b]].tolist() for b, p in enumerate(prompt_lengths_b)])
      streamed = time.perf_counter()
  return state, budgets
