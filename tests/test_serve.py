"""The OpenAI-compatible server, through the `openai` client, on the embedded pair.

Every answer is the engine's for that prompt alone (greedy token for token, whatever shares the
slots; sampled reproducible from its seed), streamed text only ever extends a prefix of it, stop
strings cut it, bad requests get OpenAI-shaped errors and the server goes on, a client that
leaves frees its slot, SIGTERM drains and exits with 0, and once warm no request compiles. One
server runs as a subprocess (JetFlow, as `python -m jetflow_jax.serve` starts it, warming up);
the other methods and a tokenizer with a chat template run in-process, compiling on demand.
test_serve_api.py covers log-probabilities, echo, n, batches and best_of.
"""

import concurrent.futures
import functools
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import jax.numpy as jnp
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st
from prometheus_client.parser import text_string_to_metric_families

from conftest import CLI_ENV, ROOT
from jetflow_jax import embedded
from jetflow_jax.checkpoint import load_qwen3
from jetflow_jax.engine import Orchestrator, Request, make_engine
from jetflow_jax.head_checkpoint import load_head
from jetflow_jax.serve import Server, create_app
from jetflow_jax.serve.__main__ import main as serve_main
from jetflow_jax.serve.guard import KEY_ENVS
from jetflow_jax.serve.textstream import TextStream
from jetflow_jax.text import detokenizer, encode_chat, load_tokenizer, stop_end
from multiprocess import free_port

MODEL = "jetflow-embedded"  # the served name, in-process too
SLOTS = 4
CONTEXT = 128
MAX_TOKENS = 24
ENGINE = dict(budget=16, top_k=4, num_slots=SLOTS, max_context=CONTEXT, rounds_per_step=2)
FLAGS = ["--slots", str(SLOTS), "--max-context", str(CONTEXT), "--budget", "16", "--top-k", "4",
         "--rounds-per-step", "2"]
PROMPTS = ["def fibonacci(n):", "import os\n\ndef list_files(path):",
           "class Stack:\n    def __init__(self):", "def quicksort(items):\n    \"\"\"Sort",
           "# Read a CSV file and", "def is_prime(n: int) -> bool:", "for i in range(10):\n",
           "def merge(a, b):\n    result = []", "def parse_args(argv):",
           "import json\n\n\ndef load(path):", "class Point:\n", "def main():\n    args ="]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def get(url: str) -> tuple[int, str]:
  try:
    with urllib.request.urlopen(url, timeout=30) as response:
      return response.status, response.read().decode()
  except urllib.error.HTTPError as e:
    return e.code, e.read().decode()


