"""Regeneration throughput on mixed lengths: static batches against the engine, same slot count.

Run from the repository root:

  python bench/regenerate_throughput.py               # embedded pair, 80 HumanEval prompts, S=8
  python bench/regenerate_throughput.py --slots 16 --prompts 96

The workload: HumanEval prompts, each record with its own `max_tokens` from a long-tailed
chat-like distribution (lognormal, clipped to [8, 256], fixed seed) and, every other record,
stop strings ("\\n\\ndef ": the end of the function the embedded target writes first). The
embedded target hardly ever emits its end token, so `max_tokens` and the stop strings are
what make the lengths mixed. Rows, all greedy through `regenerate.regenerate` into a store:
  static        today's path (`--backend jax_static`): sorted batches of S, each run to its
                longest max_tokens, stop strings applied to the result;
  engine        the continuous-batching engine (`--backend jax`) at S slots, AR;
  engine_head   the engine with the embedded JetFlow head (speculative regeneration).
Each row runs the workload twice, the first to compile, and times the second. Tokens per
second count useful tokens (the stored responses); the engine rows' records must equal the
static row's byte for byte. Prints a table and writes a JSON under
bench/results/regenerate_throughput/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # before the imports below: measure this checkout, installed or not
os.environ.setdefault("TQDM_DISABLE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jetflow_jax import cli, embedded  # noqa: E402
from jetflow_jax.bench.datasets import load_prompts  # noqa: E402
from jetflow_jax.checkpoint import load_qwen3  # noqa: E402
from jetflow_jax.head_checkpoint import load_head  # noqa: E402
from jetflow_jax.sampling import Greedy  # noqa: E402
from jetflow_jax.text import detokenizer, load_tokenizer  # noqa: E402
from jetflow_jax.train import regenerate_backends as backends  # noqa: E402
from jetflow_jax.train.regenerate import regenerate  # noqa: E402
from jetflow_jax.train.store import TokenStore  # noqa: E402

STOP = ["\n\ndef ", "\n\n\n"]


def workload(tokenizer, count: int, max_prompt: int, seed: int) -> list[dict]:
  """`count` HumanEval prompts of at most `max_prompt` tokens, each with its own max_tokens
  (lognormal, median 48, clipped to [8, 256]); every other one with stop strings."""
  prompts = [ids for ids in map(tokenizer.encode, load_prompts("humaneval"))
             if len(ids) <= max_prompt][:count]
  max_tokens = np.clip(np.random.default_rng(seed).lognormal(np.log(48), 0.9, len(prompts)),
                       8, 256).astype(int)
  return [dict(id=str(i), prompt_ids=p, max_tokens=int(m), **({"stop": STOP} if i % 2 else {}))
          for i, (p, m) in enumerate(zip(prompts, max_tokens))]


def run(records, make_generator) -> tuple[float, list[list[int]]]:
  """Wall seconds of one regeneration of `records` into a fresh store, and its responses."""
  with tempfile.TemporaryDirectory() as store_dir:
    start = time.perf_counter()
    regenerate(records, store_dir, make_generator, max_new_tokens=256, max_prompt_len=1024)
    wall = time.perf_counter() - start
    store = TokenStore(store_dir)
    return wall, [store.tokens(i)[store.prompt_lengths[i]:].tolist()
                  for i in range(store.num_records)]


def main():
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--slots", type=int, default=8, help="S: static batch size = engine slots")
  parser.add_argument("--prompts", type=int, default=80)
  parser.add_argument("--max-prompt", type=int, default=192, help="longer prompts are left out")
  parser.add_argument("--rounds-per-step", type=int, default=4)
  parser.add_argument("--budget", type=int, default=32, help="tree nodes of the head's rounds")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--no-head", action="store_true", help="skip the speculative row")
  parser.add_argument("--out", default=None)
  args = parser.parse_args()

  dtype = cli.parse_dtype("auto")
  config, params = load_qwen3(embedded.default_target(), dtype)
  tokenizer = load_tokenizer(embedded.default_target())
  decode = detokenizer(tokenizer)
  records = workload(tokenizer, args.prompts, args.max_prompt, args.seed)
  engine = lambda *head, **options: lambda: backends.engine_generator(
      params, config, *head, slots=args.slots, rounds_per_step=args.rounds_per_step,
      decode=decode, **options)
  rows = {"static": lambda: backends.static_generator(
              backends.jax_batches(params, config, Greedy()), args.slots, decode),
          "engine": engine()}
  if not args.no_head:
    head_config, head_params = load_head(embedded.default_head("jetflow"), dtype)
    rows["engine_head"] = engine(head_params, head_config, method="jetflow", budget=args.budget)

  results = {}
  for name, make_generator in rows.items():
    first_s, _ = run(records, make_generator)
    wall, responses = run(records, make_generator)
    results[name] = dict(first_pass_s=first_s, wall_s=wall, responses=responses)
  static = results["static"]["responses"]
  ended_early = sum(len(r) < rec["max_tokens"] for r, rec in zip(static, records))
  useful = sum(map(len, static))
  for name, row in results.items():
    responses = row.pop("responses")
    tokens = sum(map(len, responses))
    row.update(tokens=tokens, tokens_per_s=tokens / row["wall_s"],
               identical_to_static=sum(a == b for a, b in zip(responses, static)))
  for row in results.values():
    row["speedup_over_static"] = row["tokens_per_s"] / results["static"]["tokens_per_s"]

  report = dict(backend=jax.default_backend(), dtype=str(np.dtype(dtype)), slots=args.slots,
                rounds_per_step=args.rounds_per_step, budget=args.budget, records=len(records),
                useful_tokens=useful, records_ended_early=ended_early,
                max_tokens=[r["max_tokens"] for r in records], rows=results)
  print(f"{len(records)} records, {useful} response tokens, {ended_early} ended before their "
        f"max_tokens; S={args.slots}, {report['dtype']} on {report['backend']}")
  print(f"{'row':<12} {'wall s':>8} {'tokens/s':>9} {'x static':>9} {'= static':>9} "
        f"{'1st pass s':>11}")
  for name, row in results.items():
    print(f"{name:<12} {row['wall_s']:>8.2f} {row['tokens_per_s']:>9.1f} "
          f"{row['speedup_over_static']:>9.2f} {row['identical_to_static']:>5}/{len(records):<3} "
          f"{row['first_pass_s']:>11.2f}")
  out = args.out or os.path.join(ROOT, "bench", "results", "regenerate_throughput",
                                 f"{report['backend']}_s{args.slots}.json")
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    json.dump(report, f, indent=1)


if __name__ == "__main__":
  cli.run(main)
