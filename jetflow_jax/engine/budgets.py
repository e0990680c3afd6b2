"""Each engine step's budget, for an engine with a budget ladder (`--budget auto`).

A step runs one budget for all its slots (one compiled program per budget). Which one: the
ladder budget with the most expected committed tokens per second, from
- what a step of each budget costs on this device (`step_seconds`: measured at start-up with
  every slot busy, on a scratch state, and kept in a JSON cost table keyed by the device, the
  model shapes and the engine's, so the next start reuses it), and
- what the busy slots' drafts predict at every budget, calibrated per slot against what each
  accepted (`decoding.budget.AcceptanceModel`; a slot's estimate starts from a prior when its
  request arrives, and a tree is probed now and then while AR runs, at a small share of its time).
"""

from __future__ import annotations

import collections
import math
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jetflow_jax.decoding.auto import PROBE_SHARE, prior_tau
from jetflow_jax.decoding.budget import (AcceptanceModel, best_budget, cost_key,
                                         cost_tables_path, kept_seconds)
from jetflow_jax.engine.engine import Engine, Request
from jetflow_jax.engine.state import StepOutput

TIMED_STEPS = 3  # after one untimed step; the fastest counts (a busy machine only adds time)


def engine_cost_key(engine: Engine) -> dict:
  """What a step's time depends on: the device, the model's and head's shapes, the slots, and
  the engine's tree, context, rounds per step and kernel."""
  drafter_config = getattr(engine.drafter, "config", None)
  key = cost_key(jax.devices()[0].device_kind, engine.config, drafter_config, engine.num_slots,
                 str(jax.tree.leaves(engine.target_params)[0].dtype))
  shape = engine.tree_shape
  key["engine"] = {"tree": shape.kind, "top_k": shape.top_k, "ladder": list(engine.ladder),
                   "max_context": engine.max_context, "rounds_per_step": engine.rounds_per_step,
                   "attention": engine.impl,
                   "mesh": None if engine.mesh is None else str(engine.mesh.mesh.shape)}
  return key


def measure_step_seconds(engine: Engine) -> np.ndarray:
  """Seconds of a step at each ladder budget with every slot busy (a scratch state, thrown
  away). Compiles both variants of every budget's step on the way (greedy, and any request)."""
  length = max(1, min(64, engine.max_context // 4))
  prefix = engine.prefill(Request([0] * length, engine.max_context - length, stop_tokens=()))
  state = engine.init_state()
  for slot in range(engine.num_slots):
    state = engine.insert(state, prefix, slot)

  def timed(budget: int, **flags) -> float:
    fresh = jax.block_until_ready(jax.tree.map(jnp.copy, state))
    start = time.perf_counter()
    jax.block_until_ready(engine.step(fresh, budget, **flags))
    return time.perf_counter() - start

  seconds = []
  for budget in engine.ladder:
    timed(budget, logprobs=True)
    timed(budget, sampled=False, filtered=False)
    seconds.append(min(timed(budget, sampled=False, filtered=False) for _ in range(TIMED_STEPS)))
  return np.array(seconds)


def step_seconds(engine: Engine, path: str | None = None, log=None,
                 remeasure: bool = False) -> np.ndarray:
  """The engine's step times per ladder budget: from the cost table at `path` (default
  `cost_tables_path()`) when it has this engine's key (unless `remeasure`), else measured now
  and saved there."""
  seconds, measured_s = kept_seconds(
      engine_cost_key(engine), engine.ladder, engine.num_slots,
      lambda: measure_step_seconds(engine), cost_tables_path() if path is None else path,
      "seconds of one engine step (rounds_per_step rounds), every slot busy", remeasure)
  if measured_s and log is not None:
    log(f"budget costs measured in {measured_s:.1f} s: " + ", ".join(
        f"{'AR' if n == 1 else n} {1e3 * s:.1f} ms" for n, s in zip(engine.ladder, seconds)))
  return seconds


class BudgetChooser:
  """Picks each step's budget for the busy slots, and learns from what each step committed.

  `schedule` (ladder budgets, one step each, in turn) replaces the choice: for tests.
  """

  def __init__(self, ladder: Sequence[int], num_slots: int, seconds_l, rounds_per_step: int,
               schedule: Sequence[int] | None = None):
    self.ladder, self.seconds_l = tuple(ladder), np.asarray(seconds_l, np.float64)
    self.schedule = schedule
    cheapest_tree = float(np.min(self.seconds_l[1:])) if len(ladder) > 1 else 0.0
    ar_steps = max(2, math.ceil(cheapest_tree / (PROBE_SHARE * self.seconds_l[0])))
    self.model = AcceptanceModel(self.ladder, num_slots, prior_tau(self.ladder),
                                 explore_every=ar_steps * rounds_per_step)
    self.chosen: collections.Counter[int] = collections.Counter()

  def reset(self, slot: int) -> None:
    """A new request took `slot`: its estimate starts from the prior."""
    self.model.reset([slot])

  def choose(self, busy_b) -> int:
    """The budget of the next step over the `busy_b` slots (a bool mask)."""
    busy_b = np.asarray(busy_b, bool)
    if self.schedule is not None:
      budget = self.schedule[sum(self.chosen.values()) % len(self.schedule)]
    else:
      tau_bl = self.model.estimate()[busy_b]
      tokens_l = tau_bl.sum(axis=0)
      tokens_l[0] = busy_b.sum()
      budget = best_budget(tokens_l, self.seconds_l, self.ladder,
                           probe=self.model.probe_due(busy_b)).budget
    self.chosen[budget] += 1
    return budget

  def record(self, budget: int, output: StepOutput, valid_b) -> None:
    """What a step at `budget` committed (`output` on the host), for the `valid_b` slots (those
    still holding the request they held when the step was dispatched)."""
    for r in range(output.committed_br.shape[1]):
      committed_b = output.committed_br[:, r]
      self.model.update(output.predicted_brl[:, r], committed_b, budget,
                        np.asarray(valid_b, bool) & (committed_b >= 0))
