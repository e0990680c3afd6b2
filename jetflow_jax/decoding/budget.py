"""Which tree budget the next round should verify: expected tokens per budget over its cost.

Pieces, each usable alone (the decode loop and the engine call them; nothing here runs a model):

- `budget_ladder`: the budgets a run compiles, AR (1 node) and a few trees up to the largest;
- `expected_tau`: from one draft, the draft's own expected committed tokens at every budget of
  the ladder (jittable). The top-N set is ancestor-closed, a kept node is accepted when its
  whole path is, so E[committed] = sum over the N kept nodes of exp(path log-prob), the root's
  exp(0) = 1 being the bonus token;
- `AcceptanceModel`: per row, how what the rows accept compares with what their drafts
  predicted, with a prior for rows whose head has not run yet (host-side numpy);
- `HeadRecord`: what one drafter's drafts predicted and accepted on one target over past runs
  (kept with the cost tables), started from the drafter's own `AcceptancePrior` where it has one;
- `CostTable`: seconds per round by (method, budget, busy rows) on one device, saved as JSON;
- `choose_budget`: the ladder budget with the most expected committed tokens per second.

One budget is chosen per round for all its rows (one compiled shape per budget).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import warnings
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jetflow_jax import distributed
from jetflow_jax.errors import InputError
from jetflow_jax.tree import DraftTree, build_tree, build_tree_accum

LADDER = (1, 4, 8, 16, 32, 64, 128, 256)
AR_METHOD = "ar"
COST_TABLES_ENV = "JETFLOW_COST_TABLES"


def budget_ladder(max_budget: int, ladder: Sequence[int] = LADDER) -> tuple[int, ...]:
  """AR (1), then the ladder's budgets below `max_budget`, then `max_budget` itself.

  Raises:
    InputError: `max_budget` < 1.
  """
  if max_budget < 1:
    raise InputError(f"the largest budget must be >= 1 node (got {max_budget})")
  return tuple(sorted({1, max_budget} | {n for n in ladder if n < max_budget}))


def expected_tau(tree: DraftTree, ladder: Sequence[int], in_order: bool = False) -> jax.Array:
  """The draft's expected committed tokens `[B, L]` at every ladder budget, bonus included.

  `tree` is built at budget max(ladder). A smaller budget's tree is its top-N by score
  (`build_tree`, whose nodes come by depth: sorted here) or, with `in_order`, its first N
  nodes (`build_tree_accum`, whose nodes come in insertion order).

  Raises:
    InputError: a ladder budget outside [1, the tree's nodes].
  """
  scores_bn = tree.scores
  if max(ladder) > scores_bn.shape[1] or min(ladder) < 1:
    raise InputError(f"ladder {tuple(ladder)} needs budgets in [1, {scores_bn.shape[1]}]")
  if not in_order:
    scores_bn = -jnp.sort(-scores_bn, axis=1)
  cumulative_bn = jnp.cumsum(jnp.exp(scores_bn), axis=1)
  return cumulative_bn[:, np.asarray(ladder) - 1]


def draft_expected_tau(depth_logprobs_bdv, ladder: Sequence[int], top_k: int,
                       kind: str = "top_n") -> jax.Array:
  """`expected_tau` of the tree the ladder's largest budget builds from these log-probs."""
  budget = max(ladder)
  if budget == 1:
    return jnp.ones((jnp.shape(depth_logprobs_bdv)[0], 1), jnp.float32)
  if kind == "accum":
    return expected_tau(build_tree_accum(depth_logprobs_bdv, budget, top_k), ladder, True)
  return expected_tau(build_tree(depth_logprobs_bdv, budget, top_k), ladder)


def gains_up(observed, drafts, z: float):
  """Summed gains of `drafts` drafts taken `z` standard errors up. The spread is what i.i.d.
  acceptance gives (geometric lengths: a draft's gain m has variance m (1 + m)), m estimated
  with one pseudo-draft of gain 1 so that a few drafts that gained nothing still leave room."""
  mean = (observed + 1.0) / (drafts + 1.0)
  return observed + z * np.sqrt(mean * (1.0 + mean) * drafts)


@dataclasses.dataclass
class AcceptanceModel:
  """Per-row calibration of what drafts predict (`expected_tau`) against what rows accept.

  A row's gain is what it commits beyond the bonus token. Its calibration is the ratio
  estimator sum(observed gains) / sum(predicted gains) (the least-squares line through the
  origin when the variance grows with the prediction), shrunk towards `prior_ratio` by
  `prior_weight` predicted tokens, old rounds fading by `decay`. Its estimate at each budget is
  1 + ratio x (the last draft's predicted gain there). A row with no draft yet is estimated by
  `prior_tau_l`, and a row kept on AR drifts back to it (the last draft's weight falls by
  `decay` per AR round); with `prior_gain_l` (the gains past drafts predicted on average) it
  drifts back to 1 + its own ratio x `prior_gain_l` instead, so that what its rounds accepted
  is not forgotten with the draft. After `explore_every` AR rounds in a row `probe_due` asks
  for a tree. `estimate(z)` takes each row's observed gains `z` standard errors up, and, once
  it has drafted, the prior ratio `z` x `prior_spread` up (its standard error, as far as the
  drafter's record knows it): what the row could commit for all its few drafts and the
  record's tell.
  """

  ladder: tuple[int, ...]
  rows: int
  prior_tau_l: np.ndarray  # expected committed tokens at each budget for a row never drafted
  prior_ratio: float = 1.0
  prior_weight: float = 4.0
  decay: float = 0.9
  explore_every: int = 32
  prior_gain_l: np.ndarray | None = None
  prior_spread: float = 0.0

  def __post_init__(self):
    self.prior_tau_l = np.asarray(self.prior_tau_l, np.float64)
    if self.prior_tau_l.shape != (len(self.ladder),) or self.ladder[0] != 1:
      raise InputError("the prior needs one value per ladder budget, the ladder starting at AR")
    self.observed_b = np.zeros(self.rows)  # decayed sums of gains
    self.predicted_b = np.zeros(self.rows)
    self.drafts_b = np.zeros(self.rows)  # decayed count of drafting rounds
    self.last_bl = np.full((self.rows, len(self.ladder)), np.nan)  # the last draft's prediction
    self.ar_rounds_b = np.zeros(self.rows, np.int64)  # AR rounds since the last tree round

  def reset(self, rows_b) -> None:
    """Forgets the given rows (a bool mask or indices): a new request took their slots."""
    self.observed_b[rows_b] = 0.0
    self.predicted_b[rows_b] = 0.0
    self.drafts_b[rows_b] = 0.0
    self.last_bl[rows_b] = np.nan
    self.ar_rounds_b[rows_b] = 0

  def update(self, predicted_bl, observed_b, budget: int, active_b=None) -> None:
    """Records one round run at `budget` (a ladder value) for the `active_b` rows (default all).

    `predicted_bl` is the round's `expected_tau` (ignored for AR, may be None then);
    `observed_b` the tokens each row accepted plus the bonus, before any stop or length cut.
    """
    active_b = np.ones(self.rows, bool) if active_b is None else np.asarray(active_b, bool)
    if budget == 1:
      self.ar_rounds_b[active_b] += 1
      return
    index = self.ladder.index(budget)
    predicted_bl = np.asarray(predicted_bl, np.float64)
    gain_b = np.asarray(observed_b, np.float64) - 1.0
    predicted_gain_b = predicted_bl[:, index] - 1.0
    self.observed_b = np.where(active_b, self.decay * self.observed_b + gain_b, self.observed_b)
    self.predicted_b = np.where(active_b, self.decay * self.predicted_b + predicted_gain_b,
                                self.predicted_b)
    self.drafts_b = np.where(active_b, self.decay * self.drafts_b + 1.0, self.drafts_b)
    self.last_bl[active_b] = predicted_bl[active_b]
    self.ar_rounds_b[active_b] = 0

  def ratio_b(self, z: float = 0.0) -> np.ndarray:
    """Each row's calibration: observed gain per predicted gain; with `z`, taken `z` standard
    errors up: its observed gains' (`gains_up`) and, for a row that has drafted, the prior
    ratio's (a row never drafted tries a tree only where a probe pays: `probe_index`). The two
    errors are independent and add in quadrature: summed, the prior's spread, which the row's
    drafts never narrow, kept a row of a drafter that loses by a quarter drafting round after
    round (tau 2 at Qwen3-0.6B shapes, 64 tokens: 0.94 of AR)."""
    prior_b = np.where(self.drafts_b > 0, self.prior_spread * self.prior_weight, 0.0)
    observed_b = gains_up(self.observed_b, self.drafts_b, 1.0) - self.observed_b
    up_b = z * np.sqrt(prior_b**2 + observed_b**2)
    return ((self.prior_ratio * self.prior_weight + self.observed_b + up_b)
            / (self.prior_weight + self.predicted_b))

  def estimate(self, z: float = 0.0) -> np.ndarray:
    """Expected committed tokens `[B, L]` of every row at every ladder budget (with `z`, as
    `ratio_b(z)` says: what they could commit for all their rows' few drafts tell). AR's
    column is 1 (the clip to the ladder), so summed over rows it counts them."""
    ratio_b = self.ratio_b(z)
    drafted_bl = 1.0 + ratio_b[:, None] * (np.nan_to_num(self.last_bl, nan=1.0) - 1.0)
    # The last draft's weight: 1 right after it, fading with each AR round, 0 before any.
    fresh_b1 = np.where(np.isnan(self.last_bl[:, :1]), 0.0, self.decay ** self.ar_rounds_b[:, None])
    drift_bl = (self.prior_tau_l[None] if self.prior_gain_l is None
                else 1.0 + ratio_b[:, None] * self.prior_gain_l)
    tau_bl = fresh_b1 * drafted_bl + (1.0 - fresh_b1) * drift_bl
    return np.clip(tau_bl, 1.0, np.asarray(self.ladder, np.float64))

  def probe_due(self, active_b=None) -> bool:
    """True when an active row has run `explore_every` AR rounds in a row: try a tree."""
    active_b = np.ones(self.rows, bool) if active_b is None else np.asarray(active_b, bool)
    return bool(np.any(active_b & (self.ar_rounds_b >= self.explore_every)))


def cost_key(device_kind: str, target, head=None, slots: int = 1, dtype: str = "") -> dict:
  """What a cost table is valid for: the device, the target's and head's shapes, the slots."""
  target_fields = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "vocab_size", "num_experts",
                   "num_experts_per_tok", "moe_intermediate_size")
  head_fields = ("num_layers", "hidden_size", "intermediate_size", "block_size", "causal")
  return {"device": device_kind, "jax": jax.__version__, "dtype": dtype, "slots": slots,
          "target": {f: getattr(target, f) for f in target_fields if hasattr(target, f)},
          "head": None if head is None else {f: getattr(head, f) for f in head_fields}}


