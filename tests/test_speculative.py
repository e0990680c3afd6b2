"""Speculative decoding: greedy equals AR token for token, sampling matches the target exactly."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch

import jetflow_jax
from jetflow_jax.decoding import RoundSpec, TreeShape, decode_prompts, generate
from jetflow_jax.decoding.loop import batch_rows, compile_decode
from jetflow_jax.drafters import HeadDrafter
from jetflow_jax.errors import ConfigError, InputError
from jetflow_jax.head import (append_context, draft_logits, init_head_cache, init_head_params,
                              with_draft_vocab)
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.model import KVCache, forward
from jetflow_jax.sampling import Greedy, Sampling
from jetflow_jax.train.step import (LossConfig, TrainState, make_loss_fn, make_optimizer,
                                    make_train_step)

VOCAB = 96
MASK_ID = VOCAB - 1
PROMPTS = [[5, 17, 3, 88, 40], [9, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11], [60, 61, 62]]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
  from conftest import make_hf_model
  directory = str(tmp_path_factory.mktemp("target"))
  make_hf_model(num_hidden_layers=4, vocab_size=VOCAB).save_pretrained(directory)
  return jetflow_jax.load_qwen3(directory)


def head_config(config, causal=True, block_size=6):
  return HeadConfig.for_target(config, num_layers=2, block_size=block_size,
                               mask_token_id=config.vocab_size - 1, causal=causal,
                               target_layer_ids=(0, config.num_hidden_layers - 2))


@pytest.fixture(scope="module")
def trained_head(target):
  """A causal head trained 60 steps on the target's greedy continuations."""
  config, params = target
  head = head_config(config)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, MASK_ID, 8).tolist() for _ in range(32)]
  tokens = np.array([p + r for p, r in zip(prompts, generate(params, config, prompts, 40,
                                                             stop_tokens=()).tokens)], np.int32)
  loss_mask = np.zeros_like(tokens, bool)
  loss_mask[:, 8:] = True
  steps = 60
  optimizer, schedule = make_optimizer(3e-3, 0.9, 0.95, 0.0, 1.0, steps, 0.04, 0.1)
  head_params = init_head_params(head, jax.random.key(0))
  state = TrainState(step=jnp.zeros((), jnp.int32), head_params=head_params,
                     opt_state=optimizer.init(head_params))
  train_step = jax.jit(make_train_step(make_loss_fn(head, config, LossConfig(num_anchors=16)),
                                       optimizer, schedule, seed=0))
  for rows in rng.integers(0, 32, (steps, 8)):
    state, _ = train_step(state, params, tokens[rows], loss_mask[rows])
  return head, state.head_params


@dataclasses.dataclass(frozen=True)
class CheatingDrafter:
  """Proposes a known continuation (its params: `[B, R]` reference tokens) with certainty."""

  depth: int
  tap_layers: tuple[int, ...] = ()

  def init_state(self, params, target_params, taps_btld, cache_size):
    return jnp.zeros((), jnp.int32)

  def known(self, params, context_len_b):
    """`[B, D]`: the reference tokens at depths 1..D after each row's anchor."""
    index_bd = context_len_b[:, None] + 1 + jnp.arange(self.depth)[None, :]
    return jnp.take_along_axis(params, jnp.minimum(index_bd, params.shape[1] - 1), axis=1)

  def draft(self, params, target_params, target_config, state, anchor_b, context_len_b):
    next_bd = self.known(params, context_len_b)
    return jax.nn.log_softmax(30.0 * jax.nn.one_hot(next_bd, target_config.vocab_size), axis=-1)

  def commit(self, params, state, taps_btld, start_b):
    return state


@dataclasses.dataclass(frozen=True)
class FixedDrafter:
  """A deliberately bad drafter: the same per-depth distribution (its params) every round."""

  depth: int
  tap_layers: tuple[int, ...] = ()

  def init_state(self, params, target_params, taps_btld, cache_size):
    return jnp.zeros((), jnp.int32)

  def draft(self, params, target_params, target_config, state, anchor_b, context_len_b):
    return jnp.broadcast_to(params, (anchor_b.shape[0],) + params.shape)

  def commit(self, params, state, taps_btld, start_b):
    return state


def ar_greedy(config, params, prompts, max_new_tokens, stop_tokens=()):
  return generate(params, config, prompts, max_new_tokens, stop_tokens=stop_tokens).tokens