def post(url: str, body: bytes, timeout: float = 60) -> tuple[int, dict]:
  request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(request, timeout=timeout) as response:
      return response.status, json.loads(response.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def metrics(url: str) -> dict:
  """Every sample of /metrics by name and labels."""
  status, text = get(f"{url}/metrics")
  assert status == 200
  return {(s.name, tuple(sorted(s.labels.items()))): s.value
          for family in text_string_to_metric_families(text) for s in family.samples}


def settle(url: str) -> dict:
  """/metrics once no slot is busy and nothing waits (a few seconds at most)."""
  deadline = time.monotonic() + 20
  while True:
    m = metrics(url)
    if m[("jetflow_active_slots", ())] == m[("jetflow_queue_depth", ())] == 0:
      return m
    assert time.monotonic() < deadline, "slots still busy"
    time.sleep(0.1)


def without_keys(env: dict) -> dict:
  """`env` without the API keys a server would take from it (an operator's shell may set one)."""
  return {k: v for k, v in env.items() if k not in KEY_ENVS}


class Subprocess:
  """`python -m jetflow_jax.serve` on a free port; `url` waits until it answers (`warming`: the
  bodies of the 503s /health gave meanwhile)."""

  def __init__(self, log_path, flags=FLAGS, **env):
    self.port = free_port()
    self.log_path = log_path
    self.warming: list[dict] = []
    with open(log_path, "w") as log:
      self.process = subprocess.Popen(
          [sys.executable, "-m", "jetflow_jax.serve", *flags, "--port", str(self.port)],
          cwd=ROOT, env={**without_keys(CLI_ENV), **env}, stdout=log,
          stderr=subprocess.STDOUT)

  def stop(self) -> None:
    if self.process.poll() is None:
      self.process.kill()
      self.process.wait()

  @functools.cached_property
  def url(self) -> str:
    url, deadline = f"http://127.0.0.1:{self.port}", time.monotonic() + 300
    while True:
      assert self.process.poll() is None, open(self.log_path).read()
      try:
        status, body = get(f"{url}/health")
        if status == 200:
          return url
        self.warming.append(json.loads(body))
      except OSError:
        pass
      assert time.monotonic() < deadline, ("the server did not come up:\n"
                                           + open(self.log_path).read()[-3000:])
      time.sleep(0.2)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  """The JetFlow server as a subprocess, started first so it compiles while this process works."""
  served = Subprocess(tmp_path_factory.mktemp("serve") / "server.log")
  yield served
  served.stop()


def client(url: str) -> openai.OpenAI:
  return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
  return load_tokenizer(embedded.default_target())


@pytest.fixture(scope="module")
def engine_for():
  config, params = load_qwen3(embedded.default_target(), jnp.float32)  # as the CLI on CPU

  @functools.cache
  def build(method):
    kind = {"ar": None, "dflash": "dflash", "ddtree": "dflash", "jetflow": "jetflow"}[method]
    head, head_params = (load_head(embedded.default_head(kind), jnp.float32) if kind
                         else (None, None))
    return make_engine(params, config, head_params, head, method=method, **ENGINE)

  return build


@pytest.fixture(scope="module")
def solo(tokenizer, engine_for):
  """Each prompt's greedy tokens from the engine, one request at a time."""
  orchestrator = Orchestrator(engine_for("ar"))
  return {p: orchestrator.generate([Request(tokenizer.encode(p, add_special_tokens=False),
                                            MAX_TOKENS)])[0].tokens for p in PROMPTS}


@pytest.fixture(scope="module")
def local(engine_for):
  """In-process servers by method; the AR one's tokenizer has a chat template."""
  running = []

  @functools.cache
  def start(method):
    tokenizer = load_tokenizer(embedded.default_target())
    tokenizer.chat_template = TEMPLATE if method == "ar" else None
    app = create_app(engine_for(method), tokenizer, MODEL, warm_up=False)
    url, uvicorn_server, thread = serve_in_thread(app)
    running.append((uvicorn_server, thread))
    return url, app

  yield start
  for uvicorn_server, thread in running:
    uvicorn_server.should_exit = True
    thread.join(30)


def serve_in_thread(app, timeout: float = 300) -> tuple[str, Server, threading.Thread]:
  """`app` served on a free port by a daemon thread, once it answers (set `should_exit` to
  stop it); fails if the server dies or is not up within `timeout` seconds."""
  uvicorn_server = Server(app, "127.0.0.1", free_port())
  thread = threading.Thread(target=uvicorn_server.run, daemon=True)
  thread.start()
  deadline = time.monotonic() + timeout
  while not uvicorn_server.started:
    assert thread.is_alive(), "the server stopped before it started"
    assert time.monotonic() < deadline, "the server did not come up"
    time.sleep(0.05)
  return f"http://127.0.0.1:{uvicorn_server.config.port}", uvicorn_server, thread


def test_a_completion_is_the_engines_output_for_the_prompt_alone(server, solo, tokenizer):
  assert get(f"{server.url}/health")[0] == 200
  assert [m.id for m in client(server.url).models.list().data] == [MODEL]
  for prompt in PROMPTS[:2]:
    answer = client(server.url).completions.create(model=MODEL, prompt=prompt,
                                                   max_tokens=MAX_TOKENS, temperature=0)
    choice = answer.choices[0]
    assert choice.token_ids == solo[prompt]
    assert choice.text == tokenizer.decode(solo[prompt], skip_special_tokens=True)
    assert choice.finish_reason == "length"
    prompt_tokens = len(tokenizer.encode(prompt, add_special_tokens=False))
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens,
            answer.usage.total_tokens) == (prompt_tokens, MAX_TOKENS, prompt_tokens + MAX_TOKENS)


def test_health_says_warming_up_until_every_variant_has_compiled(server):
  url = server.url  # waits for /health's 200
  assert server.warming, "no 503 while warming up"
  for body in server.warming:
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"].startswith("warming up: ")
  log = open(server.log_path).read()
  assert re.search(r"warming up \d+/\d+: prompts of 65-127 tokens with their log-probabilities",
                   log) and "warm: " in log
  assert get(f"{url}/health") == (200, '{"status":"ok"}')


KINDS = [  # one of each kind of request, over every prompt bucket of the server's context
    {"prompt": PROMPTS[0], "temperature": 0},
    {"prompt": PROMPTS[0], "temperature": 0.8, "seed": 1},
    {"prompt": PROMPTS[0], "temperature": 0.8, "top_p": 0.9},
    {"prompt": PROMPTS[0], "temperature": 0, "logprobs": 2},
    {"prompt": PROMPTS[0], "temperature": 0.8, "top_p": 0.9, "logprobs": 0},
    {"prompt": PROMPTS[0], "echo": True, "max_tokens": 0, "logprobs": 1},
    {"prompt": list(range(1, 40)), "echo": True, "temperature": 0},
    {"prompt": [list(range(1, 20)), list(range(1, 100))], "echo": True, "logprobs": 1,
     "temperature": 0, "max_tokens": 1},
    {"prompt": PROMPTS[1], "n": 2, "temperature": 0.7, "stream": True},
    {"prompt": PROMPTS[1], "best_of": 2, "temperature": 0.7},
]


