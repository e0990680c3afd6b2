"""How much does the engine's host loop add to a round? The embedded pair through the engine.

Run from the repository root:

  python bench/engine_overhead.py                        # embedded pair, jetflow, 4 slots
  python bench/engine_overhead.py --method ar --slots 8 --rounds-per-step 8

Three numbers, after every shape has compiled:
  round_ms        device time of a round: `Engine.step` dispatched back to back on full slots
                  (nothing read back), per round;
  loop_round_ms   the same steps through `Orchestrator.step` (admission, dispatch, reading back
                  and streaming the new tokens, one step late), per round;
  python_ms       the host's own Python per round inside `Orchestrator.step`: its wall time
                  less the time it waits for the device in `jax.device_get`.
`python_ms / round_ms` is the share of a round the host spends (target: at most 10%); since
the loop reads one step late, the device keeps running while it does, and `loop_round_ms /
round_ms` is what it actually costs. Then a mixed run: `--requests` requests of mixed lengths
arriving at once over the slots, with its tokens per second. Writes a JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # before the imports below: measure this checkout, installed or not

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jetflow_jax import cli, embedded  # noqa: E402
from jetflow_jax.checkpoint import load_qwen3  # noqa: E402
from jetflow_jax.decoding import speculative_generate  # noqa: E402
from jetflow_jax.engine import Orchestrator, Request, make_engine  # noqa: E402
from jetflow_jax.head_checkpoint import load_head  # noqa: E402
from jetflow_jax.kernels.tree_attention import attention_for_backend  # noqa: E402
from jetflow_jax.sampling import sampling_flags  # noqa: E402

PROMPTS = ["def fibonacci(n):", "import os\n\ndef list_files(path):",
           "class Stack:\n    def __init__(self):", "def quicksort(items):\n    \"\"\"Sort",
           "# Read a CSV file and", "def is_prime(n: int) -> bool:",
           "for i in range(10):\n", "def merge(a, b):\n    result = []"]


class HostClock:
  """Wall time inside `Orchestrator.step`, less the time spent waiting in `jax.device_get`."""

  def __init__(self):
    self.python_s = 0.0
    self._get = jax.device_get
    jax.device_get = self._timed_get
    self._waited = 0.0

  def _timed_get(self, x):
    start = time.perf_counter()
    out = self._get(x)
    self._waited += time.perf_counter() - start
    return out

  def step(self, orchestrator: Orchestrator) -> bool:
    self._waited = 0.0
    start = time.perf_counter()
    busy = orchestrator.step()
    self.python_s += time.perf_counter() - start - self._waited
    return busy


def main():
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--method", default="jetflow")
  parser.add_argument("--slots", type=int, default=4)
  parser.add_argument("--rounds-per-step", type=int, default=4)
  parser.add_argument("--budget", type=int, default=64)
  parser.add_argument("--top-k", type=int, default=7)
  parser.add_argument("--context", type=int, default=512)
  parser.add_argument("--steps", type=int, default=12, help="timed steps on full slots")
  parser.add_argument("--requests", type=int, default=16)
  parser.add_argument("--dtype", default="auto")
  parser.add_argument("--attention", default="xla", choices=("xla", "pallas"),
                      help="pallas: the backend's kernel (on a GPU the XLA path's cache loop has "
                      "a traced trip count, so every layer waits for the device)")
  parser.add_argument("--check", action="store_true",
                      help="compare the mixed run's greedy requests with `speculative_generate` "
                      "on each prompt alone")
  parser.add_argument("--out", default="bench/results/engine_overhead.json")
  args = parser.parse_args()

  dtype = cli.parse_dtype(args.dtype)
  config, params = load_qwen3(embedded.default_target(), dtype)
  head, head_params = (load_head(embedded.default_head("jetflow"), dtype)
                       if args.method != "ar" else (None, None))
  attention = attention_for_backend(args.attention, jax.default_backend())
  engine = make_engine(params, config, head_params, head, method=args.method, budget=args.budget,
                       top_k=args.top_k, num_slots=args.slots, max_context=args.context,
                       rounds_per_step=args.rounds_per_step, attention=attention,
                       warn=lambda _: None)
  from transformers import AutoTokenizer
  tokenizer = AutoTokenizer.from_pretrained(embedded.default_target())
  prompts = [tokenizer.encode(p) for p in PROMPTS]
  # Long enough that no slot finishes while the steps are timed.
  full = [Request(prompts[i % len(prompts)], args.context - 64, stop_tokens=())
          for i in range(args.slots)]

  def fill():
    state = engine.init_state()
    for slot, request in enumerate(full):
      state = engine.insert(state, engine.prefill(request), slot)
    return engine.step(state, **sampling_flags([r.sampler for r in full]))[0]

  def device_steps():
    state = fill()
    before = int(state.rows.num_forwards)
    start = time.perf_counter()
    for _ in range(args.steps):
      state, _ = engine.step(state, **sampling_flags([r.sampler for r in full]))
    jax.block_until_ready(state)
    return time.perf_counter() - start, int(state.rows.num_forwards) - before

  clock = HostClock()

  def loop_steps():
    orchestrator = Orchestrator(engine)
    for request in full:
      orchestrator.submit(request)
    orchestrator.step()  # admits and runs a first step, as `fill` does
    before = int(orchestrator.state.rows.num_forwards)
    clock.python_s = 0.0
    start = time.perf_counter()
    for _ in range(args.steps):
      clock.step(orchestrator)
    jax.block_until_ready(orchestrator.state)
    wall = time.perf_counter() - start
    assert all(s is not None for s in orchestrator.slots), "a slot finished while timed"
    return wall, int(orchestrator.state.rows.num_forwards) - before, clock.python_s

  device_steps(), loop_steps()  # compile and warm up
  device_s, device_rounds = device_steps()
  loop_s, loop_rounds, python_s = loop_steps()
  assert device_rounds == loop_rounds == args.steps * args.rounds_per_step
  rounds = device_rounds
  round_ms = 1e3 * device_s / rounds
  result = dict(backend=jax.default_backend(), dtype=str(np.dtype(dtype)), method=args.method,
                attention=attention,
                slots=args.slots, rounds_per_step=args.rounds_per_step, budget=args.budget,
                round_ms=round_ms, loop_round_ms=1e3 * loop_s / rounds,
                python_ms=1e3 * python_s / rounds, python_share=python_s / device_s,
                loop_over_device=loop_s / device_s)

  # A mixed run: requests of several lengths and settings arriving at once.
  mixed = [Request(prompts[i % len(prompts)], 32 + 24 * (i % 5), temperature=0.0 if i % 2 else 0.8,
                   top_p=0.95, seed=i, stop_tokens=()) for i in range(args.requests)]
  Orchestrator(engine).generate(mixed)  # compile any bucket not seen yet
  orchestrator = Orchestrator(engine)
  streams = [orchestrator.submit(r) for r in mixed]
  clock.python_s = 0.0
  start = time.perf_counter()
  while clock.step(orchestrator):
    pass
  wall = time.perf_counter() - start
  tokens = sum(len(s.tokens) for s in streams)
  rounds = int(orchestrator.state.rows.num_forwards)
  result.update(mixed_requests=args.requests, mixed_tokens=tokens, mixed_wall_s=wall,
                mixed_tokens_per_s=tokens / wall, mixed_steps=orchestrator.num_steps,
                mixed_python_ms_per_step=1e3 * clock.python_s / orchestrator.num_steps,
                mixed_tau=sum(len(s.tokens) - 1 for s in streams) / max(1, sum(s.rounds
                                                                             for s in streams)))
  if args.check:
    greedy = [(r, s) for r, s in zip(mixed, streams) if r.temperature == 0]
    alone = [speculative_generate(params, config, head_params, head, [r.prompt], r.max_tokens,
                                  method=args.method, budget=args.budget, top_k=args.top_k,
                                  attention=attention, stop_tokens=(),
                                  warn=lambda _: None).tokens[0]
             for r, _ in greedy]
    result.update(greedy_checked=len(greedy),
                  greedy_equal_alone=sum(s.tokens == a for (_, s), a in zip(greedy, alone)),
                  greedy_first_difference=[next((i for i, (x, y) in enumerate(zip(s.tokens, a))
                                                 if x != y), None)
                                           for (_, s), a in zip(greedy, alone)])
  print(json.dumps(result, indent=1))
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  cli.run(main)
