"""The budget chooser's pieces on synthetic inputs: ladder, expected tokens, calibration, costs."""

import dataclasses
import json
import statistics
import time

import jax
import numpy as np
import pytest

from jetflow_jax.decoding.budget import (LADDER, PRIOR_DRAFTS, UPPER_Z, AcceptanceModel,
                                         AcceptancePrior, CostTable, HeadRecord, best_budget,
                                         budget_ladder, chance_above, choose_budget, cost_key,
                                         draft_expected_tau, expected_tau, explore_index,
                                         first_look_index, kept_seconds,
                                         load_cost_table, load_head_record, probe_index,
                                         save_cost_table, save_head_record)
from jetflow_jax.engine.budgets import BudgetChooser
from jetflow_jax.engine.state import StepOutput
from jetflow_jax.errors import InputError
from jetflow_jax.head_acceptance import committed_by_budget
from jetflow_jax.tree import build_tree, build_tree_accum


def random_logprobs(seed, batch, depth, vocab, scale=2.0):
  logits = np.random.default_rng(seed).normal(size=(batch, depth, vocab)) * scale
  return np.asarray(jax.nn.log_softmax(logits, axis=-1), np.float32)


def test_ladder():
  assert budget_ladder(256) == LADDER == (1, 4, 8, 16, 32, 64, 128, 256)
  assert budget_ladder(64) == (1, 4, 8, 16, 32, 64)
  assert budget_ladder(100) == (1, 4, 8, 16, 32, 64, 100)
  assert budget_ladder(1) == (1,)
  with pytest.raises(InputError):
    budget_ladder(0)


@pytest.mark.parametrize("kind", ["top_n", "accum"])
def test_expected_tau_at_every_budget_is_that_budgets_own_tree(kind):
  # build_tree emits its nodes by depth, not by score: expected_tau sorts them, and each
  # budget's sum then equals the sum over the tree built at that budget.
  logprobs = random_logprobs(0, 3, 4, 12)
  ladder = (1, 4, 17, 50)
  build = build_tree_accum if kind == "accum" else build_tree
  tau_bl = np.asarray(draft_expected_tau(logprobs, ladder, 3, kind))
  np.testing.assert_allclose(tau_bl[:, 0], 1.0)
  for index, budget in enumerate(ladder[1:], 1):
    direct_b = np.exp(np.asarray(build(logprobs, budget, 3).scores)).sum(axis=1)
    np.testing.assert_allclose(tau_bl[:, index], direct_b, rtol=1e-5)
  assert np.all(np.diff(tau_bl, axis=1) > 0)
  if kind == "top_n":  # the exact top-N is never worse than the reference's heap
    accum_bl = np.asarray(draft_expected_tau(logprobs, ladder, 3, "accum"))
    assert np.all(tau_bl >= accum_bl - 1e-5)
  jitted = jax.jit(draft_expected_tau, static_argnums=(1, 2, 3))(logprobs, ladder, 3, kind)
  np.testing.assert_allclose(np.asarray(jitted), tau_bl, rtol=1e-6)


def test_expected_tau_is_the_mean_accepted_length_when_the_target_samples_the_draft():
  logprobs = random_logprobs(1, 1, 3, 5, scale=1.5)
  tree = build_tree(logprobs, 20, 3)
  want = float(expected_tau(tree, (20,))[0, 0])
  tokens, parents = np.asarray(tree.tokens[0]), np.asarray(tree.parents[0])
  children = {(int(p), int(t)): i for i, (p, t) in enumerate(zip(parents, tokens)) if i}
  probs_dv = np.exp(logprobs[0].astype(np.float64))
  rng = np.random.default_rng(0)
  draws_sd = np.stack([rng.choice(5, 40000, p=p / p.sum()) for p in probs_dv], axis=1)
  committed = []
  for draws in draws_sd:
    node, count = 0, 1
    for token in draws:
      node = children.get((node, int(token)))
      if node is None:
        break
      count += 1
    committed.append(count)
  assert abs(np.mean(committed) - want) < 0.02


