"""Each engine step's budget, for an engine with a budget ladder (`--budget auto`).

A step runs one budget for all its slots (one compiled program per budget). Which one: the
ladder budget with the most expected committed tokens per second, from
- what a step of each budget costs on this device (`step_seconds`: measured at start-up with
  every slot busy, on a scratch state, and kept in a JSON cost table keyed by the device, the
  model shapes and the engine's, so the next start reuses it), and
- what the busy slots' drafts predict at every budget, calibrated per slot against what each
  accepted (`decoding.budget.AcceptanceModel`; a slot's estimate and calibration start, when its
  request arrives, from what this drafter accepted before on this target,
  `decoding.budget.HeadRecord`, kept beside the cost tables; a drafter never seen starts from AR).
  While AR runs, a tree is probed only where the probe can pay for itself over the busy requests'
  tokens left (`decoding.budget.probe_index`), and probes are spaced to a small share of the AR
  time; a tree that only the slots' optimism picks runs where the record's chance of trees paying
  over those tokens is worth its expected loss (`decoding.budget.explore_index`). A drafter never
  seen gets one look as in the device loop: the step that risks least, once that is a small share
  of the AR time spent with it, this server's and earlier runs'
  (`decoding.budget.first_look_index`). A request whose first decision alone is AR to the end
  (`decoding.auto.drafts_ahead`) will not draft: it counts as AR, and while only such requests
  are busy, steps run plain AR's round, which keeps no taps for the drafter.

Every budget's step variants run once at start-up before any request, also when their times
come from the cost table (`warm_up_steps`): a program's first execution costs far more than the
next, and no request should pay it.
"""

from __future__ import annotations

import collections
import math
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jetflow_jax.decoding.auto import PROBE_SHARE, drafts_ahead, head_record_key, look_share
from jetflow_jax.decoding.budget import (UPPER_Z, HeadRecord, best_budget, cost_key,
                                         cost_tables_path, explore_index, first_look_index,
                                         kept_seconds, load_head_record, optimistic_tau,
                                         probe_index, save_head_record)
from jetflow_jax.drafters import drafter_prior
from jetflow_jax.engine.engine import Engine, Request
from jetflow_jax.engine.state import StepOutput
from jetflow_jax.partitioning import kernel_layout

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
                   "kernels": kernel_layout(engine.target_params),
                   "mesh": None if engine.mesh is None else str(engine.mesh.mesh.shape)}
  return key