@dataclasses.dataclass(frozen=True)
class CostTable:
  """Seconds per round by method and budget, at each measured number of busy rows.

  `seconds[method][budget][i]` is a round at `rows[i]` busy rows (AR: method "ar", budget 1);
  `source` says, in the same layout, which entries were "measured" and which "modelled".
  Between measured row counts the time is interpolated linearly; past the largest it grows
  along the last segment; below the smallest it stays at the smallest's.
  """

  key: dict
  rows: tuple[int, ...]
  seconds: dict[str, dict[int, tuple[float, ...]]]
  source: dict[str, dict[int, tuple[str, ...]]] = dataclasses.field(default_factory=dict)
  notes: str = ""

  def __post_init__(self):
    if list(self.rows) != sorted(set(self.rows)) or not self.rows or self.rows[0] < 1:
      raise InputError(f"cost table rows must ascend from >= 1 (got {self.rows})")
    for method, by_budget in self.seconds.items():
      for budget, times in by_budget.items():
        if len(times) != len(self.rows):
          raise InputError(f"cost table {method}/{budget}: {len(times)} times for "
                           f"{len(self.rows)} row counts")

  def round_seconds(self, method: str, budgets: Sequence[int], busy_rows: float) -> np.ndarray:
    """Seconds of a round at each budget `[L]`; budget 1 is AR whatever `method` says."""
    try:
      times_lr = np.array([self.seconds[AR_METHOD if n == 1 else method][n] for n in budgets],
                          np.float64)
    except KeyError:
      raise InputError(f"cost table has no {method} round for some of budgets "
                       f"{tuple(budgets)} ({self.key})") from None
    rows_r = np.asarray(self.rows, np.float64)
    if len(rows_r) == 1:
      return times_lr[:, 0]
    rows = max(float(busy_rows), rows_r[0])
    upper = int(np.clip(np.searchsorted(rows_r, rows), 1, len(rows_r) - 1))
    weight = (rows - rows_r[upper - 1]) / (rows_r[upper] - rows_r[upper - 1])
    return times_lr[:, upper - 1] + weight * (times_lr[:, upper] - times_lr[:, upper - 1])

  def to_json(self) -> dict:
    def strings(by_method):
      return {m: {str(n): list(v) for n, v in by_budget.items()} for m, by_budget in
              by_method.items()}
    return {"key": self.key, "rows": list(self.rows), "seconds": strings(self.seconds),
            "source": strings(self.source), "notes": self.notes}

  @classmethod
  def from_json(cls, record: dict) -> CostTable:
    def numbers(by_method, kind):
      return {m: {int(n): tuple(kind(x) for x in v) for n, v in by_budget.items()}
              for m, by_budget in by_method.items()}
    return cls(key=record["key"], rows=tuple(int(r) for r in record["rows"]),
               seconds=numbers(record["seconds"], float),
               source=numbers(record.get("source", {}), str), notes=record.get("notes", ""))