def test_acceptance_model_calibrates_each_row_and_falls_back_to_the_prior():
  ladder = (1, 4, 16)
  prior = np.array([1.0, 2.0, 3.0])
  model = AcceptanceModel(ladder, rows=2, prior_tau_l=prior, prior_weight=2.0, decay=0.9,
                          explore_every=3)
  np.testing.assert_allclose(model.estimate(), [prior, prior])  # no draft yet
  predicted_bl = np.array([[1.0, 3.0, 5.0], [1.0, 3.0, 5.0]])
  for _ in range(200):  # row 0 accepts half its predicted gain, row 1 all of it
    model.update(predicted_bl, np.array([3.0, 5.0]), budget=16)
  # The prior (ratio 1, weight 2) stays in the decayed sums: row 0 settles at 22 / 42.
  np.testing.assert_allclose(model.ratio_b(), [22 / 42, 1.0], rtol=1e-6)
  np.testing.assert_allclose(model.estimate(), [[1.0, 1 + 44 / 42, 1 + 88 / 42], [1.0, 3.0, 5.0]],
                             rtol=1e-6)
  # Row 1 idles (inactive); row 0 runs AR rounds: its evidence fades towards the prior.
  assert not model.probe_due()
  for _ in range(3):
    model.update(None, np.ones(2), budget=1, active_b=[True, False])
  assert model.probe_due() and not model.probe_due(active_b=[False, True])
  faded = model.estimate()
  fresh = 0.9**3
  assert faded[0, 2] == pytest.approx(fresh * (1 + 88 / 42) + (1 - fresh) * 3.0)
  assert faded[1, 2] == pytest.approx(5.0)
  model.reset([1])
  np.testing.assert_allclose(model.estimate()[1], prior)
  # Estimates never exceed what a budget can commit, nor fall below the bonus token.
  model.update(np.array([[1.0, 9.0, 30.0]] * 2), np.array([20.0, 1.0]), budget=16)
  assert np.all(model.estimate() <= np.array(ladder)) and np.all(model.estimate() >= 1.0)


def test_a_rows_upper_estimate_narrows_as_its_drafts_add_up():
  """`estimate(z)`: each row's observed gains `z` standard errors up (geometric lengths: a
  draft's gain m has variance m (1 + m)): the point estimate before any draft, far above it
  after one unlucky draft, close to it after many."""
  ladder = (1, 16)
  model = AcceptanceModel(ladder, rows=2, prior_tau_l=np.array([1.0, 4.0]), prior_weight=4.0,
                          decay=1.0)
  np.testing.assert_allclose(model.estimate(2.0), model.estimate())
  predicted_bl = np.array([[1.0, 16.0]] * 2)
  model.update(predicted_bl, np.array([1.0, 1.0]), budget=16, active_b=[True, False])
  # Row 0: one draft that gained nothing of 15 predicted; its mean gain (0 + 1) / (1 + 1).
  spread = np.sqrt(0.5 * 1.5 * 1)
  assert model.estimate()[0, 1] == pytest.approx(1 + 15 * 4 / 19)
  assert model.estimate(2.0)[0, 1] == pytest.approx(1 + 15 * (4 + 2 * spread) / 19)
  np.testing.assert_allclose(model.estimate(2.0)[1], model.estimate()[1])  # row 1: no draft
  for _ in range(400):  # 3 of 15 predicted, round after round
    model.update(predicted_bl, np.array([4.0, 4.0]), budget=16)
  point, upper = model.estimate()[:, 1], model.estimate(2.0)[:, 1]
  assert np.all(upper > point) and np.all(upper < 1.1 * point)


def test_a_known_drafter_seeds_each_rows_calibration():
  """A drafter whose record says it accepts half its predicted gain: one round that accepts
  nothing moves a row by one round's weight against PRIOR_DRAFTS drafts of the record (all of
  a thinner record's), and AR rounds after it drift the draft back to the record's, not the
  row's ratio."""
  ladder = (1, 4, 16)
  record = HeadRecord({}, ladder, observed=299.0, predicted=599.0, drafts=50.0,
                      predicted_gain_l=np.array([0.0, 150.0, 600.0]))
  ratio = 300 / 600
  np.testing.assert_allclose(record.prior_tau(), [1.0, 1 + ratio * 3, 1 + ratio * 12])
  model = record.acceptance_model(rows=1, explore_every=32)
  np.testing.assert_allclose(model.estimate()[0], record.prior_tau())
  model.update(np.array([[1.0, 4.0, 13.0]]), np.array([1.0]), budget=16)  # gain 0 of 12
  weight = PRIOR_DRAFTS * 599 / 50
  row_ratio = ratio * weight / (weight + 12)
  np.testing.assert_allclose(model.estimate()[0], [1.0, 1 + row_ratio * 3, 1 + row_ratio * 12])
  for _ in range(100):
    model.update(None, None, budget=1)
  np.testing.assert_allclose(model.estimate()[0], [1.0, 1 + row_ratio * 3, 1 + row_ratio * 12])
  # A record of fewer drafts than PRIOR_DRAFTS weighs no more than it holds.
  thin = HeadRecord({}, ladder, observed=9.0, predicted=23.0, drafts=2.0,
                    predicted_gain_l=np.array([0.0, 6.0, 24.0]))
  assert thin.acceptance_model(rows=1, explore_every=32).prior_weight == 23.0
  # Without a record: the old defaults (ratio 1 weighing 4 predicted tokens), drift to AR.
  fresh = HeadRecord({}, ladder).acceptance_model(rows=1, explore_every=32)
  assert fresh.prior_ratio == 1.0 and fresh.prior_weight == 4.0 and fresh.prior_gain_l is None


