"""`budget="auto"`: each round's (or engine step's) tree budget chosen on a ladder, and decoding
still lossless with the budget changing between the rounds of one request: greedy equals AR
token for token, sampling follows the target's exact distribution."""

import collections
import dataclasses
import json
import re

import jax
import numpy as np
import pytest

import jetflow_jax
from jetflow_jax import calibrate
from jetflow_jax.decoding import TreeShape, auto, decode_prompts, loop
from jetflow_jax.decoding.auto import auto_specs, run_auto
from jetflow_jax.decoding.loop import (PENDING_ROUNDS, batch_rows, compile_decode, compile_flush,
                                       compiled, pending_rounds)
from jetflow_jax.decoding.round import RoundSpec
from jetflow_jax.decoding.state import default_cache_size
from jetflow_jax.drafters import HeadDrafter
from jetflow_jax.engine import Orchestrator, Request, budgets, make_engine
from jetflow_jax.engine.budgets import step_seconds
from jetflow_jax.head import init_head_params
from jetflow_jax.head_acceptance import ACCEPTANCE_FILE, measure_acceptance
from jetflow_jax.head_checkpoint import load_head, save_hf_head
from jetflow_jax.sampling import Greedy, Sampling, sampling_flags
from test_speculative import (PROMPTS, SAMPLES, ar_greedy,  # noqa: F401
                              assert_caches_equal_ar_and_append_context, assert_matches,
                              exact_first_three, head_config, small_target, target, trained_head)


