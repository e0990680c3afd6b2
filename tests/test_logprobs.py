"""Log-probabilities through the engine: the target's own (before temperature and filters), from
the forwards that made the tokens, equal to transformers' log-softmax on prompt + completion for
every method, greedy and sampled; and the prompt's, for echo."""

import functools

import jax
import numpy as np
import pytest
import torch

from jetflow_jax.engine import Orchestrator, Request, make_engine
from jetflow_jax.errors import InputError
from jetflow_jax.head import init_head_params
from test_speculative import head_config

TOP = 4
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
  """(config, params, transformers model) of a 3-layer target over 64 tokens."""
  import jetflow_jax
  from conftest import make_hf_model
  directory = str(tmp_path_factory.mktemp("target"))
  model = make_hf_model(num_hidden_layers=3, vocab_size=64, seed=2)
  model.save_pretrained(directory)
  return (*jetflow_jax.load_qwen3(directory), model)


@pytest.fixture(scope="module")
def engine_for(small_target):
  config, params, _ = small_target
  head = head_config(config, block_size=4)
  head_params = init_head_params(head, jax.random.key(7))

  @functools.cache
  def build(method):
    return make_engine(params, config, head_params, head, method=method, budget=8, top_k=3,
                       num_slots=2, max_context=32, rounds_per_step=2, top_logprobs=TOP,
                       warn=lambda _: None)

  return build


def oracle(model, tokens) -> np.ndarray:
  """transformers' float64 log-softmax `[T, V]`: row t is the distribution of token t + 1."""
  with torch.no_grad():
    logits = model(torch.tensor([tokens])).logits[0].double()
  return torch.log_softmax(logits, -1).numpy()


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree", "jetflow"])
def test_logprobs_are_the_targets_for_every_method(small_target, engine_for, method):
  _, _, model = small_target
  requests = [Request(PROMPTS[0], 12, stop_tokens=(), logprobs=TOP, prompt_logprobs=True),
              Request(PROMPTS[1], 12, temperature=1.0, top_p=0.9, seed=5, stop_tokens=(),
                      logprobs=2)]
  greedy, sampled = Orchestrator(engine_for(method)).generate(requests)
  for stream in (greedy, sampled):
    prompt = list(stream.request.prompt)
    expected = oracle(model, prompt + stream.tokens)
    positions = range(len(prompt), len(prompt) + len(stream.tokens))
    want = [expected[t - 1, token] for t, token in zip(positions, stream.tokens)]
    np.testing.assert_allclose(stream.logprobs, want, atol=TOLERANCE)
    for t, top in zip(positions, stream.top_logprobs):
      ids, values = zip(*top)
      assert len(top) == stream.request.logprobs
      np.testing.assert_allclose(values, expected[t - 1, list(ids)], atol=TOLERANCE)
      np.testing.assert_allclose(values, np.sort(expected[t - 1])[::-1][:len(top)],
                                 atol=TOLERANCE)  # the likeliest, likeliest first
  # echo: every prompt token after the first, from the prefill's forward
  expected = oracle(model, PROMPTS[0])
  assert greedy.prompt_logprobs[0] is None and greedy.prompt_top_logprobs[0] is None
  np.testing.assert_allclose(greedy.prompt_logprobs[1:],
                             [expected[t - 1, PROMPTS[0][t]] for t in range(1, len(PROMPTS[0]))],
                             atol=TOLERANCE)
  assert not sampled.prompt_logprobs  # not asked for


def test_more_alternatives_than_the_engine_keeps_are_refused(engine_for):
  with pytest.raises(InputError, match="logprobs"):
    engine_for("ar").check(Request(PROMPTS[0], 4, logprobs=TOP + 1))