def table(rows, ar, tree_by_budget, method="jetflow"):
  return CostTable(key={"device": "test"}, rows=rows, seconds={
      "ar": {1: tuple(ar)}, method: {n: tuple(t) for n, t in tree_by_budget.items()}})


def test_cost_table_interpolates_between_measured_rows_and_round_trips(tmp_path):
  costs = table((1, 8, 32), [1.0, 2.0, 4.0], {4: [2.0, 4.0, 12.0], 16: [3.0, 10.0, 40.0]})
  np.testing.assert_allclose(costs.round_seconds("jetflow", (1, 4, 16), 1), [1.0, 2.0, 3.0])
  np.testing.assert_allclose(costs.round_seconds("jetflow", (1, 4, 16), 20), [3.0, 8.0, 25.0])
  np.testing.assert_allclose(costs.round_seconds("jetflow", (4,), 56), [20.0])  # past the last
  np.testing.assert_allclose(costs.round_seconds("jetflow", (4,), 0.5), [2.0])
  with pytest.raises(InputError, match="no jetflow round"):
    costs.round_seconds("jetflow", (1, 8), 1)
  path = str(tmp_path / "costs.json")
  assert load_cost_table(path, costs.key) is None
  save_cost_table(path, costs)
  other = table((1,), [5.0], {4: [6.0]})
  other = CostTable(key={"device": "other"}, rows=other.rows, seconds=other.seconds)
  save_cost_table(path, other)
  save_cost_table(path, costs)  # the same key replaces, never duplicates
  assert load_cost_table(path, costs.key) == costs
  assert load_cost_table(path, other.key) == other
  assert load_cost_table(path, {"device": "nope"}) is None
  for damaged in ("{not json", '{"tables": 3}', '{"tables": [{"key": {"device": "test"}}]}',
                  '{"tables": [{"key": {"device": "test"}, "rows": [1], "seconds": []}]}'):
    (tmp_path / "costs.json").write_text(damaged)  # a cache: read as empty, then rewritten
    assert load_cost_table(path, costs.key) is None
    save_cost_table(path, costs)
    assert load_cost_table(path, costs.key) == costs
  key = cost_key("cpu", type("T", (), {"hidden_size": 64, "num_hidden_layers": 2})(), None, 4)
  assert key == {"device": "cpu", "jax": jax.__version__, "dtype": "", "slots": 4, "head": None,
                 "target": {"hidden_size": 64, "num_hidden_layers": 2}}
  with pytest.raises(InputError):
    table((8, 1), [1, 1], {})


LADDER_4 = (1, 4, 16, 64)


def tau_profile(gain_at_64, rows):
  """Expected tokens that grow like log(N), `gain_at_64` beyond the bonus at N = 64."""
  gain_l = gain_at_64 * np.log2(np.array(LADDER_4)) / 6
  return np.tile(1.0 + gain_l, (rows, 1))


def test_a_flat_cost_picks_the_largest_tree():
  costs = table((1,), [1.0], {n: [1.0] for n in LADDER_4[1:]})
  choice = choose_budget(tau_profile(0.3, 4), costs, "jetflow", LADDER_4)
  assert choice.budget == 64 and choice.index == 3


def test_a_linear_cost_with_a_weak_draft_picks_ar():
  costs = table((1,), [1.0], {n: [1.0 + n / 4] for n in LADDER_4[1:]})
  assert choose_budget(tau_profile(1.5, 4), costs, "jetflow", LADDER_4).budget == 1
  # A probe still tries the best tree; a strong draft takes one without asking.
  assert choose_budget(tau_profile(1.5, 4), costs, "jetflow", LADDER_4, probe=True).budget == 4
  strong = np.tile([1.0, 3.9, 5.0, 6.0], (4, 1))
  assert choose_budget(strong, costs, "jetflow", LADDER_4).budget == 4


def test_the_choice_moves_with_the_busy_rows_as_the_table_says():
  # Trees cost little more than AR for one row and grow with rows x N, as on a GPU.
  ar = [1.0, 1.2, 2.0]
  costs = table((1, 8, 32), ar, {n: [1.0 + 0.001 * n, 1.2 + 0.02 * n, 2.0 + 0.2 * n]
                                 for n in LADDER_4[1:]})
  chosen = [choose_budget(tau_profile(5.0, rows), costs, "jetflow", LADDER_4).budget
            for rows in (1, 8, 32)]
  assert chosen == [64, 16, 4]
  # The same estimates, but all 32 slots' times asked for by 8 busy rows.
  assert choose_budget(tau_profile(5.0, 8), costs, "jetflow", LADDER_4, busy_rows=32).budget == 4


