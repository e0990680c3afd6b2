"""Losses against float64 NumPy, anchor sampling, chunked loss, learning on a tiny target,
sharding."""

import dataclasses
import functools
import math

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jetflow_jax
from jetflow_jax.decoding import generate
from jetflow_jax.head import init_head_params, split_frozen, training_logits, with_draft_vocab
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.masks import segment_starts
from jetflow_jax.train.losses import depth_weights, kl_divergence, per_depth_loss
from jetflow_jax.train.sharding import batch_sharding, make_mesh, param_sharding
from jetflow_jax.train.step import (LossConfig, TrainState, make_loss_fn, make_optimizer,
                                    make_train_step, sample_anchors)

VOCAB = 96
MASK_ID = VOCAB - 1


def np_log_softmax(x):
  x = x.astype(np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_losses_match_float64_reference():
  rng = np.random.default_rng(0)
  p, q = rng.normal(size=(2, 3, 4, 50)) * 3
  labels = rng.integers(0, 50, (3, 4))
  for temperature in (1.0, 2.0):
    lp, lq = np_log_softmax(p / temperature), np_log_softmax(q / temperature)
    forward = (np.exp(lp) * (lp - lq)).sum(-1) * temperature**2
    reverse = (np.exp(lq) * (lq - lp)).sum(-1) * temperature**2
    np.testing.assert_allclose(per_depth_loss("forward_kl", q, p, labels, temperature), forward,
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(per_depth_loss("reverse_kl", q, p, labels, temperature), reverse,
                               rtol=1e-4, atol=1e-5)
  ce = -np.take_along_axis(np_log_softmax(q), labels[..., None], -1)[..., 0]
  np.testing.assert_allclose(per_depth_loss("cross_entropy", q, p, labels), ce, rtol=1e-5)
  assert float(kl_divergence(p, p).max()) < 1e-5
  np.testing.assert_allclose(depth_weights(4, 2.0), np.exp(-np.arange(4) / 2.0), rtol=1e-6)
  np.testing.assert_array_equal(depth_weights(3, 0.0), np.ones(3))


def test_anchors_are_distinct_response_positions():
  mask = np.zeros((3, 40), bool)
  mask[0, 10:30] = True
  mask[1, 5:8] = True  # fewer candidates than anchors
  mask[2, 20:] = True  # the last position has nothing after it
  anchors, valid = sample_anchors(jax.random.key(0), jnp.asarray(mask), 6)
  anchors, valid = np.asarray(anchors), np.asarray(valid)
  for row in range(3):
    chosen = anchors[row][valid[row]]
    assert len(set(chosen.tolist())) == len(chosen)
    # An anchor and the token after it are both response tokens.
    assert mask[row, chosen].all() and mask[row, chosen + 1].all() and (chosen >= 1).all()
  assert valid[0].all() and valid[1].sum() == 2 and valid[2].all()


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
  """A random 4-layer target, greedy continuations of random prompts as data."""
  from conftest import make_hf_model
  directory = str(tmp_path_factory.mktemp("target"))
  make_hf_model(num_hidden_layers=4, vocab_size=VOCAB).save_pretrained(directory)
  config, params = jetflow_jax.load_qwen3(directory)
  rng = np.random.default_rng(0)
  prompt_len, new = 8, 40
  prompts = [rng.integers(0, MASK_ID, prompt_len).tolist() for _ in range(48)]
  responses = generate(params, config, prompts, new).tokens
  tokens = np.array([p + r for p, r in zip(prompts, responses)], np.int32)
  loss_mask = np.zeros_like(tokens, bool)
  loss_mask[:, prompt_len:] = True
  return config, params, tokens, loss_mask


def head_for(config, causal=True):
  return HeadConfig.for_target(config, num_layers=2, block_size=6, mask_token_id=MASK_ID,
                               causal=causal, target_layer_ids=(0, 2))


def vocab_wide_sizes(jaxpr, depth, vocab):
  """Leading sizes (all axes but the last two) of each `[..., depth, vocab]` value of a jaxpr."""
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      if var.aval.shape[-2:] == (depth, vocab):
        yield math.prod(var.aval.shape[:-2])
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          sub = sub.jaxpr
        if isinstance(sub, jax.extend.core.Jaxpr):
          yield from vocab_wide_sizes(sub, depth, vocab)


def test_chunked_loss_equals_unchunked(tiny_setup):
  config, params, tokens, loss_mask = tiny_setup
  head = head_for(config)
  batch, num_anchors, chunk = 3, 7, 3  # chunks of 3, 3 and 1 anchor (+2 invalid padding)
  args = (init_head_params(head, jax.random.key(0)), params, tokens[:batch], loss_mask[:batch],
          jax.random.key(3))
  results, widest = [], []
  for chunk_anchors in (0, chunk):
    # At T != 1 the forward-KL metric is its own vocabulary pass, chunked too.
    loss_config = LossConfig(temperature=2.0, depth_gamma=2.0, num_anchors=num_anchors,
                             chunk_anchors=chunk_anchors)
    grad_fn = jax.value_and_grad(make_loss_fn(head, config, loss_config), has_aux=True)
    results.append(jax.jit(grad_fn)(*args))
    widest.append(max(vocab_wide_sizes(jax.make_jaxpr(grad_fn)(*args).jaxpr, head.depth, VOCAB)))
  # Forward and backward: no vocabulary-wide value spans more anchors than one chunk.
  assert widest == [batch * num_anchors, batch * chunk]
  (whole_loss, whole_aux), whole_grads = results[0]
  (loss, aux), grads = results[1]
  assert set(aux) == {"loss_k", "forward_kl", "agreement_k", "num_predictions"}
  np.testing.assert_allclose(loss, whole_loss, rtol=1e-5)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6), aux,
               whole_aux)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6), grads,
               whole_grads)