def test_greedy_equals_ar_whatever_the_budgets(target, trained_head, tmp_path, monkeypatch):
  config, params = target
  head, head_params = trained_head
  reference = ar_greedy(config, params, PROMPTS, 24)
  drafter = HeadDrafter(head)
  # AR rounds keep the head's context current: trees after them draft from it.
  for schedule in ((1, 16, 4, 1, 1, 8), (8, 1)):
    result = decode_prompts(params, config, drafter, head_params, PROMPTS, 24,
                            tree_shape=TreeShape("top_n", 16, 3), stop_tokens=(), auto=schedule)
    assert result.tokens == reference
    assert set(result.budgets) == set(schedule)
  # The same programs, by hand: AR rounds keep their taps back, a flush commits them before a
  # tree, and over AR, tree, AR, tree, AR rounds the head's context ends as if each round had
  # committed its own (a flush after a tree once wrote stale rows over the tree's commit).
  specs = auto_specs(RoundSpec(config, drafter, TreeShape("top_n", 16, 3),
                               **sampling_flags([Greedy()])))
  cache_size = default_cache_size(config, PROMPTS, 24)
  rows = batch_rows(PROMPTS, 24, cache_size, Greedy(), 0, ())
  misses = compiled.misses
  (prefill, ar), (_, tree) = (compile_decode(params, head_params, rows, spec, cache_size)
                              for spec in (specs[0], specs[-1]))
  flush = compile_flush(head_params, prefill, drafter, None)
  assert compiled.misses == misses  # what decode_prompts compiled above
  state = prefill(params, head_params, *rows.args())
  for rounds in (2, 0, 3, 0, 2):  # 0: flush, then one tree round
    state = ar(params, head_params, state, rounds) if rounds else tree(
        params, head_params, flush(head_params, state), 1)
  assert_caches_equal_ar_and_append_context(config, params, head, head_params,
                                            flush(head_params, state))
  path = tmp_path / "costs.json"
  monkeypatch.setenv("JETFLOW_COST_TABLES", str(path))
  monkeypatch.setattr(auto, "_seconds", {})  # measured here, whatever ran before
  choose = lambda: jetflow_jax.speculative_generate(params, config, head_params, head, PROMPTS,
                                                    24, budget="auto", max_budget=16, top_k=3,
                                                    stop_tokens=())
  chosen = choose()
  assert chosen.tokens == reference
  # One budget per round of the longest row (a row that finished first sits out the rest).
  assert len(chosen.budgets) == max(map(len, chosen.committed_per_round))
  assert chosen.calibrate_s > 0
  # Every program ran once before the clock started, and is not run again for the next call.
  assert compiled.warmed >= {id(p) for p in (prefill, ar, tree, flush)}
  assert choose().warmup_s == 0.0
  # The next process reads the round times and the flush's from the file.
  tables = json.loads(path.read_text())
  (table,) = tables["tables"]
  assert table["key"]["loop"]["ladder"] == [1, 4, 8, 16] and set(table["seconds"]) == {
      "ar", "tree", "flush"}
  (record,) = tables["heads"]  # and what this head's drafts did
  assert record["key"]["params"] == auto.drafter_fingerprint(head_params)
  # Trees 100x an AR round never pay: AR from the first round, no probe, for a head never seen.
  table["seconds"] = {m: {n: [100.0 if m == "tree" else 1.0] for n in by_n}
                      for m, by_n in table["seconds"].items()}
  path.write_text(json.dumps({"tables": [table]}))
  monkeypatch.setattr(auto, "_seconds", {})
  ran = []

  def counting(state, advance_l, *args):  # run_auto(state, advance_l, ..., finish)
    count = lambda name, fn: lambda *a: ran.append(name) or fn(*a)
    return run_auto(state, [count("ladder", fn) for fn in advance_l], *args[:-1],
                    count("finish", args[-1]))

  monkeypatch.setattr(loop, "run_auto", counting)
  steep = choose()
  assert steep.tokens == reference and set(steep.budgets) == {1}
  # ... plain AR's programs from the prefill on: not the head's prefill, nor its loops.
  assert not ran and steep.num_forwards == len(steep.budgets) + 1
  assert re.fullmatch(r"AR: budget \d+ is expected to commit [\d.]+ tokens a round where "
                      r"[\d.]+ beat AR here; no probe can pay within 24 tokens",
                      steep.budget_reason)
  (unseen,) = json.loads(path.read_text())["heads"]
  assert unseen["probes"] == 0 and unseen["unseen_s"] == len(steep.budgets)  # 1 s an AR round
  # A look that risks 3 s, more than 5% of one request's AR time, is taken once the drafter's
  # earlier unseen AR time makes it a small share.
  table["seconds"] = {m: {n: [3.0 if m == "tree" else 1.0] for n in by_n}
                      for m, by_n in table["seconds"].items()}
  unseen["unseen_s"] = 60.0
  path.write_text(json.dumps({"tables": [table], "heads": [unseen]}))
  monkeypatch.setattr(auto, "_seconds", {})
  looked = choose()
  assert looked.tokens == reference and looked.budgets[0] > 1
  assert looked.budget_reason.startswith(f"a probe, to find out: budget {looked.budgets[0]} ")
  assert json.loads(path.read_text())["heads"][0]["probes"] == 1
  # ... after which nothing will draft: the rest runs through `finish`, AR rounds that keep no
  # taps (they once kept taps back to the end).
  assert ran[0] == "ladder" and ran[-1] == "finish"
  # Known now, and trees 100x an AR round: no probe can pay in the request, so it runs plain AR
  # from its prefill on.
  table["seconds"]["tree"] = {n: [100.0] for n in table["seconds"]["tree"]}
  path.write_text(json.dumps({"tables": [table], "heads": json.loads(path.read_text())["heads"]}))
  monkeypatch.setattr(auto, "_seconds", {})
  ran.clear()
  known = choose()
  assert known.tokens == reference and set(known.budgets) == {1} and not ran
  # Flat costs, and a record of this head's good drafts: trees from the first round.
  table["seconds"] = {m: {n: [1.0] for n in by_n} for m, by_n in table["seconds"].items()}
  record.update(observed=40.0, predicted=40.0, drafts=10.0,
                predicted_gain_l=[0.0, 20.0, 30.0, 40.0])
  path.write_text(json.dumps({"tables": [table], "heads": [record]}))
  monkeypatch.setattr(auto, "_seconds", {})
  flat = choose()
  assert flat.budgets[0] > 1 and flat.budget_reason.startswith(f"budget {flat.budgets[0]} ")
  # Trees at 1.6 AR rounds, and a record of 4 drafts that accepted 2 of 21 predicted gains: it
  # says AR, but also that a tree could win (a chance of 0.36 at 16: `HeadRecord.win_chance`),
  # so the request starts with a probe; a record of 400 drafts at that ratio says no tree can,
  # and the request runs AR from its first round.
  table["seconds"] = {m: {n: [{"tree": 1.6, "ar": 1.0}.get(m, 0.01)] for n in by_n}
                      for m, by_n in table["seconds"].items()}
  for drafts, probed in ((4.0, True), (400.0, False)):
    thin_or_long = dict(record, observed=drafts / 4, predicted=5 * drafts, drafts=drafts,
                        probes=0.0, wins=0.0,
                        predicted_gain_l=[0.0, 2 * drafts, 3.5 * drafts, 5 * drafts])
    path.write_text(json.dumps({"tables": [table], "heads": [thin_or_long]}))
    monkeypatch.setattr(auto, "_seconds", {})
    started = choose()
    assert started.tokens == reference and (started.budgets[0] > 1) == probed
    assert probed or set(started.budgets) == {1}
  # An unwritable file: a warning, and decoding goes on.
  (tmp_path / "a file").write_text("")
  monkeypatch.setenv("JETFLOW_COST_TABLES", str(tmp_path / "a file" / "costs.json"))
  monkeypatch.setattr(auto, "_seconds", {})
  with pytest.warns(UserWarning, match="cannot keep"):  # the round times, the head record
    assert choose().tokens == reference
  assert flat.tokens == reference and flat.calibrate_s < chosen.calibrate_s
  assert flat.budgets.count(16) > len(flat.budgets) / 2


