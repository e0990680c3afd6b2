"""The unlikelihood term: which tokens it penalises, its value, and rollouts under padding."""

import subprocess
import sys

import numpy as np
import torch

from conftest import make_hf_model
from jetflow_jax.embedded import unlikelihood
from jetflow_jax.embedded.unlikelihood import PROMPT_TOKENS


def brute_force_marks(tokens, start, n):
  """Token i >= start is marked iff some n-gram covering it also occurs starting earlier."""
  marks = np.zeros(len(tokens), bool)
  for j in range(len(tokens) - n + 1):
    gram = tokens[j:j + n]
    if any(tokens[k:k + n] == gram for k in range(j)):
      marks[max(j, start):j + n] = True
  return marks


def test_repeated_ngram_marks_match_brute_force():
  rng = np.random.default_rng(0)
  for _ in range(200):
    tokens = rng.integers(0, 3, size=rng.integers(1, 30)).tolist()
    start = int(rng.integers(0, len(tokens) + 1))
    n = int(rng.integers(1, 5))
    np.testing.assert_array_equal(unlikelihood.repeated_ngram_mask(tokens, start, n),
                                  brute_force_marks(tokens, start, n))
  # The prompt counts as earlier text: a continuation copying it is marked whole.
  assert unlikelihood.repeated_ngram_mask([1, 2, 3, 4, 1, 2, 3, 4], 4).tolist() == [0] * 4 + [1] * 4


def test_unlikelihood_loss_against_float64_reference():
  rng = np.random.default_rng(1)
  batch, cont, vocab = 3, 12, 5
  ids = np.zeros((batch, PROMPT_TOKENS + cont), np.int64)
  mask = np.zeros_like(ids)
  for row, prompt_len in enumerate((4, 9, 2)):
    ids[row, PROMPT_TOKENS - prompt_len:] = rng.integers(1, vocab, PROMPT_TOKENS + cont)[
        PROMPT_TOKENS - prompt_len:]
    mask[row, PROMPT_TOKENS - prompt_len:] = 1
  ids[1, -4:] = 0  # the pad id in the continuation: padding is no earlier text to repeat
  logits = rng.normal(size=(batch, PROMPT_TOKENS + cont, vocab))
  term, share = unlikelihood.unlikelihood_loss(torch.tensor(logits, dtype=torch.float32),
                                               torch.from_numpy(ids), torch.from_numpy(mask),
                                               PROMPT_TOKENS)
  probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  expected, marked = 0.0, 0
  for row in range(batch):
    first = int(np.argmax(mask[row]))
    text = ids[row, first:].tolist()
    marks = brute_force_marks(text, PROMPT_TOKENS - first, 4)
    for i in np.flatnonzero(marks):
      expected -= np.log(1 - probs[row, first + i - 1, text[i]])
      marked += 1
  assert marked > 0
  np.testing.assert_allclose(term.item(), expected / (batch * cont), rtol=1e-5)
  assert share == marked / (batch * cont)


def test_corrected_teacher_loss_against_float64_reference():
  rng = np.random.default_rng(2)
  batch, cont, vocab = 2, 10, 4
  ids = rng.integers(1, vocab, (batch, PROMPT_TOKENS + cont))
  mask = np.ones_like(ids)
  ids[0, :PROMPT_TOKENS - 3], mask[0, :PROMPT_TOKENS - 3] = 0, 0  # a 3-token prompt
  logits, reference = rng.normal(size=(2, batch, PROMPT_TOKENS + cont, vocab))
  term, share = unlikelihood.corrected_teacher_loss(
      torch.tensor(logits, dtype=torch.float32), torch.tensor(reference, dtype=torch.float32),
      torch.from_numpy(ids), torch.from_numpy(mask), PROMPT_TOKENS)

  def softmax(x):
    return np.exp(x) / np.exp(x).sum()
  expected, corrected = 0.0, 0
  for row in range(batch):
    first = int(np.argmax(mask[row]))
    marks = brute_force_marks(ids[row, first:].tolist(), PROMPT_TOKENS - first, 4)
    for t in range(PROMPT_TOKENS, PROMPT_TOKENS + cont):
      teacher = softmax(reference[row, t - 1])
      if marks[t - first]:
        teacher[ids[row, t]] = 0
        teacher /= teacher.sum()
        corrected += 1
      expected -= (teacher * np.log(softmax(logits[row, t - 1]))).sum()
  assert corrected > 0
  np.testing.assert_allclose(term.item(), expected / (batch * cont), rtol=1e-5)
  np.testing.assert_allclose(share, corrected / (batch * cont))


def test_left_padded_rollouts_match_unpadded_greedy_and_training_logits():
  model = make_hf_model(seed=3, vocab_size=64)
  prompts = [[5, 9, 2], list(range(10, 40)), [7] * 12]
  ids, mask = unlikelihood.greedy_rollouts(model, prompts, pad_id=0, new_tokens=6)
  assert ids.shape == (3, PROMPT_TOKENS + 6) and mask[:, PROMPT_TOKENS:].all()
  # The training forward reads the padded rows at their unpadded positions.
  padded_logits = unlikelihood.rollout_logits(model, ids, mask)
  with torch.no_grad():
    for row, prompt in enumerate(prompts):
      alone = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
      assert ids[row, PROMPT_TOKENS - len(prompt):].tolist() == alone[0].tolist()
      torch.testing.assert_close(padded_logits[row, PROMPT_TOKENS - len(prompt):],
                                 model(input_ids=alone).logits[0], atol=1e-4, rtol=1e-4)


def test_one_step_down_the_term_lowers_it():
  model = make_hf_model(seed=4, vocab_size=16)  # a small vocabulary loops
  ids, mask = unlikelihood.greedy_rollouts(model, [[1, 2, 3, 4], [5, 6]], pad_id=0, new_tokens=24)

  def term():
    logits = unlikelihood.rollout_logits(model, ids, mask)
    return unlikelihood.unlikelihood_loss(logits, ids, mask, PROMPT_TOKENS)

  before, share = term()
  assert share > 0
  before.backward()
  with torch.no_grad():
    for p in model.parameters():
      p -= 1e-2 * p.grad
  assert term()[0].item() < before.item()


def test_pretrain_rejects_rollout_flags_that_cannot_work(tmp_path):
  for flags, message in ((["--unlikelihood-batch", "4"], "needs --init-from"),
                         (["--unlikelihood-batch", "-1"], "must be >= 0")):
    result = subprocess.run([sys.executable, "-m", "jetflow_jax.embedded.pretrain", "--workdir",
                             str(tmp_path / "w"), "--out", str(tmp_path / "o"), *flags],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "w").exists()
