"""The continuous-batching engine: each request's tokens are what it gets alone.

Greedy: token for token `speculative_generate` on the prompt alone, whatever shares the slots.
Sampled: reproducible from the request's seed in any slot and batch, and drawn from the target's
processed distribution. Plus cancellation, streaming and refused requests.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetflow_jax.decoding import speculative_generate
from jetflow_jax.engine import Orchestrator, Request, make_engine
from jetflow_jax.errors import InputError
from jetflow_jax.head import init_head_params
from jetflow_jax.sampling import Greedy, RowSampling, Sampling
from test_sampling import reference_processed
from test_speculative import (assert_matches, exact_first_three, head_config, small_target,
                              target, trained_head)

CONTEXT = 64
SLOTS = 4
LENGTHS = [3, 5, 17, 9, 11, 13, 15, 7, 20, 4, 8, 19]  # prompt buckets 16 and 32
MAX_TOKENS = [24, 6, 16, 3, 20, 10, 1, 12, 24, 8, 18, 5]


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(4)
  return [rng.integers(0, 95, n).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def alone(target, prompts):
  """Each prompt's greedy tokens from `speculative_generate`, one prompt at a time."""
  config, params = target
  return [speculative_generate(params, config, None, None, [p], m, method="ar",
                               stop_tokens=()).tokens[0] for p, m in zip(prompts, MAX_TOKENS)]


@pytest.fixture(scope="module")
def engine_for(target, trained_head):
  """One engine per method (4 slots of 64 tokens, 2 rounds a step), built once."""
  config, params = target
  head, head_params = trained_head

  @functools.cache
  def build(method):
    return make_engine(params, config, head_params, head, method=method, budget=12, top_k=3,
                       num_slots=SLOTS, max_context=CONTEXT, rounds_per_step=2,
                       warn=lambda _: None)

  return build


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree", "jetflow"])
def test_greedy_requests_arriving_while_others_run_equal_each_alone(engine_for, prompts, alone,
                                                                    method):
  orchestrator = Orchestrator(engine_for(method))
  # Two requests stop at a token of their own, from inside their continuation.
  stops = {1: alone[1][3], 10: alone[10][9]}
  requests = [Request(p, m, stop_tokens=(stops[i],) if i in stops else ())
              for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS))]
  streams = [orchestrator.submit(r) for r in requests[:6]]
  busy = []
  for _ in range(3):
    orchestrator.step()
    busy.append(sum(s is not None for s in orchestrator.slots))
  streams += [orchestrator.submit(r) for r in requests[6:]]  # while the first ones run
  while orchestrator.step():
    busy.append(sum(s is not None for s in orchestrator.slots))

  expected = [a[:a.index(stops[i]) + 1] if i in stops else a for i, a in enumerate(alone)]
  assert [s.tokens for s in streams] == expected
  assert [s.finish_reason for s in streams] == [
      "stop_token" if i in stops else "max_tokens" for i in range(12)]
  assert busy[0] == SLOTS and busy[2] > 0  # full at first; the second wave came while they ran
  tau = sum(len(s.tokens) - 1 for s in streams) / sum(s.rounds for s in streams)
  if method == "ar":
    assert tau == 1.0
  elif method != "dflash":
    assert tau > 1.2  # the trained head's trees accept several tokens a round


def test_sampled_request_is_the_same_alone_and_in_a_busy_batch(engine_for, prompts):
  engine = engine_for("jetflow")
  request = Request(prompts[4], 20, temperature=0.8, top_k=20, top_p=0.9, seed=7, stop_tokens=())
  solo = Orchestrator(engine)
  by_itself = solo.submit(request)
  solo.run()

  busy = Orchestrator(engine)
  others = [Request(prompts[i], 16, temperature=t, top_k=k, top_p=p, seed=i, stop_tokens=())
            for i, (t, k, p) in enumerate([(1.0, 0, 1.0), (0.0, 0, 1.0), (1.3, 5, 1.0),
                                          (0.6, 0, 0.8), (0.0, 0, 1.0)])]
  streams = [busy.submit(r) for r in others[:3]]
  busy.step()
  in_batch = busy.submit(request)
  busy.step()
  slot = busy.slots.index(in_batch)
  streams += [busy.submit(r) for r in others[3:]]
  busy.run()

  assert slot != 0 and all(s.finish_reason == "max_tokens" for s in streams)
  assert in_batch.tokens == by_itself.tokens and len(in_batch.tokens) == 20
  other_seed = Orchestrator(engine).generate([Request(prompts[4], 20, temperature=0.8, top_k=20,
                                                      top_p=0.9, seed=8, stop_tokens=())])
  assert other_seed[0].tokens != by_itself.tokens


