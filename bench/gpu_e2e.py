"""End-to-end decoding speed at a known tau: AR against JetFlow rounds whose drafter's acceptance
is set (`controlled_drafter`), on a random target where no trained head exists.

On the GPU machine, from the repository root:

  python bench/gpu_e2e.py                  # Qwen3-8B shapes, bfloat16, pallas tree attention
  python bench/gpu_e2e.py --preset tiny    # a tiny float32 target on CPU (a smoke test, < 1 min)

Per batch size: random prompts, their AR greedy continuation by `generate` (timed: the AR row,
and the drafter's reference), then `decode_prompts` with the controlled drafter for every
(budget, tau) pair. A greedy round then commits exactly k + 1 tokens, k drawn from a
distribution with the requested mean (`--distribution`: two_point keeps k within one token of
tau - 1, geometric spreads it as a real draft would).

Reported per run: tokens/s = generated tokens / wall seconds, prefill included, compilation
excluded; tau = tokens per round (bonus included), also over full rounds only (each row's last
round is cut short by the token limit); `matches_ar`, whether the tokens equal AR's (in
bfloat16 a verify over another token count may flip a near-tie: from there a row's reference
is wrong and its tau falls, which the measured tau shows). Round executables are compiled up
front on a thread pool (`--compile-workers`); with `--compile-cache DIR` a rerun skips most
compiling.

The controlled drafter runs no head and takes no taps, so a round here costs the tree and the
verify alone: a trained head's forward (Qwen3-8B, H200, pallas: ~2.5 ms against a ~21 ms round
at N=256, `step_costs.py`) and its context update come on top, and these tokens/s are an upper
bound for a real head of the same tau.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import functools
import json
import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # before the imports below: measure this checkout, installed or not

import jax
import jax.numpy as jnp
import numpy as np

import step_costs  # bench/ is on sys.path: Python puts a script's own folder first
from jetflow_jax import cli
from jetflow_jax.config import Qwen3Config
from jetflow_jax.controlled_drafter import (ControlledDrafter, controlled_params,
                                            depth_distribution_for_tau, expected_tau)
from jetflow_jax.decoding import TreeShape, decode_prompts, generate
from jetflow_jax.decoding.auto import auto_specs
from jetflow_jax.decoding.loop import batch_rows, compile_decode, compiled
from jetflow_jax.decoding.round import RoundSpec
from jetflow_jax.decoding.state import default_cache_size
from jetflow_jax.drafters import NoDrafter
from jetflow_jax.errors import InputError
from jetflow_jax.model import decode_kernel_layout, init_params, with_kernel_layout
from jetflow_jax.sampling import Greedy, sampling_flags
from jetflow_jax.tree import validate_tree_args


@dataclasses.dataclass(frozen=True)
class Preset:
  config: Qwen3Config
  dtype: Any
  attention: str
  new_tokens: int
  repeats: int
  needs_gpu: bool


PRESETS = {
    "qwen3-8b": Preset(config=step_costs.PRESETS["qwen3-8b"].config,
                       dtype=step_costs.PRESETS["qwen3-8b"].dtype, attention="pallas",
                       new_tokens=256, repeats=2, needs_gpu=True),
    # Real Qwen3 shapes in float32 on this CPU (batch 1 reads its weights as 8B does a GPU's).
    "qwen3-0.6b": Preset(config=step_costs.PRESETS["qwen3-0.6b"].config, dtype=jnp.float32,
                         attention="xla", new_tokens=64, repeats=2, needs_gpu=False),
    "qwen3-1.7b": Preset(config=step_costs.PRESETS["qwen3-1.7b"].config, dtype=jnp.float32,
                         attention="xla", new_tokens=64, repeats=2, needs_gpu=False),
    "tiny": Preset(config=Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16),
                   dtype=jnp.float32, attention="xla", new_tokens=64, repeats=1,
                   needs_gpu=False),
}


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-8b")
  parser.add_argument("--new-tokens", type=int, help="tokens generated per row (preset default)")
  parser.add_argument("--prompt-len", type=int, default=64, help="random prompt tokens per row")
  parser.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
  parser.add_argument("--taus", default="4,8,10", help="requested taus, comma-separated")
  parser.add_argument("--budgets", default="64,256", help="tree budgets, comma-separated")
  parser.add_argument("--auto", action="store_true",
                      help="also budget auto (each round's budget on the ladder up to the "
                           "largest of --budgets, chosen from the measured round times)")
  parser.add_argument("--top-k", type=int, default=7, help="candidate children per depth")
  parser.add_argument("--depth", type=int, default=15, help="drafter depth (JetFlow: 15)")
  parser.add_argument("--distribution", choices=("two_point", "geometric"), default="two_point")
  parser.add_argument("--attention", choices=step_costs.IMPLS, help="tree attention impl")
  parser.add_argument("--repeats", type=int, help="timed runs of each row (best one kept)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--compile-workers", type=int, default=4,
                      help="threads compiling up front (1: each run compiles its own)")
  parser.add_argument("--compile-cache", help="persistent XLA compilation cache directory")
  parser.add_argument("--kernel-layout", choices=("auto", "in_out", "out_in"), default="auto",
                      help="how the target's projection kernels are stored (auto: the backend's "
                           "fastest, model.decode_kernel_layout)")
  parser.add_argument("--allow-cpu", action="store_true", help="run a GPU preset on CPU anyway")
  parser.add_argument("--out", help="JSON path (default bench/results/gpu/e2e_<preset>.json)")
  return parser.parse_args(argv)


@dataclasses.dataclass(frozen=True)
class Plan:
  preset_name: str
  config: Qwen3Config
  dtype: Any
  attention: str
  new_tokens: int
  prompt_len: int
  batches: tuple[int, ...]
  taus: tuple[float, ...]
  budgets: tuple[int, ...]
  auto: bool
  top_k: int
  depth: int
  distribution: str
  repeats: int
  seed: int
  compile_workers: int
  out: str
  kernel_layout: str


def make_plan(args: argparse.Namespace) -> Plan:
  """Preset defaults overridden by flags; raises InputError on anything unusable."""
  preset = PRESETS[args.preset]
  if preset.needs_gpu and jax.default_backend() == "cpu" and not args.allow_cpu:
    raise InputError(f"the {args.preset} preset needs a GPU but jax's backend is cpu; pass "
                     "--preset tiny, or --allow-cpu")
  try:
    taus = tuple(float(t) for t in args.taus.split(",") if t.strip())
  except ValueError:
    raise InputError(f"--taus must be comma-separated numbers (got {args.taus!r})") from None
  if not taus or not all(1.0 <= t <= args.depth + 1 for t in taus):
    raise InputError(f"--taus must lie in [1, depth + 1] = [1, {args.depth + 1}]")
  budgets = step_costs.parse_ints(args.budgets, "--budgets")
  for budget in budgets:
    validate_tree_args(args.depth, preset.config.vocab_size, budget, args.top_k)
    if budget < args.depth + 1:  # else the top-1 chain is cut short and tau falls below target
      raise InputError(f"budget {budget} cannot hold the depth-{args.depth} chain "
                       f"(needs >= {args.depth + 1} nodes)")
  new_tokens = args.new_tokens or preset.new_tokens
  repeats = args.repeats or preset.repeats
  if min(new_tokens, args.prompt_len, repeats, args.compile_workers) < 1:
    raise InputError("--new-tokens, --prompt-len, --repeats, --compile-workers must be >= 1")
  out = args.out or os.path.join(ROOT, "bench", "results", "gpu", f"e2e_{args.preset}.json")
  return Plan(args.preset, preset.config, preset.dtype, args.attention or preset.attention,
              new_tokens, args.prompt_len, step_costs.parse_ints(args.batches, "--batches"),
              taus, budgets, args.auto, args.top_k, args.depth, args.distribution, repeats,
              args.seed, args.compile_workers, out,
              decode_kernel_layout() if args.kernel_layout == "auto" else args.kernel_layout)


def precompile(plan: Plan, target_params, prompts_by_batch, drafter: ControlledDrafter) -> float:
  """Compiles every (batch, round shape) up front on a pool, into the decode loop's own cache of
  executables (the specs and rows `decode_prompts` builds for the same arguments); seconds."""
  start = time.perf_counter()
  greedy = sampling_flags([Greedy()])
  ar_spec = RoundSpec(config=plan.config, drafter=NoDrafter(), tree_shape=TreeShape("root"),
                      impl="xla", **greedy)
  first, later = [], []
  for batch, prompts in prompts_by_batch.items():
    cache_size = default_cache_size(plan.config, prompts, plan.new_tokens)
    rows = batch_rows(prompts, plan.new_tokens, cache_size, Greedy(), 0, ())
    # Shapes only: the reference's and distribution's values do not matter to the compile.
    reference = np.zeros((batch, plan.prompt_len + plan.new_tokens), np.int32)
    params = controlled_params(reference, depth_distribution_for_tau(1.0, plan.depth))
    first.append(functools.partial(compile_decode, target_params, None, rows, ar_spec,
                                   cache_size))
    specs = [RoundSpec(config=plan.config, drafter=drafter, impl=plan.attention,
                       tree_shape=TreeShape("top_n", budget, plan.top_k), **greedy)
             for budget in plan.budgets]
    if plan.auto:  # one round per ladder budget, each predicting every budget
      specs += auto_specs(dataclasses.replace(specs[0], tree_shape=TreeShape(
          "top_n", max(plan.budgets), plan.top_k)))
    for i, spec in enumerate(specs):
      # The first budget's job compiles the batch's prefill; later ones find it compiled.
      (later if i else first).append(functools.partial(compile_decode, target_params, params,
                                                       rows, spec, cache_size))
  with concurrent.futures.ThreadPoolExecutor(plan.compile_workers) as pool:
    for jobs in (first, later):
      for job in [pool.submit(job) for job in jobs]:
        job.result()
  return time.perf_counter() - start


def best_run(repeats: int, run):
  """The run of least wall time among `repeats` (the first one included)."""
  return min((run() for _ in range(repeats)), key=lambda generation: generation.wall_s)


def full_round_tau(generation) -> float:
  """Tokens per round over every round but each row's last (cut short by the token limit)."""
  full = [r[:-1] for r in generation.committed_per_round]
  rounds = sum(map(len, full))
  return sum(map(sum, full)) / rounds if rounds else float("nan")