def test_once_warm_no_request_compiles(server):
  url = server.url
  compiles = lambda: metrics(url)[("jetflow_compiles_total", ())]
  before = compiles()


  def ask(body: dict) -> int:  # streamed or not; a status other than 200 raises
    request = urllib.request.Request(f"{url}/v1/completions",
                                     json.dumps({"max_tokens": 4, **body}).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
      response.read()
      return response.status

  assert [ask(body) for body in KINDS] == [200] * len(KINDS)
  with concurrent.futures.ThreadPoolExecutor(len(KINDS)) as pool:  # together in one batch
    assert list(pool.map(ask, KINDS)) == [200] * len(KINDS)
  assert compiles() == before


def test_concurrent_requests_each_equal_their_output_alone(server, solo):
  ask = lambda prompt: client(server.url).completions.create(
      model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
  with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
    answers = list(pool.map(ask, PROMPTS))  # 12 requests over 4 slots
  assert [a.choices[0].token_ids for a in answers] == [solo[p] for p in PROMPTS]


def streamed(url: str, prompt: str, **options) -> tuple[list[str], str]:
  """The pieces of a streamed completion, and its finish reason."""
  pieces, reasons = [], []
  for chunk in client(url).completions.create(model=MODEL, prompt=prompt, stream=True,
                                              **options):
    pieces.append(chunk.choices[0].text)
    reasons.append(chunk.choices[0].finish_reason)
  assert all(r is None for r in reasons[:-1])
  return pieces, reasons[-1]


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree", "jetflow"])
def test_streamed_text_is_always_a_prefix_of_the_answer(server, local, solo, tokenizer,
                                                        method):
  url = server.url if method == "jetflow" else local(method)[0]
  prompt = PROMPTS[2]
  answer = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                          temperature=0).choices[0].text
  pieces, reason = streamed(url, prompt, max_tokens=MAX_TOKENS, temperature=0)
  so_far = ["".join(pieces[:i + 1]) for i in range(len(pieces))]
  assert all(answer.startswith(s) for s in so_far) and so_far[-1] == answer
  assert answer == tokenizer.decode(solo[prompt], skip_special_tokens=True)
  assert reason == "length" and len([p for p in pieces if p]) > 2


def test_text_stops_before_a_stop_string(server, solo, tokenizer):
  prompt = PROMPTS[1]
  full = tokenizer.decode(solo[prompt], skip_special_tokens=True)
  stop = full[10:16]  # early in the answer
  before = metrics(server.url)[("jetflow_completion_tokens_total", ())]
  expected = full[:full.index(stop)]
  answer = client(server.url).completions.create(
      model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
      stop=["never in the text", stop]).choices[0]
  assert (answer.text, answer.finish_reason) == (expected, "stop")
  # Its ids and usage run through the token that completes the stop string, not past it.
  used = solo[prompt][:stop_end(solo[prompt], [stop], detokenizer(tokenizer))]
  assert answer.token_ids == used and answer.token_ids != solo[prompt]
  pieces, reason = streamed(server.url, prompt, max_tokens=MAX_TOKENS, temperature=0, stop=stop)
  assert ("".join(pieces), reason) == (expected, "stop")
  # Both requests were cancelled at their stop string, well before max_tokens.
  assert settle(server.url)[("jetflow_completion_tokens_total", ())] - before < 2 * MAX_TOKENS


def test_text_stream_holds_back_half_characters_and_stop_string_starts(tokenizer):
  decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
  ids = tokenizer.encode("中文 é ok", add_special_tokens=False)
  text = TextStream(decode)
  pieces = [text.push([i]) for i in ids] + [text.push([], final=True)]
  assert "".join(pieces) == "中文 é ok" and all("\ufffd" not in p for p in pieces)
  assert pieces[:3] == ["", "", "中"]  # its three bytes are three tokens

  chars = lambda ids: "".join(map(chr, ids))
  push = lambda text, s: text.push(list(map(ord, s)))
  text = TextStream(chars, stop=["xyz", "bc"])
  assert [push(text, s) for s in ["ab", "x", "y", "zq"]] == ["a", "b", "", ""]
  assert text.stopped and text.text == "ab"
  text = TextStream(chars, stop=["bc"])
  assert [push(text, "ab"), push(text, "cd"), text.stopped, text.text] == ["a", "", True, "a"]
  text = TextStream(chars, stop=["xyz"])  # the end releases what a stop string never took
  assert [push(text, "ax"), text.push([], final=True), text.stopped] == ["a", "x", False]

# Under the body limit (1 MiB) and over what a slot could hold (128 tokens of <= 64 characters):
# refused on its first 8,192 characters' tokens.
BIG = "def f(x):\n    return x\n" * 30_000  # 720 KB


@pytest.mark.parametrize("path,body,status,message,param", [
    ("completions", {"max_tokens": 4}, 400, "prompt: Field required", "prompt"),
    ("chat/completions", {"max_tokens": 4}, 400, "messages: Field required", "messages"),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "0 is only allowed with echo",
     "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens", "max_tokens"),
    ("completions", {"prompt": list(range(100)), "max_tokens": 64}, 400,
     "a prompt of 100 tokens plus max_tokens 64 exceeds the engine's context of 128", None),
    ("completions", {"prompt": BIG}, 400, r"prompt: a prompt of more than \d{4} tokens \(its "
     r"first 8192 characters\) exceeds the engine's context of 128", "prompt"),
    ("completions", {"prompt": BIG[:2000]}, 400,
     r"a prompt of \d{3} tokens plus max_tokens 16 exceeds the engine's context of 128", None),
    ("completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature", "temperature"),
    ("completions", {"prompt": "x", "temperature": 2.5}, 400, "less than or equal to 2",
     "temperature"),
    ("completions", b'{"prompt": "x", "temperature": Infinity}', 400, "finite number",
     "temperature"),
    ("completions", {"prompt": "x", "top_p": -0.1}, 400, "greater than or equal to 0", "top_p"),
    ("completions", {"prompt": "x", "top_p": 1.5}, 400, "less than or equal to 1", "top_p"),
    ("completions", {"prompt": "x", "max_tokens": True}, 400, "valid integer", "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 4.0}, 400, "valid integer", "max_tokens"),
    ("completions", {"prompt": "x", "stream": "yes"}, 400, "valid boolean", "stream"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "only allowed when stream is true", "stream_options"),
    ("completions", {"prompt": [1, True]}, 400, "a string or a list of token ids", "prompt"),
    ("completions", {"prompt": [["a"]]}, 400, "or a list of those", "prompt"),
    ("completions", {"prompt": "x", "n": 0}, 400, "greater than or equal to 1", "n"),
    ("completions", {"prompt": "x", "n": 129}, 400, "less than or equal to 128", "n"),
    ("completions", {"prompt": "x", "logprobs": 6}, 400, "less than or equal to 5", "logprobs"),
    ("completions", {"prompt": "x", "logprobs": True}, 400, "valid integer", "logprobs"),
    ("completions", {"prompt": "x", "echo": 1}, 400, "valid boolean", "echo"),
    ("completions", {"prompt": "x", "n": 2, "best_of": 1}, 400, "best_of: must be >= n",
     "best_of"),
    ("completions", {"prompt": "x", "best_of": 2, "stream": True}, 400,
     "best_of: cannot be streamed", "best_of"),
    ("completions", {"prompt": "x", "suffix": "y"}, 400, "suffix: not supported", "suffix"),
    ("completions", {"prompt": "x", "logit_bias": {"1": 5}}, 400, "not supported", "logit_bias"),
    ("completions", {"prompt": "x", "frequency_penalty": 0.5}, 400, "not supported",
     "frequency_penalty"),
    ("completions", {"prompt": "x", "response_format": {"type": "json_object"}}, 400,
     "response_format: not supported by this server", "response_format"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": []}, 400,
     "tools: not supported by this server", "tools"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     400, "top_logprobs: only allowed when logprobs is true", "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                          "top_logprobs": 21}, 400, "less than or equal to 20", "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, 400,
     "lone surrogate U\\+D800", "messages.0.content"),
    ("chat/completions", {"messages": [{"role": "user", "content": None}]}, 400,
     "a string or a list of text parts", "messages.0.content"),
    ("completions", {"prompt": "x", "stop": ["", "a"]}, 400, "must not be empty", "stop"),
    ("completions", {"prompt": "x", "stop": ["\udfff"]}, 400, "lone surrogate", "stop"),
    ("completions", {"prompt": "x", "seed": -1}, 400, "seed must lie in", None),
    ("completions", {"prompt": [1, 9000]}, 400, r"\[0, 8192\)", None),
    ("completions", b'{"prompt": "x",', 400, "malformed JSON", None),
    ("completions", {"prompt": "x", "model": "gpt-4"}, 404, "'gpt-4' does not exist", "model"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400,
     "has no chat template", "messages"),
])
def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, path, body, status,
                                                                message, param):
  raw = body if isinstance(body, bytes) else json.dumps(body).encode()
  got, answer = post(f"{server.url}/v1/{path}", raw)
  assert got == status
  error = answer["error"]
  assert set(error) == {"message", "type", "param", "code"}
  assert error["type"] == "invalid_request_error" and error["param"] == param
  assert re.search(message, error["message"]), error["message"]
  assert client(server.url).completions.create(model=MODEL, prompt="x", max_tokens=1,
                                               temperature=0).choices[0].text is not None