def test_best_budget_and_the_choosers_own_time():
  choice = best_budget([1.0, 3.0, 4.0], [1.0, 2.0, 2.0], (1, 4, 8))
  assert choice.budget == 8 and np.allclose(choice.tokens_per_s_l, [1.0, 1.5, 2.0])
  costs = table((1, 8, 32), [1.0, 1.2, 2.0], {n: [1.0, 2.0, 3.0] for n in LADDER[1:]})
  model = AcceptanceModel(LADDER, rows=32, prior_tau_l=np.linspace(1, 6, len(LADDER)))
  model.update(np.tile(np.linspace(1, 8, len(LADDER)), (32, 1)), np.full(32, 4.0), budget=64)
  seconds = []
  for _ in range(200):
    start = time.perf_counter()
    choose_budget(model.estimate(), costs, "jetflow", LADDER, busy_rows=32,
                  probe=model.probe_due())
    seconds.append(time.perf_counter() - start)
  assert np.median(seconds) < 3e-4  # estimate + choice for 32 rows x 8 budgets


def test_a_probe_runs_only_where_it_can_pay_for_itself():
  seconds_l = np.array([1.0, 1.6, 2.5, 4.0])  # AR, 4, 8, 16
  probe_l = seconds_l + 2.0  # each round after a flush of 2
  hope_l = np.array([1.0, 2.0, 2.5, 3.0])
  # Saving a token: 1 - 1.6 / 2 = 0.2 at 4, 0 at 8, -1/3 at 16. Half a chance of winning.
  assert probe_index(10, seconds_l, probe_l, hope_l, 0.5) == 0  # 0.5 x 2 < 3.6: not worth it
  assert probe_index(100, seconds_l, probe_l, hope_l, 0.5) == 1  # 0.5 x 20 > 3.6: probe 4
  assert probe_index(100, seconds_l, probe_l, hope_l, 0.1) == 0  # rarely wins: no
  assert probe_index(10**6, seconds_l * [1, 9, 9, 9], probe_l, hope_l, 1.0) == 0  # never pays
  # The budget worth most: at a higher hope the larger trees save more per token.
  assert probe_index(1000, seconds_l, probe_l, np.array([1.0, 2.0, 4.0, 8.0]), 0.5) == 3


def test_the_chance_a_tree_pays_is_a_normal_tail_between_the_two_estimates():
  """`chance_above` against the standard library's normal distribution: the estimate 2 and
  2.6 two standard errors up is a spread of 0.3."""
  got = chance_above([2.0, 2.0, 3.0, 1.0], [2.6, 2.6, 3.0, 1.0], [2.5, 1.8, 2.5, 2.5])
  oracle = [1 - statistics.NormalDist(2.0, 0.3).cdf(2.5), 1 - statistics.NormalDist(
      2.0, 0.3).cdf(1.8), 1.0, 0.0]  # no spread: whether the estimate clears it
  np.testing.assert_allclose(got, oracle, rtol=1e-12)


def test_a_tree_only_optimism_picks_runs_where_the_records_chance_is_worth_its_loss():
  """At Qwen3-0.6B round times on CPU (a 16-node round must commit 2.8 tokens to beat AR): a
  row of a drafter whose record gives trees a 9% chance, its point estimate 2.1, explores only
  where enough tokens are left, the switch exactly where chance x saving meets the expected
  loss; a row of a drafter whose record wins, in an unlucky stretch (2.7), explores to the end
  of its request, since it loses little a round."""
  seconds_l = np.array([0.088, 0.27, 0.28, 0.245])  # AR, 4, 8, 16
  point_l, upper_l = np.array([1.0, 1.2, 1.5, 2.1]), np.array([1.0, 1.4, 2.0, 3.0])
  loss = 0.245 - 2.1 * 0.088
  switch = loss / (0.09 * (0.088 - 0.245 / 3.0))  # tokens left where it starts to pay: 106
  assert explore_index(switch * 0.99, seconds_l, point_l, upper_l, 0.09, 3) == 0
  assert explore_index(switch * 1.01, seconds_l, point_l, upper_l, 0.09, 3) == 3
  assert explore_index(64, seconds_l, point_l, upper_l, np.full(4, 0.09), 3) == 0
  unlucky_l, hopeful_l = np.array([1.0, 1.6, 2.2, 2.7]), np.array([1.0, 2.0, 3.0, 3.7])
  assert explore_index(4, seconds_l, unlucky_l, hopeful_l, 0.6, 3) == 3
  assert explore_index(4, seconds_l, unlucky_l, hopeful_l, 0.01, 3) == 0