def row_record(generation, reference, **fields) -> dict:
  mismatches = [next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                     None if len(got) == len(want) else min(len(got), len(want)))
                for got, want in zip(generation.tokens, reference)]
  return dict(fields, tokens_per_s=generation.num_tokens / generation.wall_s,
              wall_s=generation.wall_s, compile_s=generation.compile_s,
              measured_tau=generation.tau, full_round_tau=full_round_tau(generation),
              num_tokens=generation.num_tokens,
              num_forwards=generation.num_forwards,
              matches_ar=all(m is None for m in mismatches), first_mismatch=mismatches)


def run(plan: Plan) -> dict:
  """Params, prompts, AR, then every (batch, budget, tau); returns the JSON record."""
  start = time.perf_counter()
  make_params = jax.jit(init_params, static_argnums=(0, 2))
  target_params = jax.block_until_ready(with_kernel_layout(
      make_params(plan.config, jax.random.key(plan.seed), plan.dtype), plan.kernel_layout))
  params_s = time.perf_counter() - start
  rng = np.random.default_rng(plan.seed)
  all_prompts = rng.integers(0, plan.config.vocab_size,
                             (max(plan.batches), plan.prompt_len)).tolist()
  prompts_by_batch = {batch: all_prompts[:batch] for batch in plan.batches}
  drafter = ControlledDrafter(depth=plan.depth)
  precompile_s = 0.0
  if plan.compile_workers > 1:
    precompile_s = precompile(plan, target_params, prompts_by_batch, drafter)
  misses = compiled.misses

  rows = []
  for batch, prompts in prompts_by_batch.items():
    ar = best_run(plan.repeats, lambda: generate(target_params, plan.config, prompts,
                                                 plan.new_tokens, stop_tokens=()))
    rows.append(row_record(ar, ar.tokens, method="ar", batch=batch, budget=1, tau=1.0,
                           expected_tau=1.0))
    reference = [p + t for p, t in zip(prompts, ar.tokens)]
    for budget in plan.budgets + (("auto",) if plan.auto else ()):
      for tau in plan.taus:
        distribution = depth_distribution_for_tau(tau, plan.depth, plan.distribution)
        params = controlled_params(reference, distribution, seed=plan.seed)
        auto = budget == "auto"
        generation = best_run(plan.repeats, lambda: decode_prompts(
            target_params, plan.config, drafter, params, prompts, plan.new_tokens,
            tree_shape=TreeShape("top_n", max(plan.budgets) if auto else budget, plan.top_k),
            stop_tokens=(), impl=plan.attention, auto=auto))
        chosen = ({"rounds_by_budget": dict(collections.Counter(generation.budgets))} if auto
                  else {})
        rows.append(row_record(generation, ar.tokens, method="jetflow", batch=batch,
                               budget=budget, tau=tau, expected_tau=expected_tau(distribution),
                               **chosen))
  ar_speed = {r["batch"]: r["tokens_per_s"] for r in rows if r["method"] == "ar"}
  for r in rows:
    r["speedup"] = r["tokens_per_s"] / ar_speed[r["batch"]]
  device = jax.devices()[0]
  return dict(
      preset=plan.preset_name, backend=jax.default_backend(),
      device=getattr(device, "device_kind", str(device)), jax_version=jax.__version__,
      dtype=jnp.dtype(plan.dtype).name, config=dataclasses.asdict(plan.config),
      attention=plan.attention, kernel_layout=plan.kernel_layout, new_tokens=plan.new_tokens,
      prompt_len=plan.prompt_len,
      top_k=plan.top_k, depth=plan.depth, distribution=plan.distribution,
      repeats=plan.repeats, params_s=params_s, precompile_s=precompile_s,
      compiles_after_precompile=compiled.misses - misses,
      wall_s=time.perf_counter() - start, rows=rows)


