"""The server as operators run it behind a load balancer: an API key on /v1 routes, served model
names, bodies too large refused before they are read, and a per-request deadline.

One server (AR, one slot of 16 tokens: the fewest programs to warm up) runs as a subprocess with
all four flags; the rest are unit tests of what one process can check.
"""

import argparse
import concurrent.futures
import json
import signal
import time
import urllib.error
import urllib.request

import openai
import pytest

from jetflow_jax.serve import __main__ as serve_cli
from jetflow_jax.serve.guard import (MIN_REQUEST_BYTES, RequireKey, default_max_request_bytes,
                                     key_from_env)
from test_serve import PROMPTS, Subprocess, get, metrics, settle

KEYS = ["k1", "k2"]
NAMES = ["a", "b"]
MAX_BYTES = 100_000
TIMEOUT_S = 3
CONTEXT = 16
FLAGS = ["--method", "ar", "--slots", "1", "--max-context", str(CONTEXT), "--api-key", *KEYS,
         "--served-model-name", *NAMES, "--max-request-bytes", str(MAX_BYTES),
         "--request-timeout", str(TIMEOUT_S)]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
  served = Subprocess(tmp_path_factory.mktemp("serve") / "server.log", FLAGS)
  try:
    yield served.url
    assert "Traceback" not in open(served.log_path).read()
  finally:
    served.stop()


def send(url: str, body, key: str | None = KEYS[0], timeout: float = 60,
         **headers) -> tuple[int, dict, dict]:
  """(status, JSON body, headers) of a POST; `body` bytes, an iterable of chunks, or JSON."""
  if key is not None:
    headers["Authorization"] = f"Bearer {key}"
  data = body if isinstance(body, bytes) or hasattr(body, "__next__") else json.dumps(
      body).encode()
  request = urllib.request.Request(url, data, {"Content-Type": "application/json", **headers})
  try:
    with urllib.request.urlopen(request, timeout=timeout) as response:
      return response.status, json.loads(response.read()), dict(response.headers)
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read()), dict(e.headers)


def client(url: str, key: str = KEYS[0]) -> openai.OpenAI:
  return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def check_error(answer: dict, code: str | None, message: str) -> None:
  assert set(answer) == {"error"}
  assert set(answer["error"]) == {"message", "type", "param", "code"}
  assert answer["error"]["code"] == code and message in answer["error"]["message"]


def count(url: str, status: int) -> float:
  """Responses of /v1/completions with `status` so far."""
  return metrics(url).get(("jetflow_requests_total", (("endpoint", "/v1/completions"),
                                                      ("status", str(status)))), 0.0)


def test_v1_routes_need_one_of_the_keys_and_health_and_metrics_do_not(url):
  refused = count(url, 401)
  completion = {"model": "a", "prompt": "x", "max_tokens": 1, "temperature": 0}
  status, answer, headers = send(f"{url}/v1/completions", completion, key=None)
  assert status == 401 and headers["www-authenticate"] == "Bearer"
  check_error(answer, "invalid_api_key", "this server requires an API key")
  for wrong in ("k", "k12", "K1", ""):
    status, answer, _ = send(f"{url}/v1/completions", completion, key=wrong)
    assert status == 401, wrong
    check_error(answer, "invalid_api_key", "invalid API key")
  status, answer, _ = send(f"{url}/v1/completions", completion, key=None,
                           Authorization="Basic k1")
  assert status == 401
  for key in KEYS:
    status, answer, _ = send(f"{url}/v1/completions", completion, key=key)
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
  assert send(f"{url}/v1/completions", completion, key=None, Authorization="bearer  k2")[0] == 200
  with pytest.raises(openai.AuthenticationError):
    client(url, "wrong").models.list()
  status, _ = get(f"{url}/v1/models")
  assert status == 401
  assert get(f"{url}/health") == (200, '{"status":"ok"}')
  assert count(url, 401) - refused == 6  # /metrics is open too, and counted the refusals


