"""The OpenAI API as clients use it, on the in-process AR server of test_serve.py (the embedded
target): log-probabilities are the engine's (the target's own: transformers' log-softmax for an
echoed prompt), streamed and cut by stop strings as the text is; `n`, a batch of prompts and
`best_of` give their choices in OpenAI's order; the `openai` client parses every answer."""

import json

import numpy as np
import pytest
import torch

from jetflow_jax import embedded
from jetflow_jax.engine import Orchestrator, Request
from jetflow_jax.text import encode_chat, load_tokenizer
from test_serve import (MODEL, PROMPTS, TEMPLATE, client, engine_for, local,  # noqa: F401
                        post, tokenizer)

TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def url(local):
  return local("ar")[0]


def offsets(tokens: list[str]) -> list[int]:
  """Where each token starts in their concatenation."""
  return np.cumsum([0] + [len(t) for t in tokens[:-1]]).tolist()


def check_alternatives(logprobs, count: int) -> None:
  """Each dict holds `count` alternatives and the chosen token (with its own logprob), and a
  token that is the likeliest has exactly the largest value (lm_eval's greedy test)."""
  for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs,
                                 logprobs.top_logprobs):
    assert len(top) in (count, count + 1) and top[token] == logprob
    assert list(top.values())[:count] == sorted(top.values(), reverse=True)[:count]


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, top_p=0.9,
                                                                 seed=7)])
def test_logprobs_are_the_engines_and_name_their_tokens(url, engine_for, tokenizer, sampling):
  ids = tokenizer.encode(PROMPTS[0], add_special_tokens=False)
  choice = client(url).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12,
                                          logprobs=3, **sampling).choices[0]
  stream, = Orchestrator(engine_for("ar")).generate([Request(ids, 12, logprobs=3, **sampling)])
  logprobs = choice.logprobs
  assert choice.token_ids == stream.tokens and logprobs.token_logprobs == stream.logprobs
  assert [list(top.values())[:3] for top in logprobs.top_logprobs] == [
      [value for _, value in pairs] for pairs in stream.top_logprobs]
  check_alternatives(logprobs, 3)
  assert logprobs.tokens == [tokenizer.decode([t]) for t in stream.tokens]
  assert "".join(logprobs.tokens) == choice.text
  assert logprobs.text_offset == offsets(logprobs.tokens)


def test_streamed_logprobs_and_stop_strings_cut_them_as_the_text(url, tokenizer):
  whole = client(url).completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16,
                                         temperature=0, logprobs=2).choices[0]
  stop = whole.text[8:12]
  cut = client(url).completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16,
                                       temperature=0, logprobs=2, stop=stop).choices[0]
  assert cut.finish_reason == "stop" and cut.text == whole.text[:whole.text.index(stop)]
  # Through the token that completes the stop string, as token_ids.
  assert len(cut.logprobs.tokens) == len(cut.token_ids) < len(whole.token_ids)
  assert cut.logprobs.token_logprobs == whole.logprobs.token_logprobs[:len(cut.token_ids)]
  for answer, options in ((whole, {}), (cut, {"stop": stop})):
    chunks = list(client(url).completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16,
                                                 temperature=0, logprobs=2, stream=True,
                                                 **options))
    joined = lambda field: [x for c in chunks for x in getattr(c.choices[0].logprobs, field)]
    assert "".join(c.choices[0].text for c in chunks) == answer.text
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
      assert joined(field) == getattr(answer.logprobs, field)
    if not options:  # a chunk carries the tokens its text completes
      assert all("".join(c.choices[0].logprobs.tokens) == c.choices[0].text for c in chunks)


def test_echo_gives_the_prompts_logprobs_as_transformers_computes_them(url, tokenizer):
  from transformers import Qwen3ForCausalLM
  model = Qwen3ForCausalLM.from_pretrained(embedded.default_target(), dtype=torch.float32)
  ids = tokenizer.encode(PROMPTS[2], add_special_tokens=False)
  with torch.no_grad():
    expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()
  answer = client(url).completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=0,
                                          echo=True, logprobs=2)
  choice = answer.choices[0]
  assert (choice.text, choice.token_ids, answer.usage.completion_tokens) == (PROMPTS[2], [], 0)
  logprobs = choice.logprobs
  assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
  np.testing.assert_allclose(logprobs.token_logprobs[1:],
                             [expected[t - 1, ids[t]] for t in range(1, len(ids))],
                             atol=TOLERANCE)
  logprobs.top_logprobs, logprobs.token_logprobs, logprobs.tokens = (
      logprobs.top_logprobs[1:], logprobs.token_logprobs[1:], logprobs.tokens[1:])
  check_alternatives(logprobs, 2)
  # lm_eval's loglikelihood call: token ids in a batch, one generated token; every array
  # covers the prompt and that token, which is greedy.
  status, body = post(f"{url}/v1/completions", json.dumps(
      {"prompt": [ids], "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0,
       "seed": 1234}).encode())
  assert status == 200
  choice = body["choices"][0]
  assert choice["text"] == PROMPTS[2] + tokenizer.decode(choice["token_ids"])
  lp = choice["logprobs"]
  assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
  assert choice["token_ids"] == [int(np.argmax(expected[-1]))]
  assert lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())
  np.testing.assert_allclose(lp["token_logprobs"][-1], expected[-1].max(), atol=TOLERANCE)