def cost_tables_path() -> str | None:
  """Where measured round and step times are kept: $JETFLOW_COST_TABLES (empty: nowhere), by
  default ~/.cache/jetflow_jax/cost_tables.json."""
  path = os.environ.get(COST_TABLES_ENV)
  if path is None:
    return os.path.join(os.path.expanduser("~"), ".cache", "jetflow_jax", "cost_tables.json")
  return path or None


def _records(path: str, kind: str) -> list[dict]:
  """The records of `kind` ("tables": round times, "heads": what drafts accepted) in the JSON
  file at `path`: none where it is missing or unreadable (a cache: a damaged one is measured
  again and rewritten)."""
  try:
    with open(path) as f:
      records = json.load(f).get(kind, [])
    return [r for r in records if isinstance(r, dict) and "key" in r]
  except (OSError, ValueError, AttributeError, TypeError):
    return []


def _save_record(path: str, kind: str, record: dict) -> None:
  """Writes `record` among the `kind` records of the JSON file at `path`, replacing one with
  the same key; the other kinds stay as they are."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  data = {k: [r for r in _records(path, k) if k != kind or r["key"] != record["key"]]
          for k in ("tables", "heads")}
  data[kind].append(record)
  tmp = f"{path}.{os.getpid()}.tmp"  # each process its own; of two saving at once, one wins
  with open(tmp, "w") as f:
    json.dump(data, f, indent=1)
  os.replace(tmp, path)  # a reader never sees half a file


def save_cost_table(path: str, table: CostTable) -> None:
  """Writes `table` into the JSON file at `path`, replacing a table with the same key."""
  _save_record(path, "tables", table.to_json())


def load_cost_table(path: str, key: dict) -> CostTable | None:
  """The table for `key` in the JSON file at `path`, or None (no file, no such key, a damaged
  file or table)."""
  record = next((t for t in _records(path, "tables") if t["key"] == key), None)
  try:
    return None if record is None else CostTable.from_json(record)
  except (InputError, ValueError, KeyError, TypeError, AttributeError):
    return None


def kept_seconds(key: dict, ladder: Sequence[int], rows: int, measure: Callable[[], np.ndarray],
                 path: str | None, notes: str = "", remeasure: bool = False,
                 extras: Sequence[str] = ()) -> tuple[np.ndarray, float]:
  """Seconds of a round (or step) at each ladder budget, then of each of `extras` (other
  programs timed with them, e.g. "flush"), and how long measuring them took (0 when read):
  from the cost table at `path` when it has `key` (unless `remeasure`; a key holds its
  ladder, so its table has every budget), else `measure()` (one value per budget, then per
  extra) and saved there (`path` None: kept nowhere). In a multi-process job process 0
  reads, every process measures (the timed programs run on all), and all take process 0's
  times, which it saves."""
  main = distributed.is_main_process()
  known_l = np.full(len(ladder) + len(extras), np.nan, np.float32)
  table = load_cost_table(path, key) if path and main and not remeasure else None
  if table is not None:
    try:
      known_l = np.concatenate([table.round_seconds("tree", ladder, rows),
                                [table.seconds[name][0][0] for name in extras]]).astype(np.float32)
    except (InputError, KeyError, IndexError):  # a budget or an extra missing: measured again
      pass
  known_l = distributed.agreed(known_l)
  if np.all(np.isfinite(known_l) & (known_l > 0)):
    return known_l.astype(np.float64), 0.0
  start = time.perf_counter()
  seconds_l = distributed.agreed(np.asarray(measure(), np.float32)).astype(np.float64)
  measured_s = time.perf_counter() - start
  if path and main:
    by_budget = {n: (float(s),) for n, s in zip(ladder, seconds_l)}
    trees = [n for n in ladder if n > 1]
    seconds = {AR_METHOD: {1: by_budget[1]}, "tree": {n: by_budget[n] for n in trees},
               **{name: {0: (float(s),)} for name, s in zip(extras, seconds_l[len(ladder):])}}
    try:
      save_cost_table(path, CostTable(
          key=key, rows=(rows,), notes=notes, seconds=seconds,
          source={m: {n: ("measured",) for n in by_n} for m, by_n in seconds.items()}))
    except OSError as e:  # a cache: decoding goes on, the next start measures again
      warnings.warn(f"cannot keep the measured round times in {path} ({e.strerror or e}); set "
                    f"${COST_TABLES_ENV} to a writable file, or empty to keep none")
  return seconds_l, measured_s


def optimistic_tau(ladder: Sequence[int]) -> np.ndarray:
  """Expected committed tokens a modest head gets at each ladder budget: what a probe hopes
  for when nothing better is known."""
  ladder = np.asarray(ladder, np.float64)
  return np.minimum(ladder, 1.0 + 0.5 * np.log2(ladder))


UPPER_Z = 2.0  # a tree "could win" where a mean gain this many standard errors up says it would
HEAD_RECORD_CAP = 4096.0  # drafting rows a head record weighs at most: older runs fade
PRIOR_DRAFTS = 8.0  # a row's calibration starts at its drafter's record, weighing this many of
# its drafts at most: one draft's gain scatters by more than its mean (geometric lengths), so
# at 4 one round that accepted nothing cut a row's estimate by a fifth, enough to send a drafter
# near its break-even to AR, where the request learns nothing more
_RECORD_NUMBERS = ("observed", "predicted", "drafts", "probes", "wins", "unseen_s",
                   "prior_drafts")  # as kept


@dataclasses.dataclass(frozen=True)
class AcceptancePrior:
  """What a drafter expects of itself on a target it has not drafted for yet, from its own
  calibration (a trained head's acceptance on held-out text, a controlled drafter's
  distribution): at every ladder budget, the tokens a round commits (`tau_l`) and what its
  drafts predict there on average (`predicted_l`, as `expected_tau` reads them), weighing as
  much as `drafts` drafts run at the largest budget (`HeadRecord.with_prior`)."""

  tau_l: np.ndarray
  predicted_l: np.ndarray
  drafts: float = PRIOR_DRAFTS

  def __post_init__(self):
    tau_l, predicted_l = (np.asarray(x, np.float64) for x in (self.tau_l, self.predicted_l))
    if (tau_l.shape != predicted_l.shape or tau_l.ndim != 1 or not self.drafts > 0
        or not np.all(np.isfinite(tau_l) & (tau_l >= 1) & np.isfinite(predicted_l)
                      & (predicted_l >= 1))):
      raise InputError("an acceptance prior needs >= 1 committed and predicted tokens at every "
                       "ladder budget and a positive weight")
    object.__setattr__(self, "tau_l", tau_l)
    object.__setattr__(self, "predicted_l", predicted_l)


@dataclasses.dataclass
class HeadRecord:
  """What one drafter's drafts predicted and its rows accepted on one target, over past runs,
  and how its tree probes went (kept beside the cost tables, under "heads").

  The prior of a row this drafter has not drafted yet is `prior_tau()`: its past calibration
  (observed over predicted gains) times the gain its drafts predicted on average, or AR (1
  token at every budget) for a drafter never seen. `win_chance()` is how often a probe found
  trees paying, Beta(1, 1) before any probe. `unseen_s` is the AR time spent with the
  drafter before its first drafting round here (`unseen`): its first look is priced against
  that use as well as the request's (`first_look_index`).
  """

  key: dict
  ladder: tuple[int, ...]
  observed: float = 0.0  # gains (committed tokens - 1) of drafting rows, summed
  predicted: float = 0.0  # what their drafts predicted at the budget they ran
  predicted_gain_l: np.ndarray | None = None  # their drafts' predicted gains at every budget
  drafts: float = 0.0  # drafting rows summed in the above
  probes: float = 0.0
  wins: float = 0.0  # probes after which the rows' point estimate picked a tree (their upper
  # estimate, which a probe's one draft rarely rules out, made a probe of a drafter that loses
  # by a quarter a win, and its next probes and exploring rounds likelier)
  unseen_s: float = 0.0  # estimated seconds of AR rounds run before the drafter's first draft
  prior_drafts: float = 0.0  # of `drafts`, those standing for the drafter's own prior

  def __post_init__(self):
    self.ladder = tuple(self.ladder)
    if self.predicted_gain_l is None:
      self.predicted_gain_l = np.zeros(len(self.ladder))
    self.predicted_gain_l = np.asarray(self.predicted_gain_l, np.float64)

  def prior_tau(self) -> np.ndarray:
    return self._tau_at(self.ratio())

  def with_prior(self, prior: AcceptancePrior | None) -> HeadRecord:
    """This record; for a drafter never seen, `prior` taken as its drafts at the largest
    budget (`prior_drafts` of them), so that its first request starts where a later one would
    (a tree from the start, or AR) rather than from AR, its first look judged by predictions
    never calibrated. It still gets a look while it has not drafted here (`unseen`): a prior
    measured on other text may undersell it."""
    if prior is None or self.drafts > 0:
      return self
    if prior.tau_l.shape != (len(self.ladder),):
      raise InputError(f"the drafter's acceptance prior has {prior.tau_l.size} budgets, the "
                       f"ladder {len(self.ladder)}")
    weight = float(prior.drafts)
    return dataclasses.replace(self, observed=weight * (prior.tau_l[-1] - 1.0),
                               predicted=weight * (prior.predicted_l[-1] - 1.0),
                               predicted_gain_l=weight * (prior.predicted_l - 1.0),
                               drafts=weight, prior_drafts=weight)

  @property
  def unseen(self) -> bool:
    """No round of this drafter has drafted on this target yet (its prior aside)."""
    return self.drafts <= self.prior_drafts

  def _tau_at(self, ratio: float) -> np.ndarray:
    """Each budget's expected tokens: the average draft's predicted gains at `ratio`; AR for a
    drafter never seen."""
    if self.drafts <= 0:
      return np.ones(len(self.ladder))
    tau_l = 1.0 + ratio * self.predicted_gain_l / self.drafts
    return np.clip(tau_l, 1.0, np.asarray(self.ladder, np.float64))

  def upper_tau(self) -> np.ndarray:
    """What a round could commit at each budget for all this record knows: `prior_tau()` with
    the mean gain per draft `UPPER_Z` standard errors up. The spread is what i.i.d. acceptance
    gives (geometric lengths, variance m (1 + m)), so a record of a few drafts, which one
    unlucky stretch of a request can fill, still lets a probe find out, and a long one does
    not. AR for a drafter never seen."""
    return self._tau_at(self.ratio() + UPPER_Z * self.ratio_spread())

  def ratio(self) -> float:
    """Observed over predicted gains, one pseudo-count each."""
    return (self.observed + 1.0) / (self.predicted + 1.0)

  def ratio_spread(self) -> float:
    """The standard error of `ratio()`: what the spread of i.i.d. gains (`gains_up`) leaves
    unknown after this record's drafts."""
    return float(gains_up(self.observed, self.drafts, 1.0) - self.observed) / (
        self.predicted + 1.0)

  def model_prior(self) -> dict:
    """An `AcceptanceModel`'s prior fields from this record: rows never drafted at
    `prior_tau()`, and each row's calibration at the record's ratio, weighing as much as
    `PRIOR_DRAFTS` of its drafts (all of them, if it holds fewer), so that one unlucky round
    moves a well-known drafter no more than its past rounds warrant, and taken as uncertain as
    the record's drafts leave it (`ratio_spread`): a row of a drafter near its break-even,
    known from a few drafts (or from its own prior), is not sent to AR by one unlucky stretch,
    one known from thousands is. A drafter never seen: the model's defaults, AR."""
    if self.drafts <= 0:
      return {"prior_tau_l": self.prior_tau(), "prior_ratio": 1.0,
              "prior_weight": AcceptanceModel.prior_weight, "prior_gain_l": None,
              "prior_spread": 0.0}
    return {"prior_tau_l": self.prior_tau(), "prior_ratio": self.ratio(),
            "prior_weight": max(AcceptanceModel.prior_weight,
                                min(PRIOR_DRAFTS, self.drafts) * self.predicted / self.drafts),
            "prior_gain_l": self.predicted_gain_l / self.drafts,
            "prior_spread": self.ratio_spread()}

  def acceptance_model(self, rows: int, explore_every: int) -> AcceptanceModel:
    """A model of `rows` rows that starts from this record (`model_prior`)."""
    return AcceptanceModel(self.ladder, rows, explore_every=explore_every, **self.model_prior())

  def win_chance(self, needed_l=None):
    """The chance a probe finds trees paying at each budget: its past probes' wins, with two
    pseudo-probes at the chance this record itself gives that a round commits more than
    `needed_l` tokens (`chance_above`, between `prior_tau()` and `upper_tau()`), even odds
    where it holds no drafts or no `needed_l` is given. A drafter whose own prior says it
    loses by a quarter is not probed at the even odds of one never seen."""
    chance = (0.5 if needed_l is None or self.drafts <= 0
              else chance_above(self.prior_tau(), self.upper_tau(), needed_l))
    return (self.wins + 2.0 * chance) / (self.probes + 2.0)

  def add_unseen(self, ar_seconds: float) -> None:
    """Counts `ar_seconds` of AR rounds run with this drafter while it is `unseen`."""
    if self.unseen:
      self.unseen_s += ar_seconds

  def add_drafts(self, predicted_bl, observed_b, budget: int, active_b) -> None:
    """One drafting round's `active_b` rows: predictions `[B, L]` and committed tokens `[B]`."""
    index, active_b = self.ladder.index(budget), np.asarray(active_b, bool)
    predicted_bl = np.asarray(predicted_bl, np.float64)[active_b]
    self.observed += float(np.sum(np.asarray(observed_b, np.float64)[active_b] - 1.0))
    self.predicted += float(np.sum(predicted_bl[:, index] - 1.0))
    self.predicted_gain_l = self.predicted_gain_l + np.sum(predicted_bl - 1.0, axis=0)
    self.drafts += float(active_b.sum())
    if self.drafts > HEAD_RECORD_CAP:
      fade = HEAD_RECORD_CAP / self.drafts
      self.observed, self.predicted, self.drafts = (self.observed * fade, self.predicted * fade,
                                                    HEAD_RECORD_CAP)
      self.predicted_gain_l = self.predicted_gain_l * fade
      self.prior_drafts *= fade

  def as_array(self) -> np.ndarray:
    return np.concatenate([[getattr(self, f) for f in _RECORD_NUMBERS],
                           self.predicted_gain_l]).astype(np.float64)

  def with_array(self, values) -> HeadRecord:
    values = np.asarray(values, np.float64)
    numbers = {f: float(v) for f, v in zip(_RECORD_NUMBERS, values)}
    return dataclasses.replace(self, **numbers, predicted_gain_l=values[len(numbers):])