def test_row_sampling_is_each_rows_sampling():
  settings = [(1.0, 0, 1.0), (0.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 12, 0.5), (1.0, 0, 0.8),
              (2.0, 40, 0.95)]
  samplers = [Sampling(*s) if s[0] > 0 else None for s in settings]
  rows = RowSampling(temperature_b=jnp.asarray([s[0] for s in settings], jnp.float32),
                     top_k_b=jnp.asarray([s[1] for s in settings], jnp.int32),
                     top_p_b=jnp.asarray([s[2] for s in settings], jnp.float32))
  logits_bnv = np.random.default_rng(1).normal(size=(6, 3, 40)).astype(np.float32) * 3
  processed = np.asarray(rows.processed_logits(jnp.asarray(logits_bnv)))
  for b, sampler in enumerate(samplers):
    if sampler is None:
      continue
    want = reference_processed(logits_bnv[b], *settings[b])
    np.testing.assert_array_equal(np.isinf(processed[b]), np.isinf(want))
    np.testing.assert_allclose(processed[b][~np.isinf(want)], want[~np.isinf(want)], rtol=1e-6)
    np.testing.assert_array_equal(processed[b],
                                  sampler.processed_logits(jnp.asarray(logits_bnv[b])))

  keys_b = jax.vmap(jax.random.key)(jnp.arange(6))
  draws = np.asarray(rows(keys_b, jnp.asarray(logits_bnv)))
  assert draws[1].tolist() == logits_bnv[1].argmax(-1).tolist()  # the greedy row
  assert np.isfinite(processed[np.arange(6)[:, None], np.arange(3), draws]).all()
  # A row's draws depend on its own key and logits only.
  shuffled = np.asarray(rows(keys_b, jnp.asarray(logits_bnv).at[0].set(0.0)))
  np.testing.assert_array_equal(shuffled[1:], draws[1:])
  # What the host promises (no row filters; no row samples) skips work, not draws.
  unfiltered = jax.tree.map(lambda x: x[:2], rows)
  np.testing.assert_array_equal(unfiltered(keys_b[:2], logits_bnv[:2], filtered=False),
                                draws[:2])
  assert (np.asarray(rows(keys_b, logits_bnv, sampled=False)) == logits_bnv.argmax(-1)).all()


SAMPLED = [Sampling(1.3, top_p=0.8), Sampling(0.7, top_k=5, top_p=0.9)]
PER_SAMPLER = 6000
GREEDY_SLOTS = 8


def test_engine_samples_the_target_distribution(small_target):
  """Every slot holds the same prompt and first token, with its own seed and settings; over the
  slots of each sampler, the next two tokens follow the target's processed distribution."""
  config, params, model = small_target
  head = head_config(config, block_size=4)
  # One round a step, the first a tree of 8, the second AR: a slot whose tree gave one token
  # draws its last by AR (the budget changes between the rounds of one request).
  engine = make_engine(params, config, init_head_params(head, jax.random.key(5)), head,
                       budget="auto", max_budget=8, top_k=3,
                       num_slots=2 * PER_SAMPLER + GREEDY_SLOTS, max_context=8, rounds_per_step=1)
  prompt = [3, 1, 4, 1]
  prefix = engine.prefill(Request(prompt, 3, temperature=1.0, seed=0, stop_tokens=()))
  first = int(prefix.tokens_bs[0, len(prompt)])  # the prefix's row: prompt, first token
  samplers = [SAMPLED[0]] * PER_SAMPLER + [SAMPLED[1]] * PER_SAMPLER + [Greedy()] * GREEDY_SLOTS
  state = engine.init_state()
  for slot, sampler in enumerate(samplers):
    state = engine.insert(state, prefix.replace(keys_b=jax.random.key(slot)[None],
                                                sampling=RowSampling.of([sampler])), slot)
  state, _ = engine.step(state, 8)
  running = ~np.asarray(state.rows.done_b)
  state, _ = engine.step(state, 1)
  tokens = np.asarray(state.rows.tokens_bs)[:, len(prompt):len(prompt) + 3]
  assert (tokens[:, 0] == first).all() and np.asarray(state.rows.done_b).all()
  assert 0.05 < running.mean() < 0.95  # both ways of ending occur

  greedy = speculative_generate(params, config, None, None, [prompt + [first]], 2, method="ar",
                                stop_tokens=()).tokens[0]
  assert (tokens[-GREEDY_SLOTS:, 1:] == greedy).all()
  for group, sampler in enumerate(SAMPLED):
    exact = exact_first_three(model, np.array(prompt), sampler)
    given_first = np.zeros_like(exact)
    given_first[first] = exact[first] / exact[first].sum()
    assert_matches(tokens[group * PER_SAMPLER:(group + 1) * PER_SAMPLER], given_first)