def test_a_prompt_the_tokenizer_cannot_encode_is_a_400(server):
  """The issue's reproducer, as raw bytes: a lone UTF-16 surrogate is valid JSON."""
  status, answer = post(f"{server.url}/v1/completions",
                        b'{"prompt": "def f():\\ud800", "max_tokens": 4}')
  assert status == 400 and answer["error"]["param"] == "prompt"
  assert "lone surrogate U+D800 at character 8" in answer["error"]["message"]
  assert "Traceback" not in open(server.log_path).read()


def json_values():
  """JSON of every shape: any code point in strings (lone surrogates, NULs), any number."""
  text = st.text(st.characters(exclude_categories=(), include_characters="\x00\ud800\udfff"),
                 max_size=8)
  scalars = (st.none() | st.booleans() | st.integers() | st.floats() | text
             | st.sampled_from([0, 1, -1, 2**31, 2**32, 2**63, 10**30, 1e308, -0.0]))
  return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(text, inner, max_size=3), max_leaves=6)


def near(*bounds):
  """Numbers at, just inside and just past `bounds`, as ints, floats and impostors."""
  values = [v for b in bounds for v in (b, float(b), b + 1e-9, b - 1e-9)]
  return st.sampled_from(values + [True, False, None, "1", float("inf"), float("nan")])