def _busy_state(engine: Engine):
  """A scratch state with every slot holding the same request."""
  length = max(1, min(64, engine.max_context // 4))
  prefix = engine.prefill(Request([0] * length, engine.max_context - length, stop_tokens=()))
  state = engine.init_state()
  for slot in range(engine.num_slots):
    state = engine.insert(state, prefix, slot)
  return state


def _run_step(engine: Engine, state, budget: int, **flags) -> float:
  """Seconds of one step at `budget` on a copy of `state`."""
  fresh = jax.block_until_ready(jax.tree.map(jnp.copy, state))
  start = time.perf_counter()
  jax.block_until_ready(engine.step(fresh, budget, **flags))
  return time.perf_counter() - start


def warm_up_steps(engine: Engine) -> float:
  """Runs both variants of every budget's step once (greedy, and any request), AR's also
  without taps, and the prefill, insert and evict they need, on a scratch state; returns the
  seconds it took."""
  start = time.perf_counter()
  state = _busy_state(engine)
  for budget in engine.ladder:
    _run_step(engine, state, budget, logprobs=True)
    _run_step(engine, state, budget, sampled=False, filtered=False)
  for flags in ({"logprobs": True}, {"sampled": False, "filtered": False}):
    _run_step(engine, state, 1, taps=False, **flags)  # requests that will not draft
  jax.block_until_ready(engine.evict(state, 0))
  return time.perf_counter() - start


def measure_step_seconds(engine: Engine) -> np.ndarray:
  """Seconds of a step at each ladder budget with every slot busy (a scratch state, thrown
  away), each after `warm_up_steps` ran it once."""
  warm_up_steps(engine)
  state = _busy_state(engine)
  return np.array([min(_run_step(engine, state, budget, sampled=False, filtered=False)
                       for _ in range(TIMED_STEPS)) for budget in engine.ladder])


def step_seconds(engine: Engine, path: str | None = None, log=None,
                 remeasure: bool = False) -> np.ndarray:
  """The engine's step times per ladder budget: from the cost table at `path` (default
  `cost_tables_path()`) when it has this engine's key (unless `remeasure`), else measured now
  and saved there. Either way every step variant has run once when this returns."""
  seconds, measured_s = kept_seconds(
      engine_cost_key(engine), engine.ladder, engine.num_slots,
      lambda: measure_step_seconds(engine), cost_tables_path() if path is None else path,
      "seconds of one engine step (rounds_per_step rounds), every slot busy", remeasure)
  if measured_s:
    message = f"budget costs measured in {measured_s:.1f} s"
  else:
    message = f"budget costs read, every step warmed up in {warm_up_steps(engine):.1f} s"
  if log is not None:
    log(f"{message}: " + ", ".join(f"{'AR' if n == 1 else n} {1e3 * s:.1f} ms"
                                   for n, s in zip(engine.ladder, seconds)))
  return seconds


class BudgetChooser:
  """Picks each step's budget for the busy slots, and learns from what each step committed.

  `record` (default: fresh, a drafter never seen) gives a new request's prior and the chance a
  probe wins, and takes in what the steps drafted and probed; `save` keeps it (called at most
  every `SAVE_EVERY_S`, and by `close`). `schedule` (ladder budgets, one step each, in turn)
  replaces the choice: for tests.
  """

  SAVE_EVERY_S = 30.0

  def __init__(self, ladder: Sequence[int], num_slots: int, seconds_l, rounds_per_step: int,
               schedule: Sequence[int] | None = None, record: HeadRecord | None = None,
               save: Callable[[HeadRecord], None] | None = None):
    self.ladder, self.seconds_l = tuple(ladder), np.asarray(seconds_l, np.float64)
    self.schedule, self.rounds_per_step = schedule, rounds_per_step
    self.record = record if record is not None else HeadRecord({}, self.ladder)
    self._save, self._saved = save, time.perf_counter()
    cheapest_tree = float(np.min(self.seconds_l[1:])) if len(ladder) > 1 else 0.0
    ar_steps = max(2, math.ceil(cheapest_tree / (PROBE_SHARE * self.seconds_l[0])))
    self.model = self.record.acceptance_model(num_slots, explore_every=ar_steps * rounds_per_step)
    self.hope_l = self._hope()
    self.chosen: collections.Counter[int] = collections.Counter()
    # Whether each chosen step not yet recorded is a probe (steps are read back a step late).
    self.probing: collections.deque[bool] = collections.deque()
    self.may_look = True  # while the drafter has not drafted here (`HeadRecord.unseen`)
    self.starting = False  # a request just arrived: a known drafter may be probed at once
    self.plain_b = np.zeros(num_slots, bool)  # slots whose requests will not draft

  def reset(self, slot: int, max_tokens: int | None = None) -> None:
    """A new request took `slot`: its estimate starts from the prior, what the drafter's
    record holds now (past runs and this one's requests so far).

    With `max_tokens` (what the request may produce), a request whose first decision alone is AR
    to the end (`auto.drafts_ahead`, the device loop's rule, priced per step) will not draft:
    it counts as AR in every choice, and while only such requests are busy, steps run without
    taps (`drafting`), as plain AR's do.
    """
    for name, value in self.record.model_prior().items():
      setattr(self.model, name, value)
    self.model.reset([slot])
    self.hope_l = self._hope()
    self.plain_b[slot] = (max_tokens is not None and self.schedule is None and not drafts_ahead(
        self.record, self.ladder, self.seconds_l, 0.0, 0, 1, max_tokens / self.rounds_per_step)[0])
    self.starting = self.starting or (self.record.drafts > 0 and not self.plain_b[slot])

  def drafting(self, busy_b) -> bool:
    """Whether a busy slot may draft: else steps need not keep the drafter's context."""
    return bool(np.any(np.asarray(busy_b, bool) & ~self.plain_b))

  def _hope(self) -> np.ndarray:
    """What a probe hopes a tree commits: what the record says it could, or a modest head's
    if higher."""
    return np.maximum(optimistic_tau(self.ladder), self.record.upper_tau())

  def _tokens(self, busy_b, z: float = UPPER_Z) -> np.ndarray:
    """The busy slots' expected committed tokens a round at each budget (AR's where they will
    not draft: their drafter's context is not kept)."""
    return np.where(self.plain_b[:, None], 1.0, self.model.estimate(z))[busy_b].sum(axis=0)

  def _best(self, busy_b, z: float = UPPER_Z) -> int:
    """The ladder index of the best budget for the `busy_b` slots at `z` standard errors up."""
    return best_budget(self._tokens(busy_b, z), self.seconds_l, self.ladder).index

  def _win_chance(self) -> np.ndarray:
    return self.record.win_chance(self.seconds_l / self.seconds_l[0])

  def choose(self, busy_b, remaining_b=None) -> int:
    """The budget of the next step over the `busy_b` slots (a bool mask); `remaining_b`: the
    tokens each slot's request may still produce (default: no probe pays)."""
    busy_b = np.asarray(busy_b, bool)
    probing = False
    drafting_b = busy_b & ~self.plain_b
    if self.schedule is not None:
      budget = self.schedule[sum(self.chosen.values()) % len(self.schedule)]
    elif not drafting_b.any():
      budget = 1
    else:
      index = self._best(busy_b)
      # Per step: a step runs `rounds_per_step` rounds, so a slot has this many steps left.
      steps_left = (None if remaining_b is None
                    else float(np.max(np.asarray(remaining_b)[drafting_b])) / self.rounds_per_step)
      if index and steps_left is not None and not self._best(busy_b, 0.0):
        # Only the slots' optimism picks a tree: as in the device loop, it explores.
        point_l, upper_l = (self._tokens(busy_b, z) / busy_b.sum() for z in (0.0, UPPER_Z))
        index = explore_index(steps_left, self.seconds_l, point_l, upper_l, self._win_chance(),
                              index)
      looking = self.may_look and self.record.unseen  # (a step may have drafted since)
      if (not index and steps_left is not None and len(self.ladder) > 1
          and (looking or self.starting or self.model.probe_due(drafting_b))):
        # As the device loop: on a request's arrival, a known drafter is probed at once
        # only where its record says a tree could win.
        hope_l = (self.record.upper_tau() if self.starting and not self.model.probe_due(drafting_b)
                  else self.hope_l)
        index = probe_index(steps_left, self.seconds_l, self.seconds_l, hope_l,
                            self._win_chance())
        if looking and not index:
          index = first_look_index(steps_left, self.seconds_l, self.seconds_l,
                                   look_share(self.record), self.record.unseen_s)
        probing = index > 0
        self.may_look = self.may_look and not probing
        if not index and not self.starting:  # try again after another spell of AR rounds
          self.model.ar_rounds_b[busy_b] = 0
      budget = self.ladder[index]
    self.starting = False
    self.chosen[budget] += 1
    self.probing.append(probing)
    return budget

  def record_step(self, budget: int, output: StepOutput, valid_b) -> None:
    """What a step at `budget` committed (`output` on the host), for the `valid_b` slots (those
    still holding the request they held when the step was dispatched)."""
    valid_b = np.asarray(valid_b, bool)
    drafting_b = valid_b & ~self.plain_b  # the others' drafts come from a stale context
    probing = self.probing.popleft() if self.probing else False
    for r in range(output.committed_br.shape[1]):
      committed_b = output.committed_br[:, r]
      active_b = drafting_b & (committed_b >= 0)
      self.model.update(output.predicted_brl[:, r], committed_b, budget, active_b)
      if budget > 1:
        self.record.add_drafts(output.predicted_brl[:, r], committed_b, budget, active_b)
    if budget == 1 and valid_b.any():
      self.record.add_unseen(float(self.seconds_l[0]))  # priced in the drafter's first look
    if probing and drafting_b.any():
      self.record.probes += 1
      self.record.wins += float(self._best(drafting_b, 0.0) > 0)
    if self._save is not None and time.perf_counter() - self._saved >= self.SAVE_EVERY_S:
      self.close()

  def close(self) -> None:
    """Keeps the record (what was drafted and probed) for the next start."""
    if self._save is not None:
      self._save(self.record)
      self._saved = time.perf_counter()


def engine_chooser(engine: Engine, seconds_l, schedule: Sequence[int] | None = None,
                   path: str | None = None) -> BudgetChooser:
  """The chooser for `engine`, its drafter's record read from (and kept in) the cost tables
  file at `path` (default `cost_tables_path()`)."""
  path = cost_tables_path() if path is None else path
  key = head_record_key(engine.spec(engine.ladder[-1], sampled=False, filtered=False),
                        engine.drafter_params)
  return BudgetChooser(engine.ladder, engine.num_slots, seconds_l, engine.rounds_per_step,
                       schedule, record=load_head_record(
                           path, key, engine.ladder,
                           drafter_prior(engine.drafter, engine.drafter_params, engine.ladder)),
                       save=lambda record: save_head_record(path, record))