@pytest.mark.parametrize("method,budget,head_kind", [
    ("dflash", 0, "untrained"), ("ddtree", 9, "untrained"), ("jetflow", 23, "untrained"),
    ("dflash", 0, "trained"), ("jetflow", 4, "trained"), ("jetflow", 23, "trained")])
def test_greedy_equals_ar(target, trained_head, method, budget, head_kind):
  config, params = target
  if head_kind == "trained":
    head, head_params = trained_head
  else:
    head = head_config(config, causal=method == "jetflow")
    head_params = init_head_params(head, jax.random.key(3))
  result = jetflow_jax.speculative_generate(
      params, config, head_params, head, PROMPTS, 24, method=method, budget=budget or 64,
      top_k=3, stop_tokens=(), warn=lambda _: None)
  assert result.tokens == ar_greedy(config, params, PROMPTS, 24)
  assert result.stop_reasons == ["max_tokens"] * 3
  assert all(len(r) >= 1 and min(r) >= 1 for r in result.committed_per_round)
  if head_kind == "trained" and method != "dflash":
    assert result.tau > 1.2  # a head trained for a minute already gets several tokens a round


def test_draft_vocabulary_drafts_its_tokens_and_stays_lossless(target, trained_head):
  """The trained head over 40 of the 96 tokens (its LM head's columns for them): its draft
  logits are the full head's at those tokens, the trees hold only them, and greedy decoding
  still equals AR while drafts get accepted."""
  config, params = target
  head, head_params = trained_head
  reference = ar_greedy(config, params, PROMPTS, 24)
  counts = np.bincount(np.concatenate(reference), minlength=VOCAB)
  ids = np.sort(np.argsort(-counts, kind="stable")[:40])
  small = dataclasses.replace(head, draft_vocab_size=40)
  small_params = with_draft_vocab(head_params, params, config, ids)
  tokens = np.array([PROMPTS[1]])
  np.testing.assert_allclose(draft_logits(small_params, small, params, config, tokens),
                             draft_logits(head_params, head, params, config, tokens)[..., ids],
                             atol=1e-5, rtol=0)
  for method in ("jetflow", "dflash"):  # the tree and the chain (the head is causal: an ablation)
    result = jetflow_jax.speculative_generate(
        params, config, small_params, small, PROMPTS, 24, method=method, budget=23, top_k=3,
        stop_tokens=(), warn=lambda _: None)
    assert result.tokens == reference, method
    if method == "jetflow":
      assert result.tau > 1.2  # unmapped draft ids (0..39) would all be rejected


def test_cheating_drafter_reaches_full_depth_and_matches_ar(target):
  config, params = target
  reference = ar_greedy(config, params, PROMPTS, 40)
  drafter = CheatingDrafter(depth=5)
  ref_bs = np.zeros((3, 64), np.int32)
  for b, (p, r) in enumerate(zip(PROMPTS, reference)):
    ref_bs[b, :len(p) + len(r)] = p + r
  for shape in (TreeShape("chain"), TreeShape("top_n", 16, 2)):
    result = decode_prompts(params, config, drafter, jnp.asarray(ref_bs), PROMPTS, 40,
                                  tree_shape=shape, stop_tokens=())
    assert result.tokens == reference
    # 39 tokens after the prefill's first, 6 per round: 7 rounds, the last one cut to 3.
    assert result.committed_per_round == [[6] * 6 + [3]] * 3
    assert result.tau > 5.5 and result.num_forwards == 8


def test_stop_token_inside_an_accepted_path_ends_that_row_only(target):
  config, params = target
  reference = ar_greedy(config, params, PROMPTS, 30)
  # A token row 0 first produces at index 9: with 6 tokens a round, mid-path of round 2.
  stop = next(t for i, t in enumerate(reference[0]) if i >= 8 and t not in reference[0][:i])
  expected = ar_greedy(config, params, PROMPTS, 30, stop_tokens=(stop,))
  assert expected[0][-1] == stop and len(expected[0]) < 30
  ref_bs = np.zeros((3, 64), np.int32)
  for b, (p, r) in enumerate(zip(PROMPTS, reference)):
    ref_bs[b, :len(p) + len(r)] = p + r
  result = decode_prompts(params, config, CheatingDrafter(depth=5), jnp.asarray(ref_bs),
                                PROMPTS, 30, tree_shape=TreeShape("top_n", 12, 2),
                                stop_tokens=(stop,))
  assert result.tokens == expected
  assert result.stop_reasons[0] == "stop_token"
  assert [len(t) for t in result.tokens][1:] == [len(t) for t in expected][1:]