def load_head_record(path: str | None, key: dict, ladder: Sequence[int],
                     prior: AcceptancePrior | None = None) -> HeadRecord:
  """The record of `key` in the JSON file at `path`, else a fresh one, which starts from the
  drafter's `prior` where it has one (`HeadRecord.with_prior`); the same on every process of a
  job (process 0 reads it)."""
  record = HeadRecord(key, tuple(ladder))
  found = (next((r for r in _records(path, "heads") if r["key"] == key), None)
           if path and distributed.is_main_process() else None)
  values = record.as_array()
  if found is not None:
    try:
      for name in ("unseen_s", "prior_drafts"):
        found.setdefault(name, 0.0)  # a record kept before it was counted
      read = np.asarray([found[f] for f in _RECORD_NUMBERS] + list(found["predicted_gain_l"]),
                        np.float64)
      if (read.shape == values.shape and np.all(np.isfinite(read))
          and np.all(read[2:len(_RECORD_NUMBERS)] >= 0)):
        values = read
    except (KeyError, TypeError, ValueError):  # a damaged record: start afresh
      pass
  return record.with_array(distributed.agreed(values)).with_prior(prior)


def save_head_record(path: str | None, record: HeadRecord) -> None:
  """Keeps `record` in the JSON file at `path` (process 0; a cache: a failure only warns)."""
  if not path or not distributed.is_main_process():
    return
  try:
    _save_record(path, "heads", {
        "key": record.key, **{f: getattr(record, f) for f in _RECORD_NUMBERS},
        "predicted_gain_l": record.predicted_gain_l.tolist()})
  except OSError as e:
    warnings.warn(f"cannot keep what the drafter accepted in {path} ({e.strerror or e})")