def request_bodies(chat: bool):
  """Bodies of one route: valid ones, ones with values in, at and past every bound, any JSON."""
  text = st.text(st.characters(exclude_categories=(), include_characters="\x00\ud800"),
                 max_size=10)
  valid_text = st.text(st.characters(exclude_categories=("Cs",), include_characters="\x00"),
                       max_size=10)
  any_json = json_values()
  # Few tokens, so that each 200 is quick; chat's default is the whole slot: always set.
  valid_max_tokens = st.integers(1, 3)
  max_tokens = valid_max_tokens | st.sampled_from([0, -1, True, 2.0, "2", 2**31, 10**30])
  valid = {
      "temperature": st.sampled_from([0, 0.0, 0.5, 1, 2, None]),
      "top_p": st.sampled_from([0, 0.5, 1, None]),
      "seed": st.sampled_from([None, 0, 2**32 - 1]),
      "stop": valid_text.filter(bool) | st.lists(valid_text.filter(bool), max_size=2),
      "stream": st.booleans(), "n": st.sampled_from([1, None]), "model": st.just(MODEL),
  }
  edgy = {
      "model": st.sampled_from([MODEL, "gpt-4", "", None]) | text,
      "temperature": near(0, 2) | st.floats(-1, 3) | st.sampled_from([1e-30, 5e-324]),
      "top_p": near(0, 1) | st.floats(-1, 2) | st.sampled_from([1e-300]),
      "seed": near(0, 2**32) | st.integers(),
      "stop": text | st.lists(text, max_size=3) | st.sampled_from([None, [], [""], 5]),
      "stream": st.sampled_from([True, False, None, "yes", 1]),
      "stream_options": st.sampled_from([None, {"include_usage": True},
                                         {"include_usage": "no"}, {"x": 1}]),
      "n": st.sampled_from([1, 2, 0, None, True]),
      "user": text, "frequency_penalty": near(0), "logit_bias": any_json,
  }
  if chat:
    def messages(text, content):
      message = st.fixed_dictionaries(
          {"role": st.sampled_from(["user", "system", "assistant"]) | text,
           "content": text | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                             "text": text}), max_size=2)
                      | content})
      return st.lists(message, min_size=1, max_size=3)

    valid_required = {"messages": messages(valid_text, st.nothing()),
                      "max_tokens": valid_max_tokens}
    required = {"messages": messages(text, any_json) | any_json, "max_tokens": max_tokens}
    edgy.update(max_completion_tokens=max_tokens, logprobs=st.sampled_from([None, False, True]),
                top_logprobs=near(0, 20), tools=any_json)
  else:
    valid_required = {"prompt": valid_text | st.lists(st.integers(0, 8191), min_size=1,
                                                      max_size=6)}
    required = {"prompt": text | st.lists(st.integers(-2, 8200), max_size=6)
                | st.lists(text, max_size=2) | any_json}
    valid.update(max_tokens=valid_max_tokens, echo=st.just(False), logprobs=st.none())
    edgy.update(max_tokens=max_tokens, echo=st.sampled_from([False, True, None]),
                logprobs=near(0, 5), best_of=st.sampled_from([1, 2, None]), suffix=any_json)
  body = st.fixed_dictionaries(required, optional=edgy)
  extra = st.dictionaries(text, any_json, max_size=2)
  return st.one_of(st.fixed_dictionaries(valid_required, optional=valid), body,
                   st.builds(lambda b, e: {**e, **b}, body, extra), any_json)