def test_requests_that_will_not_draft_run_plain_ar_steps_and_stay_lossless(target, trained_head,
                                                                            prompts, alone):
  """An engine choosing budgets runs AR steps without taps while no busy request will draft
  (trees cost 20 AR steps here); a tree step over slots whose drafter context was not kept is
  still each request's tokens alone."""
  config, params = target
  head, head_params = trained_head
  engine = make_engine(params, config, head_params, head, method="jetflow", budget="auto",
                       max_budget=8, top_k=3, num_slots=SLOTS, max_context=CONTEXT,
                       rounds_per_step=2)
  with pytest.raises(InputError, match="only an AR step"):
    engine.spec(8, taps=False)
  steps, step = [], engine.step
  engine.step = lambda state, budget, **flags: steps.append((budget, flags["taps"])) or step(
      state, budget, **flags)
  streams = Orchestrator(engine, seconds_l=[1.0, 20.0, 20.0]).generate(
      [Request(p, m, stop_tokens=()) for p, m in zip(prompts[:6], MAX_TOKENS)])
  assert [s.tokens for s in streams] == alone[:6] and set(steps) == {(1, False)}

  state = engine.init_state()
  for slot in range(SLOTS):
    state = engine.insert(state, engine.prefill(Request(prompts[slot], MAX_TOKENS[slot],
                                                        stop_tokens=())), slot)
  state, _ = step(state, 1, sampled=False, filtered=False, taps=False)
  while not np.asarray(state.rows.done_b).all():
    state, _ = step(state, 8, sampled=False, filtered=False)
  tokens_bs = np.asarray(state.rows.tokens_bs)
  assert [tokens_bs[i, len(p):len(p) + m].tolist()
          for i, (p, m) in enumerate(zip(prompts[:SLOTS], MAX_TOKENS))] == alone[:SLOTS]


def test_cancelling_frees_the_slot_for_a_waiting_request(engine_for, prompts, alone):
  orchestrator = Orchestrator(engine_for("ar"))
  running = [orchestrator.submit(Request(prompts[i], 24, stop_tokens=())) for i in range(SLOTS)]
  waiting = orchestrator.submit(Request(prompts[2], MAX_TOKENS[2], stop_tokens=()))
  never = orchestrator.submit(Request(prompts[3], 8, stop_tokens=()))
  orchestrator.step()
  orchestrator.step()
  assert orchestrator.slots == running and running[1].tokens
  running[1].cancel()
  never.cancel()
  orchestrator.step()
  seen = len(running[1].tokens)
  assert orchestrator.slots[1] is waiting and running[1].finish_reason == "cancelled"
  assert never.finish_reason == "cancelled" and never not in orchestrator.waiting
  orchestrator.run()
  assert len(running[1].tokens) == seen < 24 and never.tokens == []
  assert waiting.tokens == alone[2] and waiting.finish_reason == "max_tokens"
  assert [len(s.tokens) for s in running] == [24, seen, 24, 24]


def test_every_streamed_piece_extends_a_prefix_of_the_output(engine_for, prompts, alone):
  orchestrator = Orchestrator(engine_for("jetflow"))
  views = {i: [] for i in range(6)}
  streams = []
  for i in range(6):
    so_far = []

    def on_tokens(piece, so_far=so_far, i=i):
      assert piece  # never an empty piece
      so_far.extend(piece)
      views[i].append(list(so_far))

    streams.append(orchestrator.submit(Request(prompts[i], MAX_TOKENS[i], stop_tokens=()),
                                       on_tokens))
  orchestrator.run()
  for i, stream in enumerate(streams):
    assert stream.tokens == alone[i] and views[i][-1] == stream.tokens
    assert all(v == stream.tokens[:len(v)] for v in views[i])
  assert len(views[0]) > 2  # the 24-token request arrived in several pieces


@pytest.mark.parametrize("request_,match", [
    (Request([1] * 40, 25), "40 tokens plus max_tokens 25 exceeds the engine's context of 64"),
    (Request([], 4), "at least one token"), (Request([1, 2], 0), "max_tokens"),
    (Request([1, 200], 4), r"\[0, 96\)"), (Request([1], 4, temperature=-1.0), "temperature"),
    (Request([1], 4, stop_tokens=tuple(range(9))), "9 stop tokens exceed"),
    (Request([1], 4, seed=-1), "seed")])
def test_requests_that_cannot_fit_are_refused_by_name(engine_for, request_, match):
  orchestrator = Orchestrator(engine_for("ar"))
  with pytest.raises(InputError, match=match):
    orchestrator.submit(request_)
  assert not orchestrator.waiting