def test_a_drafter_that_loses_leaves_trees_though_its_record_is_its_prior():
  """A drafter whose own prior says 2.1 tokens at 16, where a round must commit 2.8 to beat AR,
  drafting at that rate: its upper estimate falls under the break-even within twenty rounds
  (summed rather than added in quadrature, the prior's spread, which no draft narrows, kept it
  above for good), and its record's chance of a win is small from the start."""
  ladder, needed_l = (1, 4, 8, 16), np.array([1.0, 3.1, 3.2, 2.8])
  prior = AcceptancePrior(tau_l=[1.0, 1.2, 1.5, 2.0], predicted_l=[1.0, 4.0, 8.0, 16.0])
  record = HeadRecord({"head": "h"}, ladder).with_prior(prior)
  assert record.upper_tau()[3] > needed_l[3] and record.win_chance(needed_l)[3] < 0.1
  model = record.acceptance_model(rows=1, explore_every=32)
  uppers = []
  for _ in range(20):
    model.update(np.array([[1.0, 4.0, 8.0, 16.0]]), [2.0], 16)
    uppers.append(model.estimate(UPPER_Z)[0, 3])
  assert uppers[0] > needed_l[3] > uppers[-1], uppers


def test_a_drafter_never_seen_gets_one_look_that_risks_a_small_share():
  seconds_l = np.array([1.0, 3.0, 2.5, 4.0])  # AR, 4, 8, 16: the 8-node round risks least
  probe_l = seconds_l + 0.5  # each after a flush
  # Worst case the look commits one token: it loses 2.0 at budget 8, against 3% of the AR time.
  assert first_look_index(100, seconds_l, probe_l, 0.03) == 2  # 2.0 <= 3.0
  assert first_look_index(50, seconds_l, probe_l, 0.03) == 0  # 2.0 > 1.5: too short to look
  assert first_look_index(100, seconds_l[:1], probe_l[:1], 0.03) == 0  # AR only: nothing to try
  # What the look finds is kept: the drafter's earlier AR time unseen counts with the request's.
  assert first_look_index(50, seconds_l, probe_l, 0.03, unseen_s=16.0) == 0  # 2.0 > 1.98
  assert first_look_index(50, seconds_l, probe_l, 0.03, unseen_s=17.0) == 2  # 2.0 <= 2.01


def test_the_engine_looks_at_a_new_drafter_and_starts_slots_from_its_record():
  """The engine's chooser as the device loop's: a drafter never seen gets one look once the
  AR steps spent with it make the look's risk a small share (FIRST_LOOK_SHARE, 5%), and a
  known drafter's slots start from its record's calibration, re-read when a request arrives."""
  ladder, seconds_l = (1, 4, 8), np.array([1.0, 3.0, 5.0])
  busy, left = [True, True], [10, 10]

  def output(committed, predicted_l):
    return StepOutput(*[np.zeros((2, 1))] * 4, predicted_brl=np.tile(predicted_l, (2, 1, 1)),
                      committed_br=np.full((2, 1), committed))

  chooser = BudgetChooser(ladder, 2, seconds_l, rounds_per_step=1)
  # 10 steps left cannot pay the look's worst case (2 s lost at budget 4) alone: 5% of 10 s.
  # Each AR step adds its second to the drafter's unseen time, until 5% of 10 + 30 s covers it.
  for _ in range(30):
    assert chooser.choose(busy, left) == 1
    chooser.record_step(1, output(1, [1.0, 1.0, 1.0]), busy)
  assert chooser.record.unseen_s == 30.0
  assert chooser.choose(busy, left) == 4  # the look: the tree that risks least
  assert chooser.choose(busy, left) == 1  # one look, though the record has not heard of it yet
  chooser.record_step(4, output(2, [1.0, 3.0, 4.0]), busy)  # gains 1 of 2 predicted a row
  assert chooser.record.drafts == 2 and chooser.record.probes == 1
  # Not a win: the slots' point estimate (2.7 tokens for a step of 3 AR steps) says AR, though
  # their upper estimate, one draft being little to go by, picks the 4-node tree (3.6 tokens).
  assert chooser.record.wins == 0
  # That tree explores where the record's chance (0.11) of it paying over the steps left is
  # worth its expected loss (a third of a step): over 100 steps, not over 10.
  assert chooser.choose(busy, [100, 100]) == 4 and chooser.choose(busy, left) == 1
  # A known drafter: each slot's calibration starts at its record's ratio (observed over
  # predicted gains, one pseudo-count each).
  record = chooser.record
  assert chooser.model.prior_ratio == 1.0  # built before the drafter was seen
  chooser.reset(0)
  assert chooser.model.prior_ratio == record.ratio() == (2 + 1) / (4 + 1)
  record.add_drafts(np.array([[1.0, 3.0, 8.0]] * 2), np.array([1.0, 1.0]), 8, busy)
  chooser.reset(1)
  assert chooser.model.prior_ratio == record.ratio() == (2 + 1) / (4 + 14 + 1)
  np.testing.assert_allclose(chooser.model.estimate()[1], record.prior_tau())
  known = BudgetChooser(ladder, 2, seconds_l, rounds_per_step=1, record=record)
  assert known.model.prior_ratio == record.ratio() and known.model.prior_gain_l is not None