def sse_events(raw: str) -> list:
  assert raw.endswith("data: [DONE]\n\n"), raw[-300:]
  events = raw.split("\n\n")[:-2]
  assert all(e.startswith("data: ") for e in events), raw[:300]
  return [json.loads(e[len("data: "):]) for e in events]


@settings(max_examples=100, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_any_request_body_gets_a_200_400_or_404_in_openai_shape(local, data):
  url, _ = local("ar")
  chat = data.draw(st.booleans(), label="chat")
  body = data.draw(request_bodies(chat), label="body")
  raw = json.dumps(body).encode()  # ASCII: lone surrogates travel as \ud800 escapes
  request = urllib.request.Request(f"{url}/v1/{'chat/' if chat else ''}completions", raw,
                                   {"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(request, timeout=120) as response:
      status, text = response.status, response.read().decode()
  except urllib.error.HTTPError as e:
    status, text = e.code, e.read().decode()
  assert status in (200, 400, 404), text
  event(f"{'chat' if chat else 'completions'}: {status}")  # --hypothesis-show-statistics
  if status != 200:
    assert set(json.loads(text)) == {"error"}
    assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}
  elif text.startswith("data: "):
    for chunk in sse_events(text):
      assert set(chunk) & {"choices", "error"}, chunk
  else:
    answer = json.loads(text)
    assert answer["object"] == ("chat.completion" if chat else "text_completion")
    prompt, n = body.get("prompt"), body.get("n") or 1
    batch = isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt)
    prompts = len(prompt) if batch else 1
    assert [c["index"] for c in answer["choices"]] == list(range(prompts * n))
    generated = prompts * max(n, body.get("best_of") or 1)
    assert answer["usage"]["completion_tokens"] <= 16 * generated
  assert get(f"{url}/health")[0] == 200


def test_after_any_request_body_the_server_answers(local):
  """Runs after the property test: both routes still answer a normal request."""
  url, _ = local("ar")
  assert client(url).completions.create(model=MODEL, prompt="x", max_tokens=2,
                                        temperature=0).choices[0].text is not None
  assert client(url).chat.completions.create(
      model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
      temperature=0).choices[0].message.content is not None


def test_metrics_count_requests_tokens_and_tau(server, tokenizer):
  before = metrics(server.url)
  for _ in range(2):
    client(server.url).completions.create(model=MODEL, prompt=PROMPTS[0],
                                          max_tokens=MAX_TOKENS, temperature=0)
  post(f"{server.url}/v1/completions", b"{}")
  after = settle(server.url)
  grew = lambda name, *labels: after[(name, labels)] - before.get((name, labels), 0.0)
  assert grew("jetflow_requests_total", ("endpoint", "/v1/completions"), ("status", "200")) == 2
  assert grew("jetflow_requests_total", ("endpoint", "/v1/completions"), ("status", "400")) == 1
  assert grew("jetflow_completion_tokens_total") == 2 * MAX_TOKENS
  assert grew("jetflow_prompt_tokens_total") == 2 * len(tokenizer.encode(PROMPTS[0], add_special_tokens=False))
  assert grew("jetflow_step_seconds_count") > 0 and after[("jetflow_tau", ())] > 1.2


def test_auto_budgets_compile_nothing_once_warm_and_show_in_the_metrics(engine_for, solo,
                                                                       tokenizer):
  """An engine choosing each step's budget (AR, 4, 8): warm-up compiles every budget's step, the
  answers are AR's, and /metrics holds the budgets chosen."""
  config, params = load_qwen3(embedded.default_target(), jnp.float32)
  head, head_params = load_head(embedded.default_head("jetflow"), jnp.float32)
  engine = make_engine(params, config, head_params, head, method="jetflow",
                       **dict(ENGINE, budget="auto", max_budget=8))
  url, uvicorn_server, thread = serve_in_thread(create_app(engine, tokenizer, MODEL,
                                                           warm_up=True))
  try:
    deadline = time.monotonic() + 600
    while get(f"{url}/health")[0] != 200:
      assert time.monotonic() < deadline, "not warm within 600 s"
      time.sleep(0.2)
    before = metrics(url)[("jetflow_compiles_total", ())]
    texts = client(url).completions.create(model=MODEL, prompt=PROMPTS[:SLOTS],
                                           max_tokens=MAX_TOKENS, temperature=0)
    for body in KINDS[1:6]:
      assert post(f"{url}/v1/completions", json.dumps({"max_tokens": 4, **body}).encode())[0] == 200
    after = settle(url)
    assert after[("jetflow_compiles_total", ())] == before
    assert [c.token_ids for c in sorted(texts.choices, key=lambda c: c.index)] == [
        solo[p] for p in PROMPTS[:SLOTS]]
    chosen = {dict(labels)["le"]: count for (name, labels), count in after.items()
              if name == "jetflow_step_budget_bucket"}
    assert after[("jetflow_step_budget_count", ())] > 0 and chosen["+Inf"] == chosen["8.0"]
  finally:
    uvicorn_server.should_exit = True
    thread.join(30)


def test_a_client_that_goes_away_frees_its_slot(server):
  before = metrics(server.url)[("jetflow_completion_tokens_total", ())]
  stream = client(server.url).completions.create(model=MODEL, prompt="x",
                                                 max_tokens=CONTEXT - 1, temperature=0,
                                                 stream=True)
  next(iter(stream))
  stream.close()
  with pytest.raises(OSError):  # a non-streamed request whose client gives up
    post(f"{server.url}/v1/completions",
         json.dumps({"prompt": "x", "max_tokens": CONTEXT - 1, "temperature": 0}).encode(),
         timeout=0.5)
  after = settle(server.url)
  # Cancelled early: far fewer tokens than asked for.
  assert after[("jetflow_completion_tokens_total", ())] - before < CONTEXT - 1
  assert after[("jetflow_requests_total", (("endpoint", "/v1/completions"),
                                           ("status", "499")))] >= 1
  assert client(server.url).completions.create(model=MODEL, prompt="x", max_tokens=2,
                                               temperature=0).choices[0].text is not None


def test_chat_uses_the_tokenizers_chat_template(local):
  url, _ = local("ar")
  tokenizer = load_tokenizer(embedded.default_target())
  tokenizer.chat_template = TEMPLATE
  messages = [{"role": "system", "content": "You write Python."},
              {"role": "user", "content": "def add(a, b):"}]
  answer = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                               temperature=0)
  plain = client(url).completions.create(model=MODEL, prompt=encode_chat(tokenizer, messages),
                                         max_tokens=12, temperature=0).choices[0]
  assert answer.choices[0].message.content == plain.text
  assert answer.choices[0].token_ids == plain.token_ids and answer.object == "chat.completion"
  chunks = list(client(url).chat.completions.create(model=MODEL, messages=messages,
                                                    max_tokens=12, temperature=0, stream=True,
                                                    stream_options={"include_usage": True}))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.text
  assert chunks[-1].usage.completion_tokens == 12 and chunks[-2].choices[0].finish_reason == "length"


