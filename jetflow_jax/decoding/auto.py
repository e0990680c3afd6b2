"""`--budget auto` in the device loop's host driver: each round's tree budget chosen on a ladder
(AR, 4, 8, ..., the largest) from what a round of each budget costs here and what each row's
draft predicts, calibrated against what the row accepted (`budget.py` holds those pieces).

The host decides between short runs of the device loop: one round at a time while trees pay
(each round's prediction and acceptance update the model), `SURE_RUNS` where even the rows'
gains `budget.UPPER_Z` standard errors down pick the same tree (a decision is a host round
trip), longer runs of AR rounds while trees do not pay (no draft runs then, so nothing new is
learnt). "Pay" is judged with each row's observed gains `budget.UPPER_Z` standard errors up
(`AcceptanceModel.estimate`): a row keeps drafting while its few drafts cannot rule out that
trees win. On the point estimate, rows near the break-even left trees at their first unlucky
stretch and learnt nothing more, and the record they left kept later requests on AR: replayed at
Qwen3-0.6B times over six draw sequences, tau 4 at 128 and 512 tokens, where JetFlow 16 beats AR
by 17%, auto read 0.87-0.92 of it, and 0.98-1.01 since (that optimism is bounded: the row's and its
record's errors add in quadrature, `AcceptanceModel.ratio_b`, so a drafter that loses by a quarter
leaves trees within a few rounds). A tree round that only that optimism picks (the rows' point
estimate picks AR) explores, and runs where the drafter's record gives trees a chance to pay over
the tokens left worth its expected loss (`budget.explore_index`). A tree probe runs only where it
can pay for itself within the request (`budget.probe_index`: its chance of finding trees paying,
from this drafter's past probes and its record, times what trees could save over the tokens left,
against what the probe costs, the flush of the held-back context included), and probes are spaced so
that they cost a small share of the AR time. A row never drafted starts from what this drafter
accepted in past runs on this target (`budget.HeadRecord`); a request may probe it at once where
that record, for all its few drafts, says a tree could win (`HeadRecord.upper_tau`).
A drafter never seen on this target starts from what it expects of itself where it can say
(`Drafter.acceptance_prior`: a trained head's acceptance on held-out text, `head_acceptance`; a
controlled drafter's distribution), taken as `budget.PRIOR_DRAFTS` past drafts
(`HeadRecord.with_prior`); one that cannot starts from AR and gets one look: the probe that
risks least, once that is a small share of the AR time of the request and of the drafter's
earlier unseen runs (`budget.first_look_index`). A row's calibration starts from the record too
(`HeadRecord.acceptance_model`), as uncertain as the record's drafts leave it. Every budget's
round is one compiled variant; its time and the flush's are measured once per shape (on copies
of a scratch state, before the clock, each as the loop runs it) and kept, in this process and
in the cost tables file (`budget.cost_tables_path()`), with the drafter's record, for the next.
The first decision is taken before the prefill (`drafts_ahead`): a request that will not draft
runs plain AR's programs throughout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jetflow_jax.decoding.budget import (UPPER_Z, HeadRecord, best_budget, budget_ladder,
                                         cost_key, cost_tables_path, explore_index,
                                         first_look_index, kept_seconds, optimistic_tau,
                                         probe_index)
from jetflow_jax.decoding.round import RoundSpec, TreeShape
from jetflow_jax.decoding.state import RUNNING, DecodeState
from jetflow_jax.distributed import agreed, to_host
from jetflow_jax.errors import InputError

TIMED_RUNS = 5  # timed runs per budget, after a warm-up; the fastest counts (a busy machine only
# ever adds time)
AR_TIMED_ROUNDS = 8  # rounds of a timed AR run. Each budget is timed as the loop runs it: AR in
# long runs, a tree one round a call with the host's read of its result. A call costs about
# 2.5 ms more than its rounds on the embedded pair (about a 1.6 ms AR round): timed in 2-round
# calls, AR read 30% slow and trees 10-25% fast, and requests with the table absent drafted at
# budget 8 where it cost 5.6 AR rounds, not the 2.9 measured (0.79 of AR at 512 tokens).
AR_RUN_S = 0.5  # AR rounds run back to back for about this long between two decisions
SURE_RUNS = 4  # tree rounds run back to back where the choice is sure: the rows' gains
# `UPPER_Z` standard errors down pick the same budget (each decision costs a host round trip,
# 2-5% of a JetFlow 16 round at Qwen3-0.6B shapes on CPU)
PROBE_SHARE = 0.02  # probes spaced so that each costs at most this share of the AR rounds between
FIRST_LOOK_SHARE = 0.05  # a drafter never seen gets one probe that risks at most this share of
# the AR time spent with it, this request included (`budget.first_look_index`)
PRIOR_LOOK_SHARE = PROBE_SHARE  # ... and one that brought a prior, at most this share: the prior
# decides well where it was measured on text like the user's, the look is for where it was not
STREAM_INTERVAL_S = 0.05

_seconds: dict = {}  # (round times, flush time) by (specs, shapes), measured or read here


def look_share(record: HeadRecord) -> float:
  """The share of the AR time spent with a drafter that its first look may risk."""
  return PRIOR_LOOK_SHARE if record.prior_drafts else FIRST_LOOK_SHARE


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


def drafter_fingerprint(drafter_params) -> str:
  """A short hash of a drafter's params that tells two trained heads apart: every leaf's shape
  and dtype, and the values of its small float leaves (norm scales, a controlled drafter's
  acceptance), which training moves. Integer leaves (a controlled drafter's seed) say which
  request's draws, not how well it drafts: a record is shared across them."""
  digest = hashlib.sha1()
  leaves = jax.tree.leaves(drafter_params)
  for leaf in leaves:
    digest.update(f"{jnp.shape(leaf)}{jnp.result_type(leaf)}".encode())
  small = [x for x in leaves if jnp.ndim(x) <= 1 and jnp.size(x) <= 65536
           and jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  for value in to_host(small):
    digest.update(np.ascontiguousarray(value).tobytes())
  return digest.hexdigest()[:16]


def head_record_key(spec: RoundSpec, drafter_params) -> dict:
  """What a drafter's acceptance depends on: the target's shape, the drafter, its settings (a
  controlled drafter's `calibrated`, say, changes what its drafts predict) and its params, the
  tree and whether rows sample."""
  key = cost_key("", spec.config, getattr(spec.drafter, "config", None))
  fields = dataclasses.fields(spec.drafter) if dataclasses.is_dataclass(spec.drafter) else ()
  settings = {f.name: getattr(spec.drafter, f.name) for f in fields
              if isinstance(getattr(spec.drafter, f.name), (bool, int, float, str))}
  return {"target": key["target"], "head": key["head"],
          "drafter": type(spec.drafter).__name__, "depth": spec.drafter.depth,
          "settings": settings,
          "params": drafter_fingerprint(drafter_params), "tree": spec.tree_shape.kind,
          "top_k": spec.tree_shape.top_k, "ladder": list(spec.ladder), "sampled": spec.sampled}


def loop_cost_key(specs: Sequence[RoundSpec], rows: int, dtype: str, prompt_width: int,
                  capacity: int, kernel_layout: str) -> dict:
  """What the device loop's round times depend on: the device, the model's and head's shapes
  and how their kernels are stored, the rows, and the loop's tree, ladder, prompt bucket, cache
  and kernel."""
  spec = specs[-1]  # the largest tree
  key = cost_key(jax.devices()[0].device_kind, spec.config, getattr(spec.drafter, "config", None),
                 rows, dtype)
  key["loop"] = {"drafter": type(spec.drafter).__name__, "depth": spec.drafter.depth,
                 "taps": len(spec.drafter.tap_layers),
                 "drafter_impl": str(getattr(spec.drafter, "impl", "")),
                 "tree": spec.tree_shape.kind, "top_k": spec.tree_shape.top_k,
                 "ladder": list(spec.ladder), "prompt_width": prompt_width, "capacity": capacity,
                 "attention": spec.impl, "sampled": spec.sampled, "filtered": spec.filtered,
                 "logprobs": spec.logprobs, "kernels": kernel_layout,
                 "mesh": None if spec.mesh is None else str(spec.mesh.mesh.shape),
                 "timed": f"AR {AR_TIMED_ROUNDS} rounds a call, trees 1 and read"}
  return key


def round_seconds(specs: Sequence[RoundSpec], programs: Callable[[], tuple], rows: int,
                  dtype: str, prompt_width: int, capacity: int, kernel_layout: str,
                  with_flush: bool) -> tuple[np.ndarray, float]:
  """(seconds of a round at each spec's budget, seconds of the flush, 0 without one) on this
  device and these shapes: kept in this process and in the cost tables file
  (`budget.cost_tables_path()`), else measured, once per shape, on copies of a scratch state.
  `programs()` gives what is measured: (a loop per spec, taking (state, rounds); the flush or
  None; the state), and is called only when nothing is kept."""
  memo = (tuple(specs), rows, dtype, prompt_width, capacity, with_flush, kernel_layout)
  if memo not in _seconds:

    def measure() -> np.ndarray:
      advance_l, flush, state = programs()
      before = to_host(state.rounds_b)

      def timed(run, per_round: bool) -> float:
        fresh = jax.block_until_ready(jax.tree.map(jnp.copy, state))
        start = time.perf_counter()
        after = jax.block_until_ready(run(fresh))
        elapsed = time.perf_counter() - start
        return elapsed / max(int(np.max(to_host(after.rounds_b) - before)), 1) if per_round \
            else elapsed

      runs = [(lambda s: advance_l[0](s, AR_TIMED_ROUNDS), True)]
      runs += [(lambda s, a=advance: read_round(a(s, 1)), True) for advance in advance_l[1:]]
      if flush is not None:
        runs.append((flush, False))
      for run, per_round in runs:
        timed(run, per_round)  # warm-up
      return np.array([min(timed(run, per_round) for _ in range(TIMED_RUNS))
                       for run, per_round in runs])

    key = loop_cost_key(specs, rows, dtype, prompt_width, capacity, kernel_layout)
    extras = ("flush",) if with_flush else ()
    seconds, _ = kept_seconds(key, specs[-1].ladder, rows, measure, cost_tables_path(),
                              "seconds of one round of the device loop; flush: the held-back "
                              "context", extras=extras)
    _seconds[memo] = (seconds[:len(specs)], float(seconds[len(specs)]) if extras else 0.0)
  return _seconds[memo]


class Chooser:
  """One request's budget decisions, as the module docstring says: from the round times here
  (`seconds_l`, and `flush_s` for the held-back context where `pending`), the drafter's
  `record` and what the request's own rows accept (`model`). `can_finish`: AR rounds that keep
  no taps can run the rest of the request (`finishing`) once nothing will draft in it again."""

  def __init__(self, record: HeadRecord, ladder: Sequence[int], seconds_l, flush_s: float,
               pending: int, rows: int, can_finish: bool):
    self.record, self.ladder, self.can_finish = record, tuple(ladder), can_finish
    self.seconds_l = np.asarray(seconds_l, np.float64)
    self.probe_seconds_l = self.seconds_l + (flush_s if pending else 0.0)
    self.needed_l = self.seconds_l / self.seconds_l[0]  # tokens a round must commit to beat AR
    cheapest_probe = float(np.min(self.probe_seconds_l[1:])) if len(ladder) > 1 else 0.0
    self.model = record.acceptance_model(rows, explore_every=max(
        8, math.ceil(cheapest_probe / (PROBE_SHARE * self.seconds_l[0]))))
    self.upper_l = record.upper_tau()
    self.hope_l = np.maximum(optimistic_tau(ladder), self.upper_l)
    self.ar_run = max(1, int(AR_RUN_S / self.seconds_l[0]))
    # The request's first decision may probe at once: a drafter never seen where a probe at
    # `hope_l` pays (else its look), a known one where its record says a tree could win
    # (`upper_l`); later probes wait for `explore_every` AR rounds. Once a probe at `hope_l`
    # does not pay, none will in this request: fewer tokens are left at every check.
    self.may_probe, self.starting = len(ladder) > 1, True
    self.finishing = False
    self.reason = ""  # why the first decision (`why`)

  def best_at(self, z: float, live_b) -> int:
    """The best budget for the live rows at their gains `z` standard errors up."""
    return best_budget(self.model.estimate(z)[live_b].sum(axis=0), self.seconds_l,
                       self.ladder).index

  def decide(self, remaining: float, live_b) -> tuple[int, int, bool]:
    """(ladder index, rounds to run, whether it is a probe) with `remaining` tokens left to the
    live rows (`live_b`)."""
    model, record, seconds_l = self.model, self.record, self.seconds_l
    starting, self.starting = self.starting, False
    if self.finishing:
      return 0, self.ar_run, False
    probing = False
    index = self.best_at(UPPER_Z, live_b)
    if index and not self.best_at(0.0, live_b):
      index = explore_index(remaining, seconds_l, model.estimate()[live_b].mean(axis=0),
                            model.estimate(UPPER_Z)[live_b].mean(axis=0),
                            record.win_chance(self.needed_l), index)
    if not index and self.may_probe:
      chance_l = record.win_chance(self.needed_l)
      worth = probe_index(remaining, seconds_l, self.probe_seconds_l, self.hope_l, chance_l)
      look = lambda: (first_look_index(remaining, seconds_l, self.probe_seconds_l,
                                       look_share(record), record.unseen_s)
                      if starting and record.unseen else 0)
      if starting and record.drafts:
        index = (probe_index(remaining, seconds_l, self.probe_seconds_l, self.upper_l, chance_l)
                 or look())
        self.may_probe = bool(worth)
      elif starting or model.probe_due(live_b):
        index = worth or look()
        self.may_probe = index > 0
      elif not worth:  # no probe pays in what is left now, nor later with less left
        self.may_probe = False
      probing = index > 0
    wait = model.explore_every - int(model.ar_rounds_b[live_b].max())
    if index:  # several rounds where even the gains UPPER_Z standard errors down agree
      runs = SURE_RUNS if not probing and self.best_at(-UPPER_Z, live_b) == index else 1
    else:
      runs = min(self.ar_run, wait) if self.may_probe else self.ar_run
    prior_l = record.prior_tau() * live_b.sum()
    self.finishing = (self.can_finish and not index and not self.may_probe
                      and not best_budget(prior_l, seconds_l, self.ladder).index)
    if starting:
      self.reason = self.why(index, probing, remaining, live_b)
    return index, runs, probing

  def why(self, index: int, probing: bool, remaining: float, live_b) -> str:
    """A line on a decision: what the tree it runs (or the one nearest to paying) is expected to
    commit a round against what beats AR here, and whether a probe may come."""
    tau_l = self.model.estimate()[live_b].mean(axis=0)
    tree = index or 1 + int(np.argmax(tau_l[1:] / self.needed_l[1:]))
    expects = (f"budget {self.ladder[tree]} is expected to commit {tau_l[tree]:.1f} tokens a "
               f"round where {self.needed_l[tree]:.1f} beat AR here")
    if probing:
      return f"a probe, to find out: {expects}"
    if index:
      return expects
    later = ("a probe may come" if self.may_probe
             else f"no probe can pay within {remaining:.0f} tokens")
    return f"AR: {expects}; {later}"


def drafts_ahead(record: HeadRecord, ladder: Sequence[int], seconds_l, flush_s: float,
                 pending: int, rows: int, max_new_tokens: int) -> tuple[bool, str]:
  """Whether a request of `rows` rows and `max_new_tokens` tokens may run a tree round, and why
  (`Chooser.why`): it may unless its first decision is AR to the end (no tree pays at the
  record's estimate, no probe or look can pay within the request, and the record's prior picks
  AR). Where it may not, the request runs plain AR's programs from its prefill on: a drafter's
  prefill (the target with taps, the drafter's state) costs several times plain AR's, a tenth
  of a short request on the embedded pair."""
  chooser = Chooser(record, ladder, seconds_l, flush_s, pending, rows, can_finish=True)
  chooser.decide(float(max_new_tokens), np.ones(rows, bool))
  return not chooser.finishing, chooser.reason


def read_round(state: DecodeState) -> DecodeState:
  """`state`, once the host has what `run_auto` reads after a drafting round."""
  to_host((state.stop_b, state.rounds_b, state.lengths_b, state.committed_br, state.predicted_bl))
  return state


def run_auto(state: DecodeState, advance_l: Sequence[Callable], flush: Callable | None,
             ladder: tuple[int, ...], seconds_l: np.ndarray, flush_s: float, pending: int,
             prompt_lengths_b, record: HeadRecord, on_tokens=None,
             schedule: Sequence[int] | None = None, finish: Callable | None = None):
  """Rounds until every row is done, each run's budget chosen by a `Chooser`, or taken in turn
  from `schedule` (ladder budgets, one round each: for tests and experiments).
  The prompt's taps and AR rounds' are kept back from the drafter, at most `pending` AR rounds
  in a row, until `flush` commits them: before a drafting round, or when the buffer is full
  (0: AR rounds commit their own, and `flush` may be None); `flush_s` is what a flush costs.
  `record` gives the prior of rows never drafted and the chance a probe wins, and takes in
  what this run's drafts predicted, accepted and probed (or, for a drafter that has never
  drafted, the AR time it ran). `finish` (AR rounds that keep no taps, as plain AR's) runs the
  rest of the request once nothing can draft in it again: no probe pays, and AR beats every
  tree at the prior the rows drift back to. Returns (state, the budget of every round, why the
  first was chosen).
  """
  rows = len(prompt_lengths_b)
  chooser = Chooser(record, ladder, seconds_l, flush_s, pending, rows, finish is not None)
  model = chooser.model
  budgets: list[int] = []
  stop_b, rounds_b, lengths_b, max_lengths_b = to_host(
      (state.stop_b, state.rounds_b, state.lengths_b, state.max_lengths_b))
  done_b = stop_b != RUNNING  # read, not computed on the device: no program to run
  streamed = time.perf_counter()
  held, flushed = 0, False  # AR rounds since the drafter last took their taps; did it ever

  while not done_b.all():
    live_b = ~done_b
    if schedule is None:
      index, runs, probing = chooser.decide(float(np.max((max_lengths_b - lengths_b)[live_b])),
                                            live_b)
    else:
      index, runs, probing = ladder.index(schedule[len(budgets) % len(schedule)]), 1, False
    budget = ladder[index]
    if chooser.finishing:
      state = finish(state, runs)
    else:
      if pending and (held == pending or (budget > 1 and (held or not flushed))):
        state, held, flushed = flush(state), 0, True
      if budget == 1 and pending:
        runs = min(runs, pending - held)
      state = advance_l[index](state, max(runs, 1))
    stop_b, new_rounds_b, lengths_b = to_host((state.stop_b, state.rounds_b, state.lengths_b))
    done_b = stop_b != RUNNING
    ran_b = new_rounds_b - rounds_b
    if budget > 1:  # any drafting round predicts every budget of the ladder
      committed_br, predicted_bl = to_host((state.committed_br, state.predicted_bl))
      # Only the last round's prediction is kept: it stands for the run's earlier rounds too.
      for r in range(int(ran_b.max())):
        column_b = np.minimum(rounds_b + r, committed_br.shape[1] - 1)
        observed_b = committed_br[np.arange(rows), column_b]
        model.update(predicted_bl, observed_b, budget, ran_b > r)
        record.add_drafts(predicted_bl, observed_b, budget, ran_b > r)
      if probing:  # won: the rows' point estimate now says a tree pays
        record.probes += 1
        record.wins += float(chooser.best_at(0.0, live_b) > 0)
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
  record.add_unseen(budgets.count(1) * float(chooser.seconds_l[0]))
  return state, budgets, chooser.reason if schedule is None else "a schedule"