def table(record: dict) -> str:
  """Markdown, one line per run."""
  lines = ["| batch | method | budget | tau asked | tau measured (full rounds) | tokens/s | "
           "speedup | = AR |", "|---:|---|---:|---:|---:|---:|---:|---|"]
  for r in record["rows"]:
    budget = r["budget"]
    if "rounds_by_budget" in r:  # auto: the rounds each budget ran
      ran = sorted((int(n), k) for n, k in r["rounds_by_budget"].items())
      budget = "auto (" + ", ".join(f"{'AR' if n == 1 else n} x{k}" for n, k in ran) + ")"
    lines.append(f"| {r['batch']} | {r['method']} | {budget} | {r['tau']:g} | "
                 f"{r['measured_tau']:.2f} ({r['full_round_tau']:.2f}) | "
                 f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f} | "
                 f"{'yes' if r['matches_ar'] else 'NO'} |")
  return "\n".join(lines)


def main(argv=None) -> None:
  args = parse_args(argv)

  def bench():
    plan = make_plan(args)
    if args.compile_cache:
      jax.config.update("jax_compilation_cache_dir", args.compile_cache)
    record = run(plan)
    print(f"{plan.preset_name}: {record['device']} ({record['backend']}), {record['dtype']}, "
          f"{plan.attention} attention, {plan.new_tokens} new tokens after {plan.prompt_len}, "
          f"{plan.distribution} depths (max {plan.depth}), top-k {plan.top_k}, best of "
          f"{plan.repeats}; params {record['params_s']:.1f} s, precompile "
          f"{record['precompile_s']:.1f} s, total {record['wall_s']:.1f} s")
    print(table(record))
    os.makedirs(os.path.dirname(os.path.abspath(plan.out)), exist_ok=True)
    with open(plan.out, "w") as f:
      json.dump(record, f, indent=1, default=str)
    print(f"wrote {plan.out}")

  cli.run(bench)


if __name__ == "__main__":
  main()
