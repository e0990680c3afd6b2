"""Load on the OpenAI-compatible server over loopback: throughput, latency, time to first token.

Run from the repository root:

  python bench/serve_load.py                         # embedded pair, jetflow, 8 slots, 32 requests
  python bench/serve_load.py --method ar --requests 64 --max-tokens 64

Starts `python -m jetflow_jax.serve` on the embedded pair as a subprocess, which compiles every
variant before /health says it is up (the start-up time is reported). First, one request of each
kind (greedy, sampled, sampled with top-p, logprobs, lm_eval's echo call) four times in a row:
the first's latency against the median of the later three, which no compile should separate
(within 2x). Then the same `--requests` greedy, streamed completions of HumanEval prompts,
twice: `--concurrency` at a time (default: the slots), then one at a time. For each: completion
tokens per second over the run, p50 / p99 of the request latency and of the time to the first
streamed text, and whether every answer is the same in both runs. Prints the tables, writes a
JSON (`--out`), and stops the server with SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # before the imports below: measure this checkout, installed or not

import numpy as np  # noqa: E402
import openai  # noqa: E402

from jetflow_jax import embedded  # noqa: E402
from jetflow_jax.bench.datasets import load_prompts  # noqa: E402
from jetflow_jax.decoding import METHODS  # noqa: E402
from jetflow_jax.text import load_tokenizer  # noqa: E402

MODEL = "jetflow-embedded"
# Request options by kind; sampled ones have a seed, so every repeat does the same work.
KINDS = {
    "greedy": dict(temperature=0),
    "sampled": dict(temperature=0.8, seed=1),
    "sampled, top-p": dict(temperature=0.8, top_p=0.9, seed=1),
    "logprobs": dict(temperature=0, logprobs=5),
    "echo (lm_eval)": dict(temperature=0, max_tokens=1, echo=True, logprobs=1),
}


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_server(args, port: int, log) -> subprocess.Popen:
  """The server as a subprocess; returns once /health answers."""
  server = subprocess.Popen(
      [sys.executable, "-m", "jetflow_jax.serve", "--method", args.method, "--slots",
       str(args.slots), "--max-context", str(args.context), "--budget", str(args.budget),
       "--port", str(port)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
  deadline = time.monotonic() + 600
  while True:
    if server.poll() is not None:
      raise SystemExit(f"the server exited with {server.returncode}; see {log.name}")
    try:
      with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
        return server
    except OSError:
      if time.monotonic() > deadline:
        server.kill()
        raise SystemExit("the server did not come up within 600 s")
      time.sleep(0.5)


def first_requests(url: str, prompt: str, max_tokens: int, repeats: int = 3) -> list[dict]:
  """Per kind: the latency of its first request, the programs the server compiled for it, and
  the median latency of `repeats` more."""
  client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=3600)
  rows = []
  for kind, options in KINDS.items():
    options = {"max_tokens": max_tokens, **options}
    # The engine dispatches a step before it reads the last one's tokens, so one more step of
    # the previous kind (several seconds for top-p here) runs after its answer: a one-token
    # greedy request waits for it, so the first of this kind does not.
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    latencies, compiled = [], server_metric(url, "jetflow_compiles_total")
    for _ in range(1 + repeats):
      start = time.perf_counter()
      client.completions.create(model=MODEL, prompt=prompt, **options)
      latencies.append(time.perf_counter() - start)
      if len(latencies) == 1:
        compiled = server_metric(url, "jetflow_compiles_total") - compiled
    later = float(np.median(latencies[1:]))
    rows.append({"kind": kind, "first_s": latencies[0], "compiles": int(compiled),
                 "later_s": later, "ratio": latencies[0] / later})
  return rows


async def one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> dict:
  """One streamed request: its latency, time to first text, tokens and text."""
  start = time.perf_counter()
  first, pieces, tokens = None, [], 0
  stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True})
  async for chunk in stream:
    if chunk.choices and chunk.choices[0].text:
      first = first or time.perf_counter()
      pieces.append(chunk.choices[0].text)
    if chunk.usage is not None:
      tokens = chunk.usage.completion_tokens
  end = time.perf_counter()
  return {"latency_s": end - start, "ttft_s": (first or end) - start, "tokens": tokens,
          "text": "".join(pieces)}


async def run(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
  """Every prompt, `concurrency` requests in flight at a time."""
  client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=3600)
  gate = asyncio.Semaphore(concurrency)

  async def gated(prompt):
    async with gate:
      return await one(client, prompt, max_tokens)

  start = time.perf_counter()
  answers = await asyncio.gather(*(gated(p) for p in prompts))
  wall = time.perf_counter() - start
  await client.close()
  latency, ttft = ([a[key] for a in answers] for key in ("latency_s", "ttft_s"))
  tokens = sum(a["tokens"] for a in answers)
  return {"concurrency": concurrency, "requests": len(prompts), "wall_s": wall,
          "completion_tokens": tokens, "tokens_per_s": tokens / wall,
          "latency_p50_s": float(np.percentile(latency, 50)),
          "latency_p99_s": float(np.percentile(latency, 99)),
          "ttft_p50_s": float(np.percentile(ttft, 50)),
          "ttft_p99_s": float(np.percentile(ttft, 99)),
          "texts": [a["text"] for a in answers]}


def server_metric(url: str, name: str) -> float:
  with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
    line = next(l for l in response.read().decode().splitlines() if l.startswith(f"{name} "))
  return float(line.split()[1])


def main():
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--method", default="jetflow", choices=METHODS)
  parser.add_argument("--slots", type=int, default=8)
  parser.add_argument("--concurrency", type=int, help="requests in flight (default: --slots)")
  parser.add_argument("--requests", type=int, default=32)
  parser.add_argument("--max-tokens", type=int, default=128)
  parser.add_argument("--context", type=int, default=1024, help="the server's --max-context")
  parser.add_argument("--budget", type=int, default=64)
  parser.add_argument("--out", help="default: bench/results/serve_load/METHOD.json")
  args = parser.parse_args()
  concurrency = args.concurrency or args.slots
  out = args.out or os.path.join("bench", "results", "serve_load", f"{args.method}.json")

  tokenizer = load_tokenizer(embedded.default_target())
  room = args.context - args.max_tokens
  prompts = [p for p in load_prompts("humaneval")
             if len(tokenizer.encode(p, add_special_tokens=False)) <= room][:args.requests]
  os.makedirs(os.path.dirname(out), exist_ok=True)
  port = free_port()
  url = f"http://127.0.0.1:{port}"
  with tempfile.NamedTemporaryFile("w", prefix="serve_load.", suffix=".log", delete=False) as log:
    start = time.perf_counter()
    server = start_server(args, port, log)
    start_s = time.perf_counter() - start
    try:
      first = first_requests(url, prompts[0], args.max_tokens)
      runs = [asyncio.run(run(url, prompts, c, args.max_tokens)) for c in (concurrency, 1)]
      tau = server_metric(url, "jetflow_tau")
    finally:
      server.send_signal(signal.SIGTERM)
      exit_code = server.wait(timeout=60)

  identical = runs[0]["texts"] == runs[1]["texts"]
  for r in runs:
    del r["texts"]
  print(f"{args.method}, {args.slots} slots of {args.context} tokens: up (every variant "
        f"compiled) {start_s:.1f} s after start")
  print("| first request of each kind | first s | its compiles | later s (median of 3) | "
        "first / later |\n|---|---|---|---|---|")
  for r in first:
    print(f"| {r['kind']} | {r['first_s']:.3f} | {r['compiles']} | {r['later_s']:.3f} | "
          f"{r['ratio']:.2f} |")
  print(f"\n{len(prompts)} HumanEval prompts, {args.max_tokens} tokens at most, tau {tau:.2f}, "
        f"answers identical at both concurrencies: {identical}")
  print("| concurrency | tokens/s | latency p50 s | latency p99 s | TTFT p50 s | TTFT p99 s |\n"
        "|---|---|---|---|---|---|")
  for r in runs:
    print(f"| {r['concurrency']} | {r['tokens_per_s']:.1f} | {r['latency_p50_s']:.2f} | "
          f"{r['latency_p99_s']:.2f} | {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} |")
  with open(out, "w") as f:
    json.dump({"settings": dict(vars(args), concurrency=concurrency, out=out), "tau": tau,
               "start_s": start_s, "first_requests": first,
               "identical_at_both_concurrencies": identical, "server_exit_code": exit_code,
               "runs": runs}, f, indent=1)


if __name__ == "__main__":
  main()