def probe_index(remaining: float, seconds_l, probe_seconds_l, hope_l, win_chance) -> int:
  """The ladder index of the tree worth probing now, 0 for none.

  A probe at budget n costs `probe_seconds_l[n]` (the round, and whatever must run before it,
  such as the flush of held-back context). What it may save: were the row to commit
  `hope_l[n]` tokens a round from here on, its `remaining` tokens would take
  remaining x seconds_l[n] / hope_l[n] instead of remaining x seconds_l[0] on AR. It runs
  where `win_chance` (one for all budgets, or one each) x that saving exceeds its cost.
  """
  seconds_l, hope_l = np.asarray(seconds_l, np.float64), np.asarray(hope_l, np.float64)
  saving_l = remaining * (seconds_l[0] - seconds_l / hope_l)
  value_l = np.asarray(win_chance, np.float64) * saving_l - np.asarray(probe_seconds_l, np.float64)
  value_l[0] = 0.0
  index = int(np.argmax(value_l))
  return index if value_l[index] > 0 else 0


def chance_above(point_l, upper_l, needed_l) -> np.ndarray:
  """The chance that a round commits more than `needed_l` tokens at each budget, where
  `point_l` estimates what it commits and `upper_l` is that estimate `UPPER_Z` standard errors
  up (a normal error; no spread: 1 where the estimate clears `needed_l`, else 0)."""
  point_l, upper_l, needed_l = np.broadcast_arrays(*(np.asarray(x, np.float64)
                                                     for x in (point_l, upper_l, needed_l)))
  spread_l = (upper_l - point_l) / UPPER_Z
  return np.array([0.5 * math.erfc((n - p) / (s * math.sqrt(2.0))) if s > 0 else float(p > n)
                   for p, s, n in zip(point_l.ravel(), spread_l.ravel(), needed_l.ravel())]
                  ).reshape(point_l.shape)