def test_streaming_host_loop_gives_the_same_tokens(target, trained_head):
  config, params = target
  head, head_params = trained_head
  seen = []
  streamed = jetflow_jax.speculative_generate(params, config, head_params, head, PROMPTS, 20,
                                              budget=10, top_k=3, stop_tokens=(),
                                              on_tokens=seen.append)
  whole = jetflow_jax.speculative_generate(params, config, head_params, head, PROMPTS, 20,
                                           budget=10, top_k=3, stop_tokens=())
  assert streamed.tokens == whole.tokens and len(seen) > 2
  assert all(len(a[0]) <= len(b[0]) for a, b in zip(seen, seen[1:]))  # tokens only ever grow


def test_cache_and_head_context_after_rounds_equal_ar_and_append_context(target, trained_head):
  config, params = target
  head, head_params = trained_head
  drafter = HeadDrafter(head)
  rows = batch_rows(PROMPTS, 40, 64, Greedy(), 0, ())
  prefill, decode = compile_decode(params, head_params, rows,
                                   RoundSpec(config, drafter, TreeShape("top_n", 12, 3)), 64)
  lengths_b = rows.lengths_b
  state = decode(params, head_params, prefill(params, head_params, *rows.args()), 3)
  assert (np.asarray(state.lengths_b) - lengths_b > 3).any()  # some round accepted draft tokens
  assert_caches_equal_ar_and_append_context(config, params, head, head_params, state)


def assert_caches_equal_ar_and_append_context(config, params, head, head_params, state):
  tokens, lengths = np.asarray(state.tokens_bs), np.asarray(state.lengths_b)
  for b in range(len(lengths)):
    cached = lengths[b] - 1  # every committed token but the anchor
    seq = jnp.asarray(tokens[b:b + 1, :cached])
    _, ar_cache, taps = forward(params, config, seq, cache=KVCache.zeros(config, 1, cached,
                                                                          jnp.float32),
                                tap_layers=head.target_layer_ids)
    for got, want in zip(state.cache.k + state.cache.v, ar_cache.k + ar_cache.v):
      np.testing.assert_allclose(got[b, :cached], want[0], atol=2e-5)
    context = append_context(head_params, head, init_head_cache(head, 1, cached, jnp.float32),
                             taps, jnp.zeros((1,), jnp.int32))
    for got, want in zip(state.drafter_state.k + state.drafter_state.v, context.k + context.v):
      np.testing.assert_allclose(got[b, :cached], want[0], atol=2e-5)


# --- sampling is lossless -----------------------------------------------------------------------

SMALL_VOCAB = 8
SAMPLES = 60_000


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
  from conftest import make_hf_model
  directory = str(tmp_path_factory.mktemp("small"))
  model = make_hf_model(num_hidden_layers=3, vocab_size=SMALL_VOCAB, seed=1)
  model.save_pretrained(directory)
  config, params = jetflow_jax.load_qwen3(directory)
  return config, params, model


def exact_first_three(model, prompt, sampler: Sampling) -> np.ndarray:
  """P(t1, t2, t3 | prompt) `[V, V, V]` from the transformers model and NumPy filters."""
  from test_sampling import reference_processed
  v = SMALL_VOCAB
  pairs = np.array([(a, b) for a in range(v) for b in range(v)])
  seqs = np.concatenate([np.tile(prompt, (len(pairs), 1)), pairs], axis=1)
  with torch.no_grad():
    logits = model(torch.tensor(seqs)).logits.double().numpy()
  n = len(prompt)

  def probs(rows):
    processed = reference_processed(rows, sampler.temperature, sampler.top_k, sampler.top_p)
    p = np.exp(processed - processed.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)

  p1 = probs(logits[:1, n - 1])[0]
  p2 = probs(logits[::v, n])  # [t1, t2]
  p3 = probs(logits[:, n + 1]).reshape(v, v, v)  # [t1, t2, t3]
  return p1[:, None, None] * p2[:, :, None] * p3


def assert_matches(samples_b3: np.ndarray, exact: np.ndarray):
  v = SMALL_VOCAB
  counts = np.bincount(samples_b3 @ np.array([v * v, v, 1]), minlength=v**3)
  expected = exact.reshape(-1) * len(samples_b3)
  assert counts[expected == 0].sum() == 0, "sampled a token the filters exclude"
  big = expected >= 5  # chi-square needs enough expected counts; pool the rest into one cell
  observed = np.append(counts[big], counts[~big].sum())
  wanted = np.append(expected[big], expected[~big].sum())
  keep = wanted > 0
  p_value = scipy.stats.chisquare(observed[keep], wanted[keep]).pvalue
  total_variation = 0.5 * np.abs(counts / len(samples_b3) - exact.reshape(-1)).sum()
  assert p_value > 1e-3 and total_variation < 0.04, (p_value, total_variation)