def test_train_step_gradient_is_the_loss_fn_gradient(tiny_setup):
  """The step runs the target outside differentiation; loss and gradient are unchanged."""
  config, params, tokens, loss_mask = tiny_setup
  head = head_for(config)
  loss_fn = make_loss_fn(head, config, LossConfig(num_anchors=8, chunk_anchors=3))
  head_params = init_head_params(head, jax.random.key(0))
  # Plain SGD at rate 1: the step moves the params by exactly minus the gradient.
  optimizer = optax.sgd(1.0)
  state = TrainState(step=jnp.zeros((), jnp.int32), head_params=head_params,
                     opt_state=optimizer.init(head_params))
  step = make_train_step(loss_fn, optimizer, lambda _: 1.0, seed=5)
  new_state, metrics = jax.jit(step)(state, params, tokens[:4], loss_mask[:4])
  (loss, _), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
      head_params, params, tokens[:4], loss_mask[:4], jax.random.fold_in(jax.random.key(5), 0))
  np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
  jax.tree.map(lambda g, old, new: np.testing.assert_allclose(old - new, g, atol=1e-6), grads,
               head_params, new_state.head_params)


def test_draft_vocabulary_loss_is_the_kl_renormalised_over_its_tokens(tiny_setup):
  """With 24 of the 96 tokens: the loss is the forward KL between the target's and the head's
  full-vocabulary distributions each renormalised over those tokens (float64 NumPy over the
  full logits), and a step leaves the draft vocabulary's LM head and ids as they were."""
  config, params, tokens, loss_mask = tiny_setup
  full = head_for(config)
  head = dataclasses.replace(full, draft_vocab_size=24)
  ids = np.sort(np.random.default_rng(3).choice(VOCAB, 24, replace=False))
  head_params = with_draft_vocab(init_head_params(full, jax.random.key(0)), params, config, ids)
  loss_fn = make_loss_fn(head, config, LossConfig(num_anchors=8, chunk_anchors=3))
  batch, rng = (tokens[:4], loss_mask[:4]), jax.random.fold_in(jax.random.key(5), 0)
  target, anchors, valid = jax.jit(loss_fn.prepare)(params, *batch, rng)

  logits_fn = jax.jit(training_logits, static_argnums=(1, 3))
  draft = np.asarray(logits_fn(split_frozen(head_params)[0], full, params, config,
                               target.taps_btld, batch[0], anchors))[..., ids]
  lm_head = (params["embed_tokens"]["embedding"].T if config.tie_word_embeddings
             else params["lm_head"]["kernel"])
  teacher = np.asarray(target.hidden_btd, np.float64) @ np.asarray(lm_head, np.float64)[:, ids]
  predicted = np.asarray(anchors)[:, :, None] + np.arange(1, full.block_size)
  rows = np.arange(4)[:, None, None]
  keep = (np.asarray(valid)[:, :, None] & (predicted < tokens.shape[1])
          & batch[1][rows, np.minimum(predicted, tokens.shape[1] - 1)])
  log_p = np_log_softmax(teacher[rows, np.minimum(predicted, tokens.shape[1] - 1) - 1])
  kl = (np.exp(log_p) * (log_p - np_log_softmax(draft))).sum(-1)
  assert keep.sum() > 20

  optimizer = optax.sgd(1.0)
  state = TrainState(step=jnp.zeros((), jnp.int32), head_params=head_params,
                     opt_state=optimizer.init(split_frozen(head_params)[0]))
  step = make_train_step(loss_fn, optimizer, lambda _: 1.0, seed=5)
  new_state, metrics = jax.jit(step)(state, params, *batch)
  np.testing.assert_allclose(metrics["loss"], kl[keep].mean(), rtol=1e-5)
  moved, frozen = split_frozen(new_state.head_params)
  jax.tree.map(np.testing.assert_array_equal, frozen, split_frozen(head_params)[1])
  assert np.abs(moved["fc"]["kernel"] - head_params["fc"]["kernel"]).max() > 1e-4