def explore_index(remaining: float, seconds_l, point_l, upper_l, win_chance, index: int) -> int:
  """`index` where a tree round at it, which a row's estimate `UPPER_Z` standard errors up
  (`upper_l`, tokens a round commits at each budget) picks and its point estimate (`point_l`)
  does not, is worth its expected loss against AR; else 0.

  Such a round explores: at the point estimate it loses seconds_l[n] - point_l[n] x
  seconds_l[0] against AR; were the optimism right, the `remaining` tokens would save
  remaining x (seconds_l[0] - seconds_l[n] / upper_l[n]). The chance of that is the
  drafter's record's (`HeadRecord.win_chance`), not the row's own: a row of a drafter that
  wins meets unlucky stretches, and a chance taken from them stopped it drafting where it
  should not (the record left low kept later requests on AR); one of a drafter whose record
  says it loses leaves trees as soon as the tokens left cannot pay for the round.
  """
  seconds_l = np.asarray(seconds_l, np.float64)
  loss = seconds_l[index] - float(point_l[index]) * seconds_l[0]
  saving = remaining * (seconds_l[0] - seconds_l[index] / float(upper_l[index]))
  return index if float(np.broadcast_to(win_chance, seconds_l.shape)[index]) * saving >= loss \
      else 0


def first_look_index(remaining: float, seconds_l, probe_seconds_l, share: float,
                     unseen_s: float = 0.0) -> int:
  """The ladder index of the probe that looks at a drafter never seen, 0 for none: the one that
  risks least, where that is at most `share` of the AR time of the `remaining` tokens and of
  the `unseen_s` seconds the drafter has already run unseen.

  A probe commits at least the one token an AR round would, so at worst it loses
  `probe_seconds_l[n] - seconds_l[0]`; with no record of the drafter, `probe_index` cannot
  weigh what it may find, and without a look the drafter would stay unseen for good. What the
  look finds is kept for later requests, so it is priced against all of the drafter's use so
  far: short requests that could not afford it alone add up until one can, and the look never
  costs more than `share` of the AR time spent with the drafter.
  """
  seconds_l = np.asarray(seconds_l, np.float64)
  risk_l = np.asarray(probe_seconds_l, np.float64)[1:] - seconds_l[0]
  if not risk_l.size:
    return 0
  index = int(np.argmin(risk_l))
  return index + 1 if risk_l[index] <= share * (remaining * seconds_l[0] + unseen_s) else 0


