"""The training objective against an oracle built without the training code.

Teacher: transformers' float64 logits of the target at position a + k - 1. Student: the
decode path (`head.draft_logits` on the prefix ending at anchor a). Losses in float64 NumPy.
"""

import functools

import jax
import numpy as np
import pytest
import torch

import jetflow_jax
from jetflow_jax.head import draft_logits, init_head_params
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.train.step import LossConfig, make_loss_fn

VOCAB = 16
MASK_ID = VOCAB - 1
BLOCK = 5
GAMMA = 2.0  # depth weights exp(-(k - 1) / 2), so the total is a weighted mean
TOL = 1e-5
# Anchor 10's last depths fall past the row's end; row 1's anchor 4 is flagged invalid.
ANCHORS = np.array([[4, 10], [10, 4]])
ANCHOR_VALID = np.array([[True, True], [True, False]])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """Tiny HF target, its JAX load, random head params, tokens with holes, teacher logits."""
  from conftest import make_hf_model
  hf_model = make_hf_model(vocab_size=VOCAB)
  directory = str(tmp_path_factory.mktemp("target"))
  hf_model.save_pretrained(directory)
  config, params = jetflow_jax.load_qwen3(directory)
  head_params = init_head_params(head_for(config, True), jax.random.key(1))  # either mask flag
  tokens = np.random.default_rng(0).integers(0, MASK_ID, (2, 14)).astype(np.int32)
  loss_mask = np.ones_like(tokens, bool)
  loss_mask[:, :3] = False
  loss_mask[1, :6] = False
  loss_mask[0, 6] = False  # one unlabelled position inside a block
  with torch.no_grad():
    teacher_btv = hf_model.double()(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
  return config, params, head_params, tokens, loss_mask, teacher_btv


def head_for(config, causal):
  return HeadConfig.for_target(config, num_layers=2, block_size=BLOCK, mask_token_id=MASK_ID,
                               causal=causal, target_layer_ids=(0, 1))


@pytest.fixture(scope="module")
def students(setup):
  """`students(causal)[row, anchor]`: decode-path draft logits `[depth, V]` in float64."""
  config, params, head_params, tokens, _, _ = setup

  @functools.cache
  def of(causal):
    out = {}
    for anchor in np.unique(ANCHORS):
      logits = draft_logits(head_params, head_for(config, causal), params, config,
                            tokens[:, :anchor + 1])
      out.update({(b, anchor): np.asarray(logits[b], np.float64) for b in range(len(tokens))})
    return out

  return of


def log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def oracle(setup, students, causal, kind, teacher_shift=0, label_shift=0):
  """(per-depth mean loss, weighted total, mean forward KL, per-depth agreement), float64.

  `teacher_shift` / `label_shift` move the teacher / label one position earlier: wrong
  objectives the training values must not match.
  """
  _, _, _, tokens, loss_mask, teacher_btv = setup
  depth, length = BLOCK - 1, tokens.shape[1]
  losses = [[] for _ in range(depth)]
  kls, agrees = [], [[] for _ in range(depth)]
  for b, row in enumerate(ANCHORS):
    for i, anchor in enumerate(row):
      for k in range(1, depth + 1):
        predicted = anchor + k
        if not (ANCHOR_VALID[b, i] and predicted < length and loss_mask[b, predicted]):
          continue
        log_p = log_softmax(teacher_btv[b, predicted - 1 - teacher_shift])
        draft = students(causal)[b, anchor][k - 1]
        log_q = log_softmax(draft)
        kl = float(np.sum(np.exp(log_p) * (log_p - log_q)))
        ce = -float(log_q[tokens[b, predicted - label_shift]])
        losses[k - 1].append(kl if kind == "forward_kl" else ce)
        kls.append(kl)
        agrees[k - 1].append(float(draft[np.argmax(log_p)] == draft.max()))
  weights = np.exp(-np.arange(depth) / GAMMA)
  total = sum(w * np.sum(v) for w, v in zip(weights, losses)) / sum(
      w * len(v) for w, v in zip(weights, losses))
  return (np.array([np.mean(v) for v in losses]), total, np.mean(kls),
          np.array([np.mean(v) for v in agrees]))


@functools.partial(jax.jit, static_argnums=0)
def training_values(loss_fn, head_params, params, tokens, loss_mask):
  """The train step's (loss, aux) at the fixed anchors."""
  target, _, _ = loss_fn.prepare(params, tokens, loss_mask, jax.random.key(0))
  return loss_fn.at_anchors(head_params, params, tokens, loss_mask, target, ANCHORS, ANCHOR_VALID)


@pytest.mark.parametrize("kind", ["forward_kl", "cross_entropy"])
@pytest.mark.parametrize("causal", [True, False])
def test_training_loss_equals_oracle_per_depth(setup, students, causal, kind):
  config, params, head_params, tokens, loss_mask, _ = setup
  # One anchor per chunk: the chunked path (tests/test_train_step.py checks it against no chunks).
  loss_fn = make_loss_fn(head_for(config, causal), config,
                         LossConfig(kind=kind, depth_gamma=GAMMA, num_anchors=2, chunk_anchors=1))
  loss, aux = training_values(loss_fn, head_params, params, tokens, loss_mask)
  loss_k, total, kl, agreement_k = oracle(setup, students, causal, kind)

  np.testing.assert_allclose(aux["loss_k"], loss_k, rtol=TOL, atol=TOL)
  np.testing.assert_allclose(loss, total, rtol=TOL, atol=TOL)
  np.testing.assert_allclose(aux["forward_kl"], kl, rtol=TOL, atol=TOL)
  assert agreement_k.any()  # some top-1 agreement, so the metric is checked on more than zeros
  np.testing.assert_allclose(aux["agreement_k"], agreement_k, atol=1e-6)
  assert int(aux["num_predictions"]) == 9

  # Teeth: a teacher or label one position off is far outside the tolerance.
  early_teacher = oracle(setup, students, causal, kind, teacher_shift=1)
  early_label = oracle(setup, students, causal, kind, label_shift=1)
  wrong_k, wrong_total, _, _ = early_teacher if kind == "forward_kl" else early_label
  assert np.abs(np.asarray(aux["loss_k"]) - wrong_k).min() > 100 * TOL
  assert abs(float(loss) - wrong_total) > 100 * TOL
  assert abs(float(aux["forward_kl"]) - early_teacher[2]) > 100 * TOL