def test_the_engine_leaves_a_request_that_will_not_draft_to_plain_ar():
  """As the device loop (`auto.drafts_ahead`): a request whose first decision alone is AR to the
  end counts as AR; while only such requests are busy, steps keep no taps; the drafts of a
  slot whose context was not kept teach the record nothing."""
  ladder, seconds_l = (1, 4, 8), np.array([1.0, 3.0, 5.0])
  chooser = BudgetChooser(ladder, 2, seconds_l, rounds_per_step=1)
  chooser.reset(0, max_tokens=10)  # 10 steps pay no probe and no look (as above)
  assert chooser.plain_b.tolist() == [True, False] and not chooser.drafting([True, False])
  assert [chooser.choose([True, False], [10, 0]) for _ in range(40)] == [1] * 40
  chooser.reset(1, max_tokens=1000)  # 1000 steps pay the look
  assert chooser.drafting([True, True]) and (budget := chooser.choose([True, True], [9, 1000])) > 1
  chooser.record_step(budget, StepOutput(*[np.zeros((2, 1))] * 4,
                                         predicted_brl=np.tile([1.0, 3.0, 4.0], (2, 1, 1)),
                                         committed_br=np.full((2, 1), 2)), [True, True])
  assert chooser.record.drafts == 1  # slot 1's draft only
  chooser.reset(0)  # without its tokens, a request may draft
  scheduled = BudgetChooser(ladder, 1, seconds_l, rounds_per_step=1, schedule=(1, 4))
  scheduled.reset(0, max_tokens=10)  # a schedule runs what it says
  assert chooser.drafting([True, False]) and scheduled.drafting([True])


def thin_and_long_records(ladder=(1, 4, 16)):
  """Two records of drafts at the same ratio, 2 accepted of 21 predicted gains (plus one
  pseudo-count each): 4 drafts, and 100 times as many."""
  thin = HeadRecord({}, ladder, observed=1.0, predicted=20.0, drafts=4.0, probes=1.0,
                    predicted_gain_l=np.array([0.0, 8.0, 20.0]))
  long = HeadRecord({}, ladder, observed=100.0, predicted=2000.0, drafts=400.0, probes=100.0,
                    predicted_gain_l=np.array([0.0, 800.0, 2000.0]))
  return thin, long


def test_the_record_says_what_a_tree_could_commit_and_a_long_record_says_it_closely():
  thin, long = thin_and_long_records()
  np.testing.assert_allclose(HeadRecord({}, (1, 4)).upper_tau(), [1.0, 1.0])  # never seen: AR
  # The sum of gains UPPER_Z standard errors up, the spread of geometric lengths at the mean.
  mean = 2 / 5
  ratio = (1 + UPPER_Z * np.sqrt(mean * (1 + mean) * 4) + 1) / 21
  np.testing.assert_allclose(thin.upper_tau(), [1.0, 1 + ratio * 2, 1 + ratio * 5])
  assert thin.prior_tau()[2] < 1.6 < thin.upper_tau()[2]  # a tree at 1.6 AR rounds could win
  assert long.prior_tau()[2] < long.upper_tau()[2] < 1.6  # ... and after 400 drafts it cannot
  assert np.all((long.upper_tau() - long.prior_tau())[1:]
                < (thin.upper_tau() - thin.prior_tau())[1:] / 5)


def test_a_request_probes_at_once_where_its_drafters_record_says_a_tree_could_win():
  """The engine's chooser (the device loop's is checked in test_auto_budget): a known drafter
  whose few drafts say AR is probed when a request arrives, if the probe can pay within it;
  after many drafts at the same ratio it is not."""
  seconds_l, busy = np.array([1.0, 1.6, 1.6]), [True]
  for record, probed in zip(thin_and_long_records(), (True, False)):
    chooser = BudgetChooser((1, 4, 16), 1, seconds_l, rounds_per_step=1, record=record)
    assert chooser.choose(busy, [100]) == 1  # no request has arrived yet
    chooser.reset(0)
    assert chooser.choose(busy, [3]) == 1  # too few tokens left to pay for a probe
    chooser.reset(0)
    assert (chooser.choose(busy, [100]) > 1) == probed
    assert chooser.choose(busy, [100]) == 1  # one probe a request, not one a step