def test_sampling_follows_the_target_when_budgets_change(small_target):
  config, params, model = small_target
  prompt, sampler = [3, 1, 4, 1], Sampling(1.0)
  head = head_config(config, block_size=4)
  result = decode_prompts(params, config, HeadDrafter(head), init_head_params(head,
                                                                              jax.random.key(5)),
                          [prompt] * SAMPLES, 3, tree_shape=TreeShape("top_n", 4, 3),
                          sampler=sampler, stop_tokens=(), auto=(4, 1),
                          cache_size=8)  # 60,000 rows: the smallest cache and prompt bucket
  assert result.budgets[:2] == [4, 1]
  assert_matches(np.array(result.tokens), exact_first_three(model, np.array(prompt), sampler))


@pytest.fixture(scope="module")
def auto_engine(target, trained_head):
  """A JetFlow engine on the ladder AR, 4, 8 (2 slots, one round a step)."""
  config, params = target
  head, head_params = trained_head
  return make_engine(params, config, head_params, head, method="jetflow", budget="auto",
                     max_budget=8, top_k=3, num_slots=2, max_context=64, rounds_per_step=1,
                     warn=lambda _: None)


def test_engine_steps_change_budget_and_stay_lossless(target, auto_engine):
  config, params = target
  assert auto_engine.ladder == (1, 4, 8)
  requests = [Request(p, 20, stop_tokens=()) for p in PROMPTS]
  expected = ar_greedy(config, params, PROMPTS, 20)
  schedule = (8, 1, 1, 4)
  orchestrator = Orchestrator(auto_engine, schedule=schedule)
  assert [s.tokens for s in orchestrator.generate(requests)] == expected
  assert set(orchestrator.chooser.chosen) == set(schedule)
  # Sampled, with budgets changing between rounds: test_engine's distribution test.


def test_engine_chooses_by_the_step_costs(target, auto_engine, tmp_path, monkeypatch):
  config, params = target
  requests = [Request(p, 24, stop_tokens=()) for p in PROMPTS]
  expected = ar_greedy(config, params, PROMPTS, 24)
  monkeypatch.setenv("JETFLOW_COST_TABLES", str(tmp_path / "costs.json"))
  flat = Orchestrator(auto_engine, seconds_l=[1.0, 1.0, 1.0])
  assert [s.tokens for s in flat.generate(requests)] == expected
  assert flat.chooser.chosen.most_common(1)[0][0] == 8  # trees cost nothing more: the largest
  # A head never seen starts on AR and probes at once (it pays here); what it learnt is kept,
  # and the next engine starts its requests on trees.
  assert flat.chooser.record.probes >= 1 and flat.chooser.record.drafts > 0
  flat.close()
  again = Orchestrator(auto_engine, seconds_l=[1.0, 1.0, 1.0])
  assert again.chooser.record.drafts == flat.chooser.record.drafts
  assert again.chooser.choose([True, True], [24, 24]) > 1
  steep = Orchestrator(auto_engine, seconds_l=[1.0, 40.0, 80.0])
  assert [s.tokens for s in steep.generate(requests)] == expected
  # Trees 40x an AR step never pay: AR, but for the first step (the prior) and rare probes.
  assert steep.chooser.chosen[1] >= 0.8 * sum(steep.chooser.chosen.values())