def test_training_lowers_kl_and_learns_depth_one(tiny_setup):
  config, params, tokens, loss_mask = tiny_setup
  head = head_for(config)
  loss_fn = make_loss_fn(head, config, LossConfig(num_anchors=16))
  steps = 300
  optimizer, schedule = make_optimizer(3e-3, 0.9, 0.95, 0.0, 1.0, steps, 0.04, 0.1)
  head_params = init_head_params(head, jax.random.key(0))
  state = TrainState(step=jnp.zeros((), jnp.int32), head_params=head_params,
                     opt_state=optimizer.init(head_params))
  train_step = jax.jit(make_train_step(loss_fn, optimizer, schedule, seed=0))
  evaluate = jax.jit(lambda p: loss_fn(p, params, tokens[:16], loss_mask[:16], jax.random.key(9)))

  before_loss, before = evaluate(state.head_params)
  batches = np.random.default_rng(1).integers(0, 48, (steps, 8))
  for rows in batches:
    state, metrics = train_step(state, params, tokens[rows], loss_mask[rows])
  after_loss, after = evaluate(state.head_params)

  assert np.isfinite(float(metrics["loss"]))
  assert float(after["forward_kl"]) < 0.6 * float(before["forward_kl"])
  # Chance is 1 / 96; a few hundred steps get depth 1 far above it.
  assert float(after["agreement_k"][0]) > 0.2 > float(before["agreement_k"][0])


def test_causal_and_bidirectional_losses_differ(tiny_setup):
  config, params, tokens, loss_mask = tiny_setup
  head_params = init_head_params(head_for(config), jax.random.key(0))
  losses = [jax.jit(make_loss_fn(head_for(config, causal), config, LossConfig(num_anchors=8)))(
      head_params, params, tokens[:4], loss_mask[:4], jax.random.key(0))[0]
            for causal in (True, False)]
  assert abs(float(losses[0]) - float(losses[1])) > 1e-4


def test_sharded_step_equals_single_device_step(tiny_setup):
  assert len(jax.devices()) == 4, "conftest asks XLA for four host devices"
  config, params, tokens, loss_mask = tiny_setup
  head = head_for(config)
  loss_fn = make_loss_fn(head, config, LossConfig(num_anchors=8))
  optimizer, schedule = make_optimizer(1e-3, 0.9, 0.95, 0.0, 1.0, 10, 0.0, 0.1)
  step = make_train_step(loss_fn, optimizer, schedule, seed=0)
  head_params = init_head_params(head, jax.random.key(0))
  state = TrainState(step=jnp.zeros((), jnp.int32), head_params=head_params,
                     opt_state=optimizer.init(head_params))

  results = []
  for mesh in (make_mesh(1, 1, jax.devices()[:1]), make_mesh(data=2, fsdp=2)):
    placed_state = jax.device_put(state, param_sharding(mesh, state))
    placed_params = jax.device_put(params, param_sharding(mesh, params))
    rows = batch_sharding(mesh)
    new_state, metrics = jax.jit(step)(placed_state, placed_params,
                                       jax.device_put(tokens[:8], rows),
                                       jax.device_put(loss_mask[:8], rows))
    results.append((new_state, metrics))
  (single, single_metrics), (sharded, sharded_metrics) = results
  assert len(sharded.head_params["fc"]["kernel"].sharding.device_set) == 4
  np.testing.assert_allclose(sharded_metrics["loss"], single_metrics["loss"], rtol=1e-5)
  # Sharded reductions sum in another order; Adam turns a near-zero gradient's rounding into
  # an update difference of up to a few percent of lr (1e-3), hence atol 2e-5.
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=2e-5),
               sharded.head_params, single.head_params)