def test_sampled_requests_are_reproducible_from_their_seed(local, engine_for, tokenizer):
  url, _ = local("ar")
  ask = lambda seed: client(url).completions.create(
      model=MODEL, prompt=PROMPTS[3], max_tokens=12, temperature=0.9, top_p=0.9,
      seed=seed).choices[0].token_ids
  alone = ask(11)
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    in_company = list(pool.map(ask, [11, 12, 13, 11]))
  assert in_company[0] == in_company[3] == alone
  assert in_company[1] != alone or in_company[2] != alone
  engine_alone = Orchestrator(engine_for("ar")).generate([Request(
      tokenizer.encode(PROMPTS[3], add_special_tokens=False), 12, temperature=0.9, top_p=0.9,
      seed=11)])[0].tokens
  assert alone == engine_alone


def test_a_draining_server_refuses_new_requests(local):
  url, app = local("ar")
  app.state.service.draining = True
  try:
    status, answer = post(f"{url}/v1/completions", json.dumps({"prompt": "x"}).encode())
    assert status == 503 and "shutting down" in answer["error"]["message"]
    assert answer["error"]["type"] == "server_error" and get(f"{url}/health")[0] == 503
  finally:
    app.state.service.draining = False


@pytest.mark.parametrize("flags,message", [
    (["--slots", "0"], "error: --slots must be >= 1 (got 0)"),
    (["--max-context", "0"], "error: --max-context must be >= 2 (got 0)"),
    (["--port", "http"], "error: argument --port: invalid int value: 'http'"),
    (["--mesh", "zz=2"], "error: --mesh: unknown axis 'zz' in 'zz=2'; axes are data, tp, ep"),
    (["--mesh", "data=4", "--slots", "2"],
     "error: 2 slots do not split over the mesh's 4 data-parallel copies"),
    (["--api-key", ""], "error: --api-key must not be empty"),
    (["--served-model-name"], "error: argument --served-model-name: expected at least one "
     "argument"),
    (["--served-model-name", "a", ""], "error: --served-model-name must not be empty"),
    (["--max-request-bytes", "0"], "error: --max-request-bytes must be >= 1 (got 0)"),
    (["--request-timeout", "0"], "error: --request-timeout must be a number of seconds > 0 "
     "(got 0)"),
    (["--request-timeout", "inf"], "error: --request-timeout must be a number of seconds > 0 "
     "(got inf)")])