def test_step_costs_are_measured_once_and_reused(auto_engine, tmp_path, monkeypatch):
  path = str(tmp_path / "costs.json")
  seconds = step_seconds(auto_engine, path)
  assert seconds.shape == (3,) and np.all(seconds > 0)
  monkeypatch.setattr(budgets, "measure_step_seconds", lambda _: pytest.fail("measured again"))
  np.testing.assert_allclose(step_seconds(auto_engine, path), seconds)


def test_calibrate_cli_keeps_the_table_a_server_reads(tmp_path, monkeypatch, capsys):
  path = tmp_path / "tables.json"
  monkeypatch.setenv("JETFLOW_COST_TABLES", str(path))
  flags = ["--slots", "1", "--max-context", "64", "--rounds-per-step", "1", "--max-budget", "4"]
  calibrate.main(flags)
  out = capsys.readouterr().out
  assert re.search(r"\| AR \| [\d.]+ \| [\d.]+ \|\n\| 4 \| [\d.]+ \|", out)
  (table,) = json.loads(path.read_text())["tables"]
  assert table["key"]["slots"] == 1 and table["key"]["engine"]["ladder"] == [1, 4]
  with pytest.raises(SystemExit) as exit_:
    calibrate.main(flags + ["--budget", "16"])
  assert exit_.value.code == 2 and "leave --budget out" in capsys.readouterr().err


def test_each_budget_is_timed_as_the_loop_runs_it(target, monkeypatch):
  """AR in `AR_TIMED_ROUNDS`-round calls, a tree one round a call and read back (a call's fixed
  cost, timed in 2-round calls, once made trees look half as dear as they were)."""
  State = collections.namedtuple("State", "rounds_b stop_b lengths_b committed_br predicted_bl")
  calls = []

  def loop_of(budget):
    def advance(state, rounds):
      calls.append((budget, rounds))
      return state._replace(rounds_b=state.rounds_b + rounds)
    return advance

  state = State(*(np.zeros(shape, np.int32) for shape in ((2,), (2,), (2,), (2, 4), (2, 3))))
  monkeypatch.setenv("JETFLOW_COST_TABLES", "")  # kept nowhere: measured
  monkeypatch.setattr(auto, "_seconds", {})
  config, _ = target
  specs = auto_specs(RoundSpec(config=config, drafter=HeadDrafter(head_config(config)),
                               tree_shape=TreeShape("top_n", 8, 3)))
  seconds_l, flush_s = auto.round_seconds(
      specs, lambda: ([loop_of(n) for n in (1, 4, 8)], None, state), 2, "float32", 16, 64,
      "plain", False)
  assert len(seconds_l) == 3 and flush_s == 0.0
  assert {rounds for budget, rounds in calls if budget == 1} == {auto.AR_TIMED_ROUNDS}
  assert {rounds for budget, rounds in calls if budget > 1} == {1}
  assert len(calls) == 3 * (auto.TIMED_RUNS + 1)  # a warm-up each