def test_anchors_never_straddle_packed_samples():
  segment_ids = np.repeat([[1, 2, 3, 0]], [12, 9, 14, 5], axis=1)
  loss_mask = np.ones_like(segment_ids, bool)
  loss_mask[:, [0, 1, 12, 21, 22]] = False  # the samples' prompts
  loss_mask[segment_ids == 0] = False
  starts = segment_starts(jnp.asarray(segment_ids))
  anchors, valid = sample_anchors(jax.random.key(1), jnp.asarray(loss_mask), 40, starts)
  chosen = np.asarray(anchors)[np.asarray(valid)]
  # Every candidate is drawn: a response token, not its sample's last, nor its first.
  expected = [a for a in range(39) if loss_mask[0, a] and loss_mask[0, a + 1]
              and segment_ids[0, a] == segment_ids[0, a + 1] and a not in (0, 12, 21)]
  assert sorted(chosen.tolist()) == expected


@pytest.mark.parametrize("attention", ["split", "pallas"])
def test_packed_row_gives_each_sample_its_own_losses(tiny_setup, attention):
  """Three samples packed in one row: each one's loss, metrics and gradient equal its own row's."""
  config, params, tokens, loss_mask = tiny_setup
  head = head_for(config)
  loss_fn = make_loss_fn(head, config, LossConfig(num_anchors=3, head_attention=attention))
  head_params = init_head_params(head, jax.random.key(0))
  length, sample_lengths = 80, (30, 20, 25)
  # The last anchor of each sample sits near its end, so its deeper predictions fall outside it.
  sample_anchors_ = ([8, 15, 27], [9, 12, 18], [8, 20, 23])

  @functools.partial(jax.jit, static_argnames="packed")
  def losses_and_grads(row_tokens, row_mask, segment_ids, anchors, packed=True):
    target, _, _ = loss_fn.prepare(params, row_tokens, row_mask, jax.random.key(0),
                                   segment_ids if packed else None)
    grad_fn = jax.value_and_grad(loss_fn.at_anchors, has_aux=True)
    return grad_fn(head_params, params, row_tokens, row_mask, target, anchors,
                   jnp.ones(anchors.shape, bool))

  def padded(x):
    return jnp.asarray(np.pad(np.concatenate(x), (0, length - sum(map(len, x))))[None])

  samples = [(tokens[i, :n], loss_mask[i, :n]) for i, n in enumerate(sample_lengths)]
  packed_tokens, packed_mask = padded([t for t, _ in samples]), padded([m for _, m in samples])
  segment_ids = padded([np.full(n, i + 1) for i, n in enumerate(sample_lengths)])
  offsets = np.cumsum((0,) + sample_lengths)
  for i, (sample_tokens, sample_mask) in enumerate(samples):
    alone = losses_and_grads(padded([sample_tokens]), padded([sample_mask]), None,
                             jnp.asarray([sample_anchors_[i]]), packed=False)
    anchors = jnp.asarray([sample_anchors_[i]]) + offsets[i]
    in_row = losses_and_grads(packed_tokens, packed_mask, segment_ids, anchors)
    (loss, aux), grads = in_row
    assert int(aux["num_predictions"]) == int(alone[0][1]["num_predictions"]) < 3 * head.depth
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5),
                 (loss, aux, grads), (alone[0][0], alone[0][1], alone[1]))
    if i > 0:  # without segment ids the later samples read their predecessors
      (leaky_loss, _), _ = losses_and_grads(packed_tokens, packed_mask, segment_ids, anchors,
                                            packed=False)
      assert abs(float(leaky_loss) - float(loss)) > 1e-3
