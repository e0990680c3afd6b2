"""Regeneration through OpenAI-compatible servers: through ours (`jetflow_jax.serve`) the store
is the engine's, requests spread over the servers and a dead one's are retried on the next;
a server that answers 503 and 429 is retried, and one that returns text only gets it tokenized
and its records marked."""

import http.server
import json
import threading

import numpy as np
import pytest

from jetflow_jax.decoding import generate
from jetflow_jax.engine import make_engine
from jetflow_jax.errors import InputError
from jetflow_jax.serve import create_app
from jetflow_jax.text import bundled_qwen3_tokenizer_dir, detokenizer, load_tokenizer
from jetflow_jax.train.regenerate import TOKEN_SOURCES, regenerate
from jetflow_jax.train.regenerate_openai import openai_generator
from jetflow_jax.train.store import TokenStore
from multiprocess import free_port
from test_serve import serve_in_thread
from test_speculative import target  # noqa: F401 (fixture)

LENGTHS = [3, 5, 17, 9, 11, 13, 15, 7]
MAX_TOKENS = [24, 6, 16, 3, 20, 10, 1, 12]


@pytest.fixture(scope="module")
def tokenizer():
  return load_tokenizer(bundled_qwen3_tokenizer_dir())  # ids below 96: one byte each


@pytest.fixture(scope="module")
def ours(target, tokenizer):
  """Our server over the tiny target (AR, 4 slots)."""
  config, params = target
  engine = make_engine(params, config, method="ar", num_slots=4, max_context=64,
                       rounds_per_step=2)
  url, server, thread = serve_in_thread(create_app(engine, tokenizer, "tiny", warm_up=False))
  yield url
  server.should_exit = True
  thread.join(30)


def test_our_server_regenerates_what_the_engine_does(target, tokenizer, ours, tmp_path):
  config, params = target
  rng = np.random.default_rng(4)
  prompts = [rng.integers(0, 95, n).tolist() for n in LENGTHS]
  greedy = generate(params, config, prompts, max(MAX_TOKENS)).tokens
  decode = detokenizer(tokenizer)
  stops = {2: decode(greedy[2][3:5]), 4: decode(greedy[4][6:8])[1:]}
  assert "\ufffd" not in "".join(stops.values())  # whole characters: ids 94 and 95 are not
  records = [dict(id=f"r{i}", prompt_ids=p, max_tokens=m, **({"stop": stops[i]} if i in stops
                                                              else {}))
             for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS))]
  dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: every request there is retried
  assert regenerate(records, str(tmp_path), lambda: openai_generator(
      [dead, ours], model="tiny", concurrency=3, load_tokenizer=pytest.fail, decode=decode,
      backoff_s=0.01), max_new_tokens=max(MAX_TOKENS), max_prompt_len=64) == len(records)

  def kept(tokens, record):  # through the first token whose text holds the stop string
    ends = [n for n in range(1, len(tokens) + 1) if record.get("stop", "\0") in decode(tokens[:n])]
    return tokens[:min(ends, default=len(tokens))]

  store = TokenStore(str(tmp_path))
  assert [store.tokens(i).tolist() for i in range(len(records))] == [
      r["prompt_ids"] + kept(g[:r["max_tokens"]], r) for g, r in zip(greedy, records)]
  assert all(store.lengths[i] < LENGTHS[i] + MAX_TOKENS[i] for i in stops)
  assert not (tmp_path / "shard-00000-of-00001" / TOKEN_SOURCES).exists()


class TextOnly(http.server.BaseHTTPRequestHandler):
  """Answers each prompt 503, then 429, then a completion of text without token ids; and
  400 to a prompt of one token."""

  seen: list = []

  def do_POST(self):
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    self.seen.append(body)
    tries = sum(b["prompt"] == body["prompt"] for b in self.seen)
    status = 400 if len(body["prompt"]) == 1 else {1: 503, 2: 429}.get(tries, 200)
    answer = {"id": "c", "object": "text_completion", "created": 0, "model": body["model"],
              "choices": [{"index": 0, "text": "x = 1", "finish_reason": "length",
                           "logprobs": None}]}
    data = json.dumps(answer if status == 200 else {"error": {"message": "busy"}}).encode()
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  def log_message(self, *args):
    pass


def test_busy_and_text_only_servers(tokenizer, tmp_path):
  stub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), TextOnly)
  threading.Thread(target=stub.serve_forever, daemon=True).start()
  url = f"http://127.0.0.1:{stub.server_address[1]}"
  records = [dict(id=f"t{i}", prompt_ids=[5, 6, i], max_tokens=4 + i) for i in range(3)]
  generator = lambda: openai_generator([url], model="m", concurrency=2, temperature=0.7,
                                       load_tokenizer=lambda: tokenizer, backoff_s=0.001)
  try:
    assert regenerate(records, str(tmp_path), generator, max_new_tokens=8,
                      max_prompt_len=64) == 3
    with pytest.raises(InputError, match="record bad: the server refused the request"):
      regenerate([{"id": "bad", "prompt_ids": [1]}], str(tmp_path / "bad"), generator,
                 max_new_tokens=8, max_prompt_len=64)
  finally:
    stub.shutdown()
  store = TokenStore(str(tmp_path))
  assert [store.tokens(i).tolist() for i in range(3)] == [
      r["prompt_ids"] + tokenizer.encode("x = 1") for r in records]
  marks = (tmp_path / "shard-00000-of-00001" / TOKEN_SOURCES).read_text().splitlines()
  assert sorted(json.loads(m)["id"] for m in marks) == ["t0", "t1", "t2"]
  first = {tuple(b["prompt"]): b for b in reversed(TextOnly.seen)}
  assert [(b["max_tokens"], b["seed"], b["temperature"], b["return_token_ids"])
          for b in map(first.get, [(5, 6, 0), (5, 6, 1), (5, 6, 2)])] == [
              (4, 0, 0.7, True), (5, 1, 0.7, True), (6, 2, 0.7, True)]
  assert len(TextOnly.seen) == 3 * 3 + 1  # each record's 503, 429 and answer; the refused one