def test_each_served_name_is_served_and_others_are_not_found(url):
  assert [m.id for m in client(url).models.list().data] == NAMES
  for name in NAMES:
    answer = client(url).completions.create(model=name, prompt=PROMPTS[0], max_tokens=3,
                                            temperature=0)
    assert answer.model == NAMES[0] and len(answer.choices[0].token_ids) == 3
  status, answer, _ = send(f"{url}/v1/completions", {"model": "jetflow-embedded", "prompt": "x"})
  assert status == 404
  check_error(answer, "model_not_found", "'jetflow-embedded' does not exist; this server "
              "serves 'a', 'b'")


def test_a_50_mb_body_is_refused_within_a_second_and_the_server_goes_on(url):
  too_large = count(url, 413)
  body = json.dumps({"model": "a", "prompt": "x" * 50_000_000}).encode()
  for key, status, code in ((None, 401, "invalid_api_key"), (KEYS[0], 413, "request_too_large")):
    start = time.monotonic()
    got, answer, _ = send(f"{url}/v1/completions", body, key=key)
    assert time.monotonic() - start < 1 and got == status
    check_error(answer, code, "requires an API key" if key is None else f"its Content-Length "
                f"is {len(body)} bytes); this server takes at most {MAX_BYTES} bytes")
  # Chunked, without a Content-Length: refused once the bytes read pass the limit.
  chunks = (b"x" * 10_000 for _ in range(5_000))
  start = time.monotonic()
  got, answer, _ = send(f"{url}/v1/completions", chunks)
  assert time.monotonic() - start < 1 and got == 413
  check_error(answer, "request_too_large", f"more than {MAX_BYTES} bytes came")
  # Just under the limit: read and parsed; text too long for a slot is refused on its head.
  start = time.monotonic()
  got, answer, _ = send(f"{url}/v1/completions", {"prompt": "def f(x):\n" * 9_000})
  assert time.monotonic() - start < 1 and got == 400
  check_error(answer, None, "a prompt of more than")
  # The openai client's pooled connection gets its 413 and serves the next request.
  openai_client = client(url)
  with pytest.raises(openai.APIStatusError) as refused:
    openai_client.completions.create(model="a", prompt="x" * 5_000_000, max_tokens=1)
  assert refused.value.status_code == 413
  answer = openai_client.completions.create(model="b", prompt=PROMPTS[1], max_tokens=2,
                                            temperature=0)
  assert len(answer.choices[0].token_ids) == 2
  assert count(url, 413) - too_large == 3


def test_token_id_prompts_too_long_for_a_slot_are_refused_by_name(url):
  status, answer, _ = send(f"{url}/v1/completions", {"prompt": [[1, 2], list(range(1, 200))],
                                                     "max_tokens": 1})
  assert status == 400
  check_error(answer, None, "a prompt of 199 tokens plus max_tokens 1 exceeds the engine's "
              f"context of {CONTEXT}")