@dataclasses.dataclass(frozen=True)
class Choice:
  """A chosen budget (`choose_budget`)."""

  budget: int
  index: int  # in the ladder
  tokens_per_s_l: np.ndarray  # expected committed tokens per second at every ladder budget


def best_budget(tokens_l, seconds_l, ladder: Sequence[int], probe: bool = False) -> Choice:
  """The budget with the most `tokens_l / seconds_l`; `probe` leaves AR out when it can."""
  rate_l = np.asarray(tokens_l, np.float64) / np.asarray(seconds_l, np.float64)
  pick = rate_l.copy()
  if probe and len(ladder) > 1 and ladder[0] == 1:
    pick[0] = -np.inf
  index = int(np.argmax(pick))
  return Choice(budget=int(ladder[index]), index=index, tokens_per_s_l=rate_l)


def choose_budget(tau_bl, costs: CostTable, method: str, ladder: Sequence[int],
                  busy_rows: int | None = None, probe: bool = False) -> Choice:
  """The ladder budget maximising expected committed tokens per second for these rows.

  `tau_bl` holds the busy rows' expected committed tokens at each ladder budget
  (`AcceptanceModel.estimate()`, or `expected_tau` straight from a draft); AR commits one token
  a row. `busy_rows` (default: the rows of `tau_bl`) picks the round times in `costs`.

  Returns:
    The `Choice`: the budget, its index in the ladder, and the expected tokens per second of
    every ladder budget.
  """
  tau_bl = np.asarray(tau_bl, np.float64)
  tokens_l = tau_bl.sum(axis=0)
  if ladder[0] == 1:
    tokens_l[0] = tau_bl.shape[0]
  rows = tau_bl.shape[0] if busy_rows is None else busy_rows
  return best_budget(tokens_l, costs.round_seconds(method, ladder, rows), ladder, probe)