def test_head_record_prior_chance_and_file(tmp_path):
  ladder = (1, 4, 16)
  record = HeadRecord({"head": "h"}, ladder)
  np.testing.assert_allclose(record.prior_tau(), [1.0, 1.0, 1.0])  # never seen: AR
  assert record.win_chance() == 0.5
  # Two rounds of two rows: drafts predicted gains (1, 3) at (4, 16); rows committed 2 and 3
  # tokens at 16 (gains 1 and 2 against 3 predicted each), one row inactive in round two.
  predicted = np.array([[1.0, 2.0, 4.0], [1.0, 2.0, 4.0]])
  record.add_drafts(predicted, np.array([2.0, 3.0]), 16, [True, True])
  record.add_drafts(predicted, np.array([2.0, 9.0]), 16, [True, False])
  ratio = (1 + 2 + 1 + 1) / (3 * 3 + 1)  # observed over predicted gains, one pseudo-count each
  np.testing.assert_allclose(record.prior_tau(), [1.0, 1.0 + ratio * 1.0, 1.0 + ratio * 3.0])
  record.probes, record.wins, record.unseen_s = 3.0, 2.0, 1.5
  assert record.win_chance() == 0.6
  # Its two pseudo-probes take the chance its own record gives: none at 16 where it needs 30.
  np.testing.assert_allclose(record.win_chance([1.0, 1.5, 30.0])[2], 2 / 5)
  path = str(tmp_path / "costs.json")
  save_cost_table(path, CostTable(key={"device": "d"}, rows=(1,), seconds={"ar": {1: (1.0,)}}))
  save_head_record(path, record)
  save_cost_table(path, CostTable(key={"device": "e"}, rows=(1,), seconds={"ar": {1: (2.0,)}}))
  read = load_head_record(path, {"head": "h"}, ladder)  # tables and heads live side by side
  np.testing.assert_allclose(read.as_array(), record.as_array())
  assert load_cost_table(path, {"device": "d"}) is not None
  assert load_head_record(path, {"head": "other"}, ladder).drafts == 0
  assert load_head_record(path, {"head": "h"}, (1, 4)).drafts == 0  # another ladder: afresh
  kept = json.loads((tmp_path / "costs.json").read_text())
  del kept["heads"][0]["unseen_s"]  # a record kept before unseen_s was counted
  (tmp_path / "costs.json").write_text(json.dumps(kept))
  assert load_head_record(path, {"head": "h"}, ladder).unseen_s == 0 and load_head_record(
      path, {"head": "h"}, ladder).drafts == record.drafts
  (tmp_path / "costs.json").write_text('{"heads": [{"key": {"head": "h"}, "drafts": -1}]}')
  assert load_head_record(path, {"head": "h"}, ladder).drafts == 0  # damaged: afresh
  # Old runs fade: a record weighs at most HEAD_RECORD_CAP rows, ratios kept.
  many = HeadRecord({}, ladder)
  for _ in range(3):
    many.add_drafts(np.tile(predicted[:1], (4000, 1)), np.full(4000, 3.0), 16, np.ones(4000))
  assert many.drafts == 4096 and np.isclose(many.observed / many.predicted, 2 / 3)


def test_a_row_doubts_its_drafters_record_as_much_as_the_record_is_thin():
  """At the same ratio (3 of 15 predicted gains: 4 tokens at 16), 8 unlucky rounds send a row
  of a drafter known from 4,096 drafts below 3.2 tokens, one known from 8 (or from its prior)
  not below 4: the record's own standard error counts once the row drafts. A row never
  drafted reads the record's point estimate (whether to try a tree is a probe's to say)."""
  ladder, predicted_l = (1, 4, 16), np.array([1.0, 4.0, 16.0])
  estimates = []
  for drafts in (8.0, 4096.0):
    record = HeadRecord({}, ladder, observed=3 * drafts, predicted=15 * drafts, drafts=drafts,
                        predicted_gain_l=drafts * (predicted_l - 1))
    model = record.acceptance_model(rows=2, explore_every=32)
    np.testing.assert_allclose(model.estimate(UPPER_Z)[1], record.prior_tau())
    for _ in range(8):
      model.update(np.stack([predicted_l] * 2), [1.0, 1.0], 16, [True, False])
    estimates.append(model.estimate(UPPER_Z)[0, 2])
  thin, long = estimates
  assert thin > 4.0 and long < 3.2, estimates