def test_bad_flags_give_one_error_line_and_exit_2(capsys, flags, message):
  with pytest.raises(SystemExit) as exit_:
    serve_main(flags)
  assert exit_.value.code == 2 and capsys.readouterr().err.strip() == message


def raw_stream(url: str, body: dict) -> str:
  """A streamed completion's whole SSE text (urllib: every event, errors included)."""
  request = urllib.request.Request(f"{url}/v1/completions",
                                   json.dumps({**body, "stream": True}).encode(),
                                   {"Content-Type": "application/json"})
  with urllib.request.urlopen(request, timeout=60) as response:
    assert response.status == 200
    return response.read().decode()


def test_sigterm_drains_running_requests_and_exits_0(server):
  """Last: it stops the shared server. Through the grace the socket stays open: new requests
  get a 503, running ones (streamed or not) finish; then it exits 0 without a traceback."""
  url = server.url
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    whole = pool.submit(post, f"{url}/v1/completions", json.dumps(
        {"prompt": PROMPTS[1], "max_tokens": 90, "temperature": 0}).encode())
    chunks = iter(client(url).completions.create(model=MODEL, prompt=PROMPTS[0],
                                                 max_tokens=90, temperature=0, stream=True))
    first = next(chunks)
    start = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.3)  # uvicorn looks at its exit flag every 0.1 s
    status, refused = post(f"{url}/v1/completions", json.dumps({"prompt": "x"}).encode())
    assert status == 503 and "shutting down" in refused["error"]["message"]
    assert set(refused["error"]) == {"message", "type", "param", "code"}
    assert get(f"{url}/health")[0] == 503
    rest = list(chunks)  # the running requests finish
    status, answer = whole.result(timeout=30)
  assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
  assert server.process.wait(timeout=30) == 0 and time.monotonic() - start < 30
  assert rest[-1].choices[0].finish_reason == "length"
  assert len("".join(c.choices[0].text for c in [first, *rest])) > 0
  with pytest.raises(OSError):
    get(f"{url}/health")
  assert "Traceback" not in open(server.log_path).read()


def test_streams_still_running_when_the_grace_ends_get_an_error_event(tmp_path):
  """A zero grace cuts at once: of four streams, one running and three waiting for the one
  slot, each ends with an error event and [DONE], which the openai client raises. (No warm-up:
  it sends one kind of request.)"""
  served = Subprocess(tmp_path / "server.log", ["--method", "ar", "--slots", "1",
                                                 "--max-context", str(CONTEXT)],
                      JETFLOW_SHUTDOWN_GRACE_S="0", JETFLOW_WARM_UP="0")
  try:
    url = served.url
    body = {"prompt": PROMPTS[0], "max_tokens": 100, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
      chunks = iter(client(url).completions.create(model=MODEL, stream=True, **body))
      next(chunks)  # it holds the slot; the others wait for it
      raws = [pool.submit(raw_stream, url, body) for _ in range(3)]
      deadline = time.monotonic() + 20
      while metrics(url)[("jetflow_queue_depth", ())] < 3:
        assert time.monotonic() < deadline, "the streams were not queued"
        time.sleep(0.02)
      served.process.send_signal(signal.SIGTERM)
      with pytest.raises(openai.APIError, match="shutting down"):
        list(chunks)
      texts = [raw.result(timeout=60) for raw in raws]
    assert served.process.wait(timeout=30) == 0
    for text in texts:
      *_, last = sse_events(text)
      assert set(last["error"]) == {"message", "type", "param", "code"}
      assert "did not finish within the 0 s grace" in last["error"]["message"]
    assert "Traceback" not in open(served.log_path).read()
  finally:
    served.stop()