def test_n_choices_are_independent_draws_or_one_greedy_answer(url):
  ask = lambda **options: client(url).completions.create(model=MODEL, prompt=PROMPTS[4],
                                                         max_tokens=10, **options).choices
  sampled = ask(temperature=1.5, n=3, seed=5)
  assert [c.index for c in sampled] == [0, 1, 2]
  assert len({tuple(c.token_ids) for c in sampled}) == 3
  assert sampled[0].token_ids == ask(temperature=1.5, seed=5)[0].token_ids
  greedy = ask(temperature=0, n=3)
  assert len({c.text for c in greedy}) == 1 and [c.index for c in greedy] == [0, 1, 2]


def test_chat_logprobs_and_n(url, tokenizer):
  chat_tokenizer = load_tokenizer(embedded.default_target())
  chat_tokenizer.chat_template = TEMPLATE
  messages = [{"role": "user", "content": "def add(a, b):"}]
  answer = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                               temperature=0, n=2, logprobs=True,
                                               top_logprobs=2)
  plain = client(url).completions.create(
      model=MODEL, prompt=encode_chat(chat_tokenizer, messages), max_tokens=8, temperature=0,
      logprobs=2).choices[0]
  assert [c.index for c in answer.choices] == [0, 1]
  for choice in answer.choices:
    content = choice.logprobs.content
    assert choice.message.content == plain.text
    assert [t.token for t in content] == plain.logprobs.tokens
    assert [t.logprob for t in content] == plain.logprobs.token_logprobs
    assert all(t.bytes == list(t.token.encode()) and len(t.top_logprobs) == 2 for t in content)
    assert [[a.logprob for a in t.top_logprobs] for t in content] == [
        list(top.values())[:2] for top in plain.logprobs.top_logprobs]
  chunks = list(client(url).chat.completions.create(
      model=MODEL, messages=messages, max_tokens=8, temperature=0, n=2, logprobs=True,
      stream=True))
  for index in (0, 1):
    mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
    assert mine[0].delta.role == "assistant"
    assert "".join(c.delta.content or "" for c in mine) == plain.text
    assert [t.logprob for c in mine if c.logprobs for t in c.logprobs.content] == (
        plain.logprobs.token_logprobs)


def test_a_batch_of_prompts_gives_their_choices_in_order(url, tokenizer):
  texts = PROMPTS[5:7]
  ids = [tokenizer.encode(p, add_special_tokens=False) for p in texts]
  ask = lambda prompt, **options: client(url).completions.create(
      model=MODEL, prompt=prompt, max_tokens=8, **options).choices
  alone = [ask(p, temperature=0)[0] for p in texts]
  for prompt in (texts, ids):
    assert [(c.index, c.text, c.token_ids) for c in ask(prompt, temperature=0)] == [
        (i, c.text, c.token_ids) for i, c in enumerate(alone)]
  # With n, prompt i's choice j is at index i * n + j; each prompt's first is the request's.
  batch = ask(ids, temperature=1.0, n=2, seed=3)
  assert [c.index for c in batch] == [0, 1, 2, 3]
  assert [batch[0].token_ids, batch[2].token_ids] == [
      ask(p, temperature=1.0, seed=3)[0].token_ids for p in ids]


def test_best_of_keeps_the_choices_of_highest_mean_logprob(url):
  ask = lambda **options: client(url).completions.create(
      model=MODEL, prompt=PROMPTS[4], max_tokens=8, temperature=1.5, seed=9, **options)
  every = ask(n=4, logprobs=0)  # the same four draws best_of=4 ranks
  mean = [np.mean(c.logprobs.token_logprobs) for c in every.choices]
  best = ask(n=2, best_of=4)
  assert [c.token_ids for c in best.choices] == [
      every.choices[k].token_ids for k in np.argsort(mean)[::-1][:2]]
  assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
  assert best.usage.completion_tokens == every.usage.completion_tokens  # all four made