@pytest.mark.parametrize("sampler,drafter_kind", [
    (Sampling(1.0), "head"), (Sampling(0.7, top_k=5, top_p=0.9), "draft_vocab"),
    (Sampling(1.3, top_p=0.8), "bad")])
def test_sampling_matches_the_target_distribution(small_target, sampler, drafter_kind):
  config, params, model = small_target
  prompt = [3, 1, 4, 1]
  if drafter_kind == "head":
    head = head_config(config, block_size=4)
    drafter, drafter_params = HeadDrafter(head), init_head_params(head, jax.random.key(5))
  elif drafter_kind == "draft_vocab":  # drafts over 5 of the 8 tokens, in a shuffled order
    head = dataclasses.replace(head_config(config, block_size=4), draft_vocab_size=5)
    drafter_params = with_draft_vocab(init_head_params(head, jax.random.key(5)), params, config,
                                      [6, 1, 3, 7, 2])
    drafter = HeadDrafter(head)
  else:  # confidently wrong: always drafts the target's least likely first token, etc.
    drafter = FixedDrafter(depth=3)
    drafter_params = jax.nn.log_softmax(
        jax.random.normal(jax.random.key(1), (3, SMALL_VOCAB)) * 4, axis=-1)
  batch = SAMPLES // 2
  samples = []
  for seed in range(2):  # rows of one batch draw independently; so do seeds
    result = decode_prompts(params, config, drafter, drafter_params, [prompt] * batch, 3,
                            tree_shape=TreeShape("top_n", 8, 3), sampler=sampler,
                            seed=seed, stop_tokens=(), cache_size=8)  # the smallest that fits
    samples.append(np.array(result.tokens))
  samples = np.concatenate(samples)
  assert samples.shape == (SAMPLES, 3)
  assert_matches(samples, exact_first_three(model, np.array(prompt), sampler))


# --- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(budget=1), "budget"), (dict(budget=10**6, top_k=2), "budget"),
    (dict(top_k=0), "top.k"), (dict(top_k=VOCAB + 1), "top.k"), (dict(method="medusa"), "method"),
    (dict(attention="cuda"), "attention"), (dict(max_new_tokens=0), "max_new_tokens")])
def test_bad_arguments_raise_clear_errors(target, trained_head, kwargs, match):
  config, params = target
  head, head_params = trained_head
  kwargs = dict(dict(max_new_tokens=4), **kwargs)
  max_new = kwargs.pop("max_new_tokens")
  with pytest.raises(InputError, match=match):
    jetflow_jax.speculative_generate(params, config, head_params, head, PROMPTS, max_new,
                                     **kwargs)


def test_method_needing_a_head_and_a_head_that_does_not_fit(target, trained_head):
  config, params = target
  with pytest.raises(InputError, match="needs a draft head"):
    jetflow_jax.speculative_generate(params, config, None, None, PROMPTS, 4)
  head, head_params = trained_head
  wrong = dataclasses.replace(head, num_target_layers=7, vocab_size=50)
  with pytest.raises(ConfigError, match="7-layer target") as error:
    jetflow_jax.speculative_generate(params, config, head_params, wrong, PROMPTS, 4)
  assert "vocab_size" in str(error.value)


def test_mismatched_mask_flag_warns_once_and_runs(target, trained_head):
  config, params = target
  head, head_params = trained_head  # causal
  warnings = []
  result = jetflow_jax.speculative_generate(params, config, head_params, head, PROMPTS, 6,
                                            method="ddtree", budget=8, top_k=2, stop_tokens=(),
                                            warn=warnings.append)
  assert len(warnings) == 1 and "ablation" in warnings[0]
  assert result.tokens == ar_greedy(config, params, PROMPTS, 6)


def test_pallas_attention_gives_the_same_tokens(target, trained_head):
  """Target verify and head block both through the Pallas kernel (interpret mode on CPU)."""
  config, params = target
  head, head_params = trained_head
  result = jetflow_jax.speculative_generate(params, config, head_params, head, PROMPTS[:2], 8,
                                            budget=6, top_k=2, stop_tokens=(), attention="pallas")
  assert result.tokens == ar_greedy(config, params, PROMPTS[:2], 8)