def test_held_back_rounds_cover_what_a_row_can_run(target):
  """A prompt that fills its bucket's cache still keeps back a long AR run (it once kept one
  round and flushed after each: auto 2.4x slower than AR on such prompts)."""
  config, _ = target
  spec = auto_specs(RoundSpec(config=config, drafter=HeadDrafter(head_config(config)),
                              tree_shape=TreeShape("top_n", 16, 3)))[0]
  for width, capacity in ((512, 512), (256, 512), (32, 64), (16, 64)):
    can_run = capacity - (width // 2 + 1)  # the shortest prompt padded to this width
    assert pending_rounds(spec, width, capacity) >= min(PENDING_ROUNDS, can_run)


def test_a_heads_held_out_acceptance_is_what_its_rounds_commit(target, trained_head, tmp_path):
  """`measure_acceptance` at each prompt's first anchor reads, at budgets 4 and 16, exactly the
  tokens the first greedy round of a decode at that budget commits (averaged over the rows);
  kept with the head, it is the prior auto starts a target never drafted for from."""
  config, params = target
  head, head_params = trained_head
  reference = ar_greedy(config, params, PROMPTS, 24)
  acceptance = measure_acceptance(head_params, head, params, config,
                                  list(zip(PROMPTS, reference)), anchors_per_row=1, budget=16,
                                  top_k=3)
  assert acceptance.anchors == len(PROMPTS) and len(acceptance.tau_n) == 16
  drafter = HeadDrafter(head)
  for budget in (4, 16):
    first_rounds = [rounds[0] for rounds in decode_prompts(
        params, config, drafter, head_params, PROMPTS, 24, tree_shape=TreeShape("top_n", budget, 3),
        stop_tokens=()).committed_per_round]
    assert acceptance.tau_n[budget - 1] == pytest.approx(np.mean(first_rounds), abs=1e-4)
  assert acceptance.tau_n[15] > 1.5  # the trained head drafts something right
  assert acceptance.tau_n[0] == acceptance.predicted_n[0] == 1.0
  assert np.all(np.diff(acceptance.tau_n) >= 0) and np.all(np.diff(acceptance.predicted_n) >= 0)
  # Kept with the exported head, read back by load_head, given to auto by the drafter; the
  # config's identity (a compiled program's key) is the head's without it.
  with_acceptance = dataclasses.replace(head, acceptance=acceptance)
  save_hf_head(head_params, with_acceptance, str(tmp_path), jax.numpy.float32)
  loaded, _ = load_head(str(tmp_path))
  assert loaded.acceptance == acceptance and loaded == head and hash(loaded) == hash(head)
  prior = HeadDrafter(loaded).acceptance_prior(head_params, (1, 4, 16, 64))
  np.testing.assert_allclose(prior.tau_l, np.asarray(acceptance.tau_n)[[0, 3, 15, 15]])
  (tmp_path / ACCEPTANCE_FILE).write_text('{"tau_n": [1.0, 0.5]}')
  with pytest.warns(UserWarning, match="ignoring .*acceptance.json"):
    assert load_head(str(tmp_path))[0].acceptance is None


def test_measure_acceptance_cli_keeps_the_heads_prior_beside_it(target, trained_head, tmp_path,
                                                                capsys):
  """`python -m jetflow_jax.train.measure_acceptance`: the target continues held-out prompts,
  the head's acceptance on them is written where `load_head` reads it; bad input is one line."""
  from conftest import make_hf_model
  from jetflow_jax.train import measure_acceptance as cli
  from test_speculative import VOCAB
  config, params = target
  head, head_params = trained_head
  target_dir, head_dir = str(tmp_path / "target"), str(tmp_path / "head")
  make_hf_model(num_hidden_layers=4, vocab_size=VOCAB).save_pretrained(target_dir)  # `target`'s
  save_hf_head(head_params, head, head_dir, jax.numpy.float32)
  prompts = tmp_path / "held_out.jsonl"
  rng = np.random.default_rng(1)  # not the trained head's prompts (seed 0)
  held_out = [rng.integers(0, VOCAB - 1, 8).tolist() for _ in range(3)]
  prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in held_out))
  args = ["--head", head_dir, "--checkpoint", target_dir, "--prompts", str(prompts)]
  cli.main(args + ["--max-new-tokens", "24"])
  acceptance = load_head(head_dir)[0].acceptance
  expected = measure_acceptance(head_params, head, params, config,
                                list(zip(held_out, jetflow_jax.generate(params, config, held_out,
                                                                        24).tokens)))
  assert acceptance.anchors == expected.anchors == 3 * 32 and acceptance.top_k == 7
  np.testing.assert_allclose(acceptance.tau_n, expected.tau_n, atol=1e-4)
  np.testing.assert_allclose(acceptance.predicted_n, expected.predicted_n, atol=1e-4)
  assert acceptance.tau_n[-1] > 1.2  # the head drafts something right on prompts it never saw
  assert "written: " + str(tmp_path / "head" / ACCEPTANCE_FILE) in capsys.readouterr().out
  for bad, message in ((["--max-new-tokens", "3"], "long enough for a depth-5 draft"),
                       (["--count", "0"], "must be positive")):
    with pytest.raises(SystemExit) as exit_info:
      cli.main(args + bad)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err  # the progress bar, then one line
    assert "Traceback" not in err and message in err.splitlines()[-1]
    assert err.splitlines()[-1].startswith("error: ")