def test_a_drafters_prior_starts_the_record_of_a_target_it_never_drafted_for(tmp_path):
  """A drafter that knows what to expect of itself (committed 2.2 and 4 of 4 and 16 predicted)
  starts as if it had drafted PRIOR_DRAFTS times at the largest budget: no look, and a tree
  from the first step only where the prior says it pays."""
  ladder = (1, 4, 16)
  prior = AcceptancePrior(tau_l=[1.0, 2.2, 4.0], predicted_l=[1.0, 4.0, 16.0])
  seeded = HeadRecord({"head": "h"}, ladder).with_prior(prior)
  assert seeded.drafts == PRIOR_DRAFTS
  ratio = (PRIOR_DRAFTS * 3 + 1) / (PRIOR_DRAFTS * 15 + 1)  # one pseudo-count each
  np.testing.assert_allclose(seeded.prior_tau(), [1.0, 1.0 + 3 * ratio, 1.0 + 15 * ratio])
  assert abs(seeded.prior_tau()[2] - 4.0) < 0.15
  # What a drafter did on this target outweighs what it expected.
  thin, _ = thin_and_long_records()
  assert thin.with_prior(prior) is thin and seeded.with_prior(None) is seeded
  path = str(tmp_path / "costs.json")
  assert load_head_record(path, {"head": "h"}, ladder, prior).drafts == PRIOR_DRAFTS
  save_head_record(path, thin)
  kept = load_head_record(path, thin.key, ladder, prior)
  np.testing.assert_allclose(kept.as_array(), thin.as_array())
  for bad in (AcceptancePrior([1.0, 2.0], [1.0, 4.0]),):  # two budgets, the ladder three
    with pytest.raises(InputError, match="2 budgets, the ladder 3"):
      HeadRecord({}, ladder).with_prior(bad)
  with pytest.raises(InputError, match="acceptance prior"):
    AcceptancePrior([1.0, 0.5, 2.0], [1.0, 4.0, 16.0])  # fewer than the bonus token
  # Rounds of 1, 2 and 3 s: 4.1 tokens at 16 beat AR (1.37 a second against 1): a tree at once.
  starts = lambda seconds_l, record=seeded: BudgetChooser(ladder, 1, np.array(seconds_l),
                                                          rounds_per_step=1, record=record)
  chooser = starts([1.0, 2.0, 3.0])
  chooser.reset(0)
  assert chooser.choose([True], [100]) == 16
  # 4.1 tokens in 8 s, 1.6 in 2.5 s: AR. Its look (risking 1.5 s at budget 4) waits until it
  # is 2% of the AR time spent with the drafter (a drafter without a prior: 5%).
  chooser = starts([1.0, 2.5, 8.0])
  chooser.reset(0)
  assert [chooser.choose([True], [50]) for _ in range(3)] == [1, 1, 1]  # 1.5 > 2% of 50 s
  chooser = starts([1.0, 2.5, 8.0], dataclasses.replace(seeded, unseen_s=30.0))
  chooser.reset(0)
  assert chooser.choose([True], [50]) == 4  # 1.5 <= 2% of 80 s


def test_kept_seconds_with_extras_measure_once(tmp_path):
  path, calls = str(tmp_path / "costs.json"), []
  measure = lambda: calls.append(1) or np.array([1.0, 2.0, 0.5])
  seconds, measured_s = kept_seconds({"k": 1}, (1, 4), 1, measure, path, extras=("flush",))
  np.testing.assert_allclose(seconds, [1.0, 2.0, 0.5])
  again, read_s = kept_seconds({"k": 1}, (1, 4), 1, measure, path, extras=("flush",))
  np.testing.assert_allclose(again, seconds)
  assert calls == [1] and measured_s > 0 and read_s == 0
  measure_more = lambda: calls.append(2) or np.array([1.0, 2.0, 0.5, 0.25])
  kept_seconds({"k": 1}, (1, 4), 1, measure_more, path, extras=("flush", "other"))  # one missing
  assert calls == [1, 2]


def test_committed_by_budget_walks_the_top_n_nodes_as_verification_does():
  """Against a brute-force walk: from the root, the child among the n best nodes (by score)
  that holds the continuation's next token, until none does; the continuation follows a random
  node's path, then random tokens."""
  rng = np.random.default_rng(3)
  batch, depth, vocab, budget = 6, 5, 7, 24
  tree = build_tree(random_logprobs(5, batch, depth, vocab), budget, 3)
  tokens, parents, scores = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.scores))
  truth_bd = rng.integers(0, vocab, (batch, depth))
  for b in range(batch):
    path, node = [], int(rng.integers(1, budget))
    while node > 0:
      path.insert(0, tokens[b, node])
      node = parents[b, node]
    truth_bd[b, :len(path)] = path
  got = np.asarray(committed_by_budget(tree, jax.numpy.asarray(truth_bd)))
  for b in range(batch):
    ranked = np.argsort(-scores[b], kind="stable")
    for n in range(1, budget + 1):
      kept, node, steps = set(ranked[:n].tolist()), 0, 0
      while steps < depth:
        child = [c for c in kept if parents[b, c] == node and tokens[b, c] == truth_bd[b, steps]]
        if not child:
          break
        node, steps = child[0], steps + 1
      assert got[b, n - 1] == 1 + steps, (b, n)
  assert got[:, -1].max() > 2  # the continuations do follow deep paths