def test_lm_evals_requests_with_the_key(url):
  """local-completions' loglikelihood and generate_until bodies, its Bearer header."""
  loglikelihood = {"model": "b", "prompt": [list(range(1, 13))], "temperature": 0,
                   "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
  status, answer, _ = send(f"{url}/v1/completions", loglikelihood)
  assert status == 200
  logprobs = answer["choices"][0]["logprobs"]
  assert len(logprobs["token_logprobs"]) == 13 and logprobs["token_logprobs"][0] is None
  generate = {"model": "b", "prompt": ["def f(x):"], "max_tokens": 4, "temperature": 0,
              "stop": ["<|endoftext|>"], "seed": 1234}
  status, answer, _ = send(f"{url}/v1/completions", generate)
  assert status == 200 and isinstance(answer["choices"][0]["text"], str)


def stream_events(url: str, body: dict) -> list[dict]:
  request = urllib.request.Request(f"{url}/v1/completions", json.dumps(
      {**body, "stream": True}).encode(), {"Content-Type": "application/json",
                                           "Authorization": f"Bearer {KEYS[0]}"})
  with urllib.request.urlopen(request, timeout=60) as response:
    assert response.status == 200
    raw = response.read().decode()
  assert raw.endswith("data: [DONE]\n\n")
  return [json.loads(e[len("data: "):]) for e in raw.split("\n\n")[:-2]]


def test_requests_past_the_deadline_end_with_504_or_an_error_event_and_free_their_slots(url):
  """Last: its jobs, 2 x 8 prompts x 128 choices of 15 tokens through one slot, would take far
  longer than the deadline; each request (one streamed, one not) ends at it, queued jobs and
  the one decoding alike."""
  before = settle(url)
  work = {"model": "a", "prompt": [[t] for t in range(1, 9)], "n": 128, "max_tokens": 15,
          "temperature": 1.0}
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    start = time.monotonic()
    whole = pool.submit(send, f"{url}/v1/completions", work)
    events = pool.submit(stream_events, url, work)
    status, answer, _ = whole.result(timeout=60)
    streamed = events.result(timeout=60)
    took = time.monotonic() - start
  assert TIMEOUT_S <= took < TIMEOUT_S + 5
  assert status == 504 and answer["error"]["type"] == "server_error"
  message = f"did not finish within the server's request timeout of {TIMEOUT_S} s"
  check_error(answer, None, message)
  *chunks, last = streamed
  assert all("choices" in c for c in chunks)
  check_error(last, None, message)
  after = settle(url)  # every job cancelled, the slot free
  grew = lambda name, *labels: after[(name, labels)] - before.get((name, labels), 0.0)
  assert grew("jetflow_request_timeouts_total") == 2
  assert grew("jetflow_completion_tokens_total") < 2 * 8 * 128 * 15 / 2
  assert grew("jetflow_requests_total", ("endpoint", "/v1/completions"), ("status", "504")) == 1
  answer = client(url).completions.create(model="a", prompt=PROMPTS[3], max_tokens=2,
                                          temperature=0)
  assert len(answer.choices[0].token_ids) == 2


def test_a_key_matches_whole_in_a_bearer_header_only():
  guard = RequireKey(None, ["secret", "other key"])
  assert [guard.admits(h) for h in (b"Bearer secret", b"bearer secret", b"BEARER  secret ",
                                    b"Bearer other key")] == [True] * 4
  assert not any(guard.admits(h) for h in (None, b"", b"secret", b"Basic secret",
                                           b"Bearer secre", b"Bearer secret2", b"Bearer",
                                           b"Bearer other", b"Token secret"))


def test_the_key_comes_from_the_flag_then_jetflow_then_vllm_environment(monkeypatch):
  for name in ("JETFLOW_API_KEY", "VLLM_API_KEY"):
    monkeypatch.delenv(name, raising=False)
  keys = lambda *flag: serve_cli.api_keys(argparse.Namespace(api_key=list(flag) or None))
  assert keys() == [] and key_from_env() is None
  monkeypatch.setenv("VLLM_API_KEY", "v")
  assert keys() == ["v"]
  monkeypatch.setenv("JETFLOW_API_KEY", "j")
  assert keys() == ["j"] and keys("f", "g") == ["f", "g"]
  monkeypatch.setenv("JETFLOW_API_KEY", "")  # set but empty: unset
  assert keys() == ["v"]


def test_listening_beyond_loopback_without_a_key_warns_once(monkeypatch, capsys):
  for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
    assert serve_cli.exposure(host, 8000, []) is None
  assert serve_cli.exposure("0.0.0.0", 8000, ["k"]) is None
  for name in ("JETFLOW_API_KEY", "VLLM_API_KEY"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(signal, "signal", lambda *_: None)  # keep pytest's SIGTERM handler
  with pytest.raises(SystemExit) as exit_:  # warned before loading, which then fails
    serve_cli.main(["--host", "0.0.0.0", "--port", "8123", "--checkpoint", "/nonexistent"])
  lines = capsys.readouterr().err.strip().splitlines()
  assert exit_.value.code != 0 and lines[0] == (
      "warning: --host 0.0.0.0 serves anyone who can reach port 8123, with no API key; pass "
      "--api-key or set $JETFLOW_API_KEY")
  assert sum("warning: --host" in line for line in lines) == 1


def test_the_default_body_limit_grows_with_the_context():
  assert default_max_request_bytes(128) == default_max_request_bytes(2048) == MIN_REQUEST_BYTES
  assert default_max_request_bytes(131072) == 64 * 131072 == 8 * MIN_REQUEST_BYTES
