"""What one speculative round costs, piece by piece: AR step, head, tree verify, round, loops.

Run as a script from the repository root (it puts the root on sys.path, so this checkout's
`jetflow_jax` is what gets measured):

  python bench/step_costs.py                       # cpu-small: a small random Qwen3, float32, CPU
  python bench/step_costs.py --preset qwen3-8b     # Qwen3-8B shapes, bfloat16; needs a GPU
  python bench/step_costs.py --lengths 32 --budgets 8,16 --repeats 2 --layers 3 --vocab 512
  python bench/gpu_step.py --batch 8 --lengths 4096,32768   # 8 rows per piece, 4K and 32K tokens
  python bench/step_costs.py --preset qwen3-8b --floor-only --device-kind "NVIDIA H200" \
      --batch 1,8,32 --lengths 4096,32768                   # floors only: runs nothing, any machine

Target, head, prompt and draft log-probs are all random: the costs depend on shapes only. A row
holds `length` committed tokens (the prompt is `length - 1` tokens plus the first new one), so
every piece reads a cache of `length - 1` rows in a buffer of the size decoding would allocate
for `--loop-rounds` more rounds (XLA's attention reads every slot of it, masked; Pallas's tree
kernel only the committed ones). Each time is the median of `--repeats` runs after one warm-up,
on fresh inputs (pieces that donate their state get a copy made outside the clock). All
executables are compiled ahead of time, overlapped on a thread pool, before anything is timed.

Pieces, per committed length:
  ar_step               the AR round (the root-only tree, no drafter; state donated);
  head/IMPL             `HeadDrafter.draft`: one block after the committed context;
  verify/IMPL/N         target forward over a fixed N-node `build_tree` tree + `lm_logits`;
  round/IMPL/N          `decode_round` (state donated): draft, tree, verify, accept, commit;
  device_loop           the device loop `decoding.loop.decode(max_rounds=R)` once, per round;
  host_loop             R calls of `decode(max_rounds=1)`, each followed by the host reading
                        `done_b` (as a streaming loop does), per round.
Pallas on CPU runs in interpret mode: allowed (`--attention xla,pallas`) but its times say
nothing about a GPU.

Every piece runs `--batch` rows (one value per measuring run; each row holds `length` tokens)
and is set against its floor (`jetflow_jax.roofline`: weights and each row's cache read once,
FLOPs at the dense bf16 peak; on the CPU, at the float32 rate `roofline.host_device` measured for
the piece's row count) on the device it runs on: bytes, FLOPs, floor and measured / floor, in the
table and the JSON; 'n/a' (JSON null) on a device the table lacks. The loops'
floor is that of one round at the loop's budget. `--floor-only` prints and writes the floors of
a preset for `--device-kind` (several, comma-separated), `--batch` and `--lengths` (lists), and
measures nothing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # before the imports below: measure this checkout, installed or not

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jetflow_jax import cli, roofline
from jetflow_jax.config import Qwen3Config
from jetflow_jax.decoding.loop import decode
from jetflow_jax.decoding.prefill import prefill
from jetflow_jax.decoding.round import RoundSpec, TreeShape, decode_round
from jetflow_jax.decoding.state import stop_rows
from jetflow_jax.drafters import HeadDrafter, NoDrafter
from jetflow_jax.errors import InputError
from jetflow_jax.head import init_head_params
from jetflow_jax.head_config import QWEN3_MASK_TOKEN_ID, HeadConfig
from jetflow_jax.model import (abstract_params, decode_kernel_layout, forward, init_params,
                               lm_logits, with_kernel_layout)
from jetflow_jax.partitioning import abstract
from jetflow_jax.sampling import Greedy, RowSampling
from jetflow_jax.tree import build_tree, validate_tree_args

IMPLS = ("xla", "pallas")
# Targets for Qwen3-8B on one GPU (bench/gpu_step.py); printed for every preset, for reference.
VERIFY_OVER_AR_MAX = 1.25  # verify of the largest budget (256) / AR step
HEAD_OVER_AR_MAX = 0.08  # head forward / AR step


@dataclasses.dataclass(frozen=True)
class Preset:
  """A target shape, its head, and the default sweep."""

  config: Qwen3Config
  dtype: Any
  head_layers: int
  taps: tuple[int, ...]
  block_size: int
  mask_token_id: int
  lengths: tuple[int, ...]
  budgets: tuple[int, ...]
  attention: tuple[str, ...]
  repeats: int
  needs_gpu: bool
  batches: tuple[int, ...] = (1,)


PRESETS = {
    "cpu-small": Preset(
        config=Qwen3Config(vocab_size=8192, hidden_size=256, intermediate_size=768,
                           num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=64),
        dtype=jnp.float32, head_layers=2, taps=(1, 3), block_size=16, mask_token_id=8191,
        lengths=(256,), budgets=(16, 32, 64, 128, 256), attention=("xla",), repeats=5,
        needs_gpu=False),
    # Real Qwen3 shapes small enough for this CPU, where batch 1 is bound by reading the
    # weights as Qwen3-8B is on a GPU (random float32 weights; tied embeddings as published).
    "qwen3-0.6b": Preset(
        config=Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                           num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                           head_dim=128, rope_theta=1e6, tie_word_embeddings=True),
        dtype=jnp.float32, head_layers=3, taps=(1, 13, 25), block_size=16,
        mask_token_id=QWEN3_MASK_TOKEN_ID, lengths=(512, 4096), budgets=(16, 64),
        attention=("xla",), repeats=3, needs_gpu=False),
    "qwen3-1.7b": Preset(
        config=Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                           num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                           head_dim=128, rope_theta=1e6, tie_word_embeddings=True),
        dtype=jnp.float32, head_layers=3, taps=(1, 13, 25), block_size=16,
        mask_token_id=QWEN3_MASK_TOKEN_ID, lengths=(512, 4096), budgets=(16, 64),
        attention=("xla",), repeats=3, needs_gpu=False),
    "qwen3-8b": Preset(
        config=Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                           num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=128, rope_theta=1e6, tie_word_embeddings=False),
        dtype=jnp.bfloat16, head_layers=5, taps=(1, 9, 17, 25, 33), block_size=16,
        mask_token_id=QWEN3_MASK_TOKEN_ID, lengths=(1024, 4096), budgets=(16, 32, 64, 128, 256),
        attention=("xla", "pallas"), repeats=10, needs_gpu=True),
}


def parse_ints(text: str, flag: str) -> tuple[int, ...]:
  try:
    values = tuple(int(t) for t in text.split(",") if t.strip())
  except ValueError:
    raise InputError(f"{flag} must be comma-separated integers (got {text!r})") from None
  if not values or min(values) < 1:
    raise InputError(f"{flag} needs positive integers (got {text!r})")
  return values


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu-small")
  parser.add_argument("--lengths", help="committed lengths, comma-separated (preset's default)")
  parser.add_argument("--budgets", help="tree budgets N, comma-separated (preset's default)")
  parser.add_argument("--batch", help="rows per piece (preset's default 1); several, "
                      "comma-separated, with --floor-only only")
  parser.add_argument("--attention", help="tree attention impls: xla, pallas or xla,pallas")
  parser.add_argument("--repeats", type=int, help="timed runs per piece after one warm-up")
  parser.add_argument("--top-k", type=int, default=7, help="candidate children per depth")
  parser.add_argument("--loop-rounds", type=int, default=8,
                      help="rounds R of the device-loop vs host-loop comparison")
  parser.add_argument("--loop-budget", type=int, default=None,
                      help="tree budget of the loops (default: largest budget <= 64)")
  parser.add_argument("--layers", type=int, help="override the target's layer count")
  parser.add_argument("--vocab", type=int, help="override the vocabulary size")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--compile-cache", help="persistent XLA compilation cache directory")
  parser.add_argument("--allow-cpu", action="store_true",
                      help="run a GPU preset on CPU anyway")
  parser.add_argument("--floor-only", action="store_true",
                      help="print and write the pieces' floors (bytes, FLOPs, ms); measure nothing")
  parser.add_argument("--device-kind", help="with --floor-only: jax device_kind(s) whose floors "
                      "to give, comma-separated (default: this machine's)")
  parser.add_argument("--out", help="JSON path (default bench/results/step_costs_<preset>[_b<B>]"
                      ".json; with --floor-only bench/results/floor_<preset>.json)")
  return parser.parse_args(argv)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything the run needs, validated."""

  preset_name: str
  config: Qwen3Config
  head_config: HeadConfig
  dtype: Any
  lengths: tuple[int, ...]
  budgets: tuple[int, ...]
  attention: tuple[str, ...]
  repeats: int
  top_k: int
  batches: tuple[int, ...]  # one when measuring
  loop_rounds: int
  loop_budget: int
  seed: int
  out: str


def preset_pair(preset: Preset, layers: int | None = None,
                vocab: int | None = None) -> tuple[Qwen3Config, HeadConfig]:
  """The preset's target (shrunk to `layers` / `vocab` when given) and its head."""
  config = preset.config
  if layers is not None:
    config = dataclasses.replace(config, num_hidden_layers=layers)
  if vocab is not None:
    config = dataclasses.replace(config, vocab_size=vocab)
  if config.num_hidden_layers < 2 or config.vocab_size < 2:
    raise InputError("--layers and --vocab must be >= 2 (a head taps a layer below the last)")
  # A shrunk target keeps as many of the preset's taps as still sit below its last layer.
  taps = tuple(sorted({min(t, config.num_hidden_layers - 2) for t in preset.taps}))
  mask_id = preset.mask_token_id if preset.mask_token_id < config.vocab_size else (
      config.vocab_size - 1)
  head_config = HeadConfig.for_target(config, num_layers=preset.head_layers,
                                      target_layer_ids=taps, block_size=preset.block_size,
                                      mask_token_id=mask_id)
  head_config.validate_for(config)
  return config, head_config


def make_plan(args: argparse.Namespace) -> Plan:
  """Preset defaults overridden by flags; raises InputError on anything unusable."""
  preset = PRESETS[args.preset]
  if args.device_kind and not args.floor_only:
    raise InputError("--device-kind is for --floor-only (a measuring run uses its own device)")
  if (preset.needs_gpu and not args.floor_only and jax.default_backend() == "cpu"
      and not args.allow_cpu):
    raise InputError(f"the {args.preset} preset needs a GPU but jax's backend is cpu; install "
                     "jax with CUDA (pip install -e '.[cuda12]') or pass --allow-cpu")
  config, head_config = preset_pair(preset, args.layers, args.vocab)

  lengths = parse_ints(args.lengths, "--lengths") if args.lengths else preset.lengths
  if min(lengths) < 2:
    raise InputError("--lengths must be >= 2 (one prompt token plus the first new one)")
  budgets = parse_ints(args.budgets, "--budgets") if args.budgets else preset.budgets
  attention = (tuple(a.strip() for a in args.attention.split(",") if a.strip())
               if args.attention else preset.attention)
  if not attention or any(a not in IMPLS for a in attention):
    raise InputError(f"--attention must list impls from {', '.join(IMPLS)} (got "
                     f"{args.attention!r})")
  repeats = preset.repeats if args.repeats is None else args.repeats
  if repeats < 1 or args.loop_rounds < 1:
    raise InputError("--repeats and --loop-rounds must be >= 1")
  batches = tuple(dict.fromkeys(parse_ints(args.batch, "--batch"))) if args.batch else (
      preset.batches)
  if len(batches) > 1 and not args.floor_only:
    raise InputError("a measuring run takes one --batch (each compiles its own executables); "
                     "run once per batch size, or pass --floor-only")
  loop_budget = args.loop_budget or max([n for n in budgets if n <= 64] or [min(budgets)])
  for n in sorted(set(budgets) | {loop_budget}):
    validate_tree_args(head_config.depth, config.vocab_size, n, args.top_k)
  suffix = "" if batches == (1,) else f"_b{batches[0]}"
  name = (f"floor_{args.preset}.json" if args.floor_only
          else f"step_costs_{args.preset}{suffix}.json")
  out = args.out or os.path.join(ROOT, "bench", "results", name)
  return Plan(args.preset, config, head_config, preset.dtype, tuple(dict.fromkeys(lengths)),
              tuple(dict.fromkeys(budgets)), tuple(dict.fromkeys(attention)), repeats,
              args.top_k, batches, args.loop_rounds, loop_budget, args.seed, out)


# --- the timed functions (each jitted once per shape; compiled ahead of time below) ---

def greedy_rows(prompt_bt, prompt_lengths_b, max_new, seed: int):
  """`prefill`'s row arguments: greedy rows without stop tokens."""
  batch = prompt_bt.shape[0]
  return (prompt_bt, prompt_lengths_b, prompt_lengths_b + max_new,
          jax.vmap(jax.random.key)(seed + jnp.arange(batch)), RowSampling.of([Greedy()] * batch),
          stop_rows([()] * batch))


@functools.partial(jax.jit, static_argnames=("config", "drafter"))
def head_forward(head_params, target_params, drafter_state, anchor_b, context_len_b, *, config,
                 drafter):
  """Per-depth draft log-probs for one block, as a round computes them."""
  return drafter.draft(head_params, target_params, config, drafter_state, anchor_b,
                       context_len_b)


@functools.partial(jax.jit, static_argnames=("config", "tap_layers", "impl"))
def verify(target_params, cache, tree, context_len_b, *, config, tap_layers, impl):
  """The round's verify: tree rows over the read-only cache, their logits, K/V and taps."""
  hidden_bnd, tree_kv, taps_bnld = forward(
      target_params, config, tree.tokens, positions_bt=context_len_b[:, None] + tree.depths,
      cache=cache, cache_index_b=context_len_b, tree_mask_btt=tree.ancestor_mask,
      tap_layers=tap_layers, impl=impl)
  return lm_logits(target_params, config, hidden_bnd), tree_kv, taps_bnld


# One round, its state donated as the device loop donates it; the AR step is the root-only one.
round_step = jax.jit(decode_round, static_argnames=("spec",), donate_argnames=("state",))


def copy_tree(tree):
  """Fresh buffers, so a donating call leaves the original usable."""
  return jax.tree.map(jnp.copy, tree)


def sample_ms(call: Callable, make_args: Callable, repeats: int, per: int = 1,
              check: Callable | None = None) -> list[float]:
  """`repeats` timed calls (ms per `per`) after one warm-up, each on fresh inputs."""
  out = jax.block_until_ready(call(*make_args()))
  if check:
    check(out)
  del out
  samples = []
  for _ in range(repeats):
    inputs = jax.block_until_ready(make_args())
    start = time.perf_counter()
    jax.block_until_ready(call(*inputs))
    samples.append((time.perf_counter() - start) * 1e3 / per)
    del inputs
  return samples


class Compiler:
  """Lowers on the calling thread and compiles on a pool, so XLA's compiles overlap."""

  def __init__(self, pool: concurrent.futures.Executor, bar: tqdm):
    self.pool, self.bar, self.jobs = pool, bar, {}

  def submit(self, key, lower: Callable[[], Any]):
    """Runs `lower` here, queues its compile; returns the `Lowered` (for its output shapes)."""
    start = time.perf_counter()
    lowered = lower()
    lower_s = time.perf_counter() - start

    def compile_():
      start = time.perf_counter()
      executable = lowered.compile()
      return executable, lower_s + time.perf_counter() - start

    self.jobs[key] = self.pool.submit(compile_)
    self.jobs[key].add_done_callback(lambda _: self.bar.update())
    return lowered

  def get(self, key):
    """(executable, seconds of lowering + compiling)."""
    return self.jobs[key].result()


def lower_all(plan: Plan, compiler: Compiler, target_abs, head_abs) -> None:
  """Lowers every executable of every length and submits its compile."""
  config, head_config = plan.config, plan.head_config
  depth, batch = head_config.depth, plan.batches[0]
  int_scalar = jax.ShapeDtypeStruct((), jnp.int32)
  drafters = {impl: HeadDrafter(head_config, plan.dtype, impl) for impl in plan.attention}
  greedy = dict(config=config, sampled=False, filtered=False)
  for length in plan.lengths:
    # Room for the loops' rounds, each committing at most depth + 1 tokens, plus one spare.
    capacity = length + (plan.loop_rounds + 1) * (depth + 1)
    rows_abs = abstract(greedy_rows(np.zeros((batch, length - 1), np.int32),
                                    np.ones((batch,), np.int32), 1, 0))
    loop_spec = RoundSpec(drafter=drafters[plan.attention[0]],
                          tree_shape=TreeShape("top_n", plan.loop_budget, plan.top_k),
                          impl=plan.attention[0], **greedy)
    spec_abs = compiler.submit((length, "spec_prefill"), lambda: prefill.lower(
        target_abs, head_abs, *rows_abs, drafter=loop_spec.drafter, slots=capacity + depth + 1,
        capacity=capacity, **greedy)).out_info
    ar_abs = compiler.submit((length, "ar_prefill"), lambda: prefill.lower(
        target_abs, None, *rows_abs, drafter=NoDrafter(), slots=capacity + 1, capacity=capacity,
        **greedy)).out_info
    ar_spec = RoundSpec(drafter=NoDrafter(), tree_shape=TreeShape("root"), **greedy)
    compiler.submit((length, "ar_step"), lambda: round_step.lower(target_abs, None, ar_abs,
                                                                  spec=ar_spec))
    context_abs = jax.ShapeDtypeStruct((batch,), jnp.int32)
    for impl, drafter in drafters.items():
      compiler.submit((length, f"head/{impl}"), lambda: head_forward.lower(
          head_abs, target_abs, spec_abs.drafter_state, context_abs, context_abs, config=config,
          drafter=drafter))
      for n in plan.budgets:
        tree_abs = jax.eval_shape(functools.partial(build_tree, budget=n, top_k=plan.top_k),
                                  jax.ShapeDtypeStruct((batch, depth, config.vocab_size),
                                                       jnp.float32))
        compiler.submit((length, f"verify/{impl}/{n}"), lambda: verify.lower(
            target_abs, spec_abs.cache, tree_abs, context_abs, config=config,
            tap_layers=drafter.tap_layers, impl=impl))
        round_spec = RoundSpec(drafter=drafter, impl=impl,
                               tree_shape=TreeShape("top_n", n, plan.top_k), **greedy)
        compiler.submit((length, f"round/{impl}/{n}"), lambda: round_step.lower(
            target_abs, head_abs, spec_abs, spec=round_spec))
    compiler.submit((length, "loop"), lambda: decode.lower(
        target_abs, head_abs, spec_abs, int_scalar, spec=loop_spec))


def floor_key(plan: Plan, name: str) -> str:
  """The `roofline.pieces` name of a measured piece (impl dropped; a loop's is its round's)."""
  kind, *rest = name.split("/")
  if kind in ("device_loop", "host_loop"):
    return f"round/{plan.loop_budget}"
  return "/".join([kind, *rest[1:]])


def floor_costs(plan: Plan, batch: int, length: int) -> dict[str, roofline.Cost]:
  """The roofline's cost of every piece (and of the loops' round) at one batch and length."""
  budgets = tuple(dict.fromkeys(plan.budgets + (plan.loop_budget,)))
  return roofline.pieces(plan.config, plan.head_config, plan.dtype, batch, length, budgets)


def measure_length(plan: Plan, compiler: Compiler, length: int, params, rng: np.random.Generator,
                   bar: tqdm, device: roofline.Device | None) -> dict:
  """Prefills one committed length and times every piece; returns its JSON record, each piece
  with its floor on `device` (None: unknown) and measured / floor."""
  target_params, head_params = params
  config, depth, batch = plan.config, plan.head_config.depth, plan.batches[0]
  pieces, compile_s = {}, {}
  costs = floor_costs(plan, batch, length)

  def record(name, samples, executable=None):
    ms = statistics.median(samples)
    floor = roofline.summary(costs[floor_key(plan, name)], device)
    pieces[name] = dict(
        ms=ms, samples_ms=samples, compile_s=compiler.get((length, executable or name))[1],
        **floor, measured_over_floor=None if floor["floor_ms"] is None else ms / floor["floor_ms"])
    bar.update()

  prompt_bt = rng.integers(0, config.vocab_size, (batch, length - 1)).astype(np.int32)
  prompt_lengths_b = np.full((batch,), length - 1, np.int32)
  max_new = np.int32(10 * length)  # never the limit: rows stop only at capacity, out of reach
  rows = greedy_rows(prompt_bt, prompt_lengths_b, max_new, plan.seed)
  spec_prefill, compile_s["spec_prefill"] = compiler.get((length, "spec_prefill"))
  spec_state = jax.block_until_ready(spec_prefill(target_params, head_params, *rows))
  ar_prefill, compile_s["ar_prefill"] = compiler.get((length, "ar_prefill"))
  ar_state = jax.block_until_ready(ar_prefill(target_params, None, *rows))
  context_len_b = spec_state.lengths_b - 1
  anchor_b = spec_state.tokens_bs[jnp.arange(batch), context_len_b]

  step = compiler.get((length, "ar_step"))[0]
  record("ar_step", sample_ms(step, lambda: (target_params, None, copy_tree(ar_state)),
                              plan.repeats))
  trees = {}
  for n in plan.budgets:
    logprobs_bdv = jax.nn.log_softmax(
        3.0 * jax.random.normal(jax.random.key(plan.seed + n), (batch, depth, config.vocab_size)),
        axis=-1)
    tree = build_tree(logprobs_bdv, n, plan.top_k)
    trees[n] = jax.block_until_ready(tree.replace(tokens=tree.tokens.at[:, 0].set(anchor_b)))
  for impl in plan.attention:
    head = compiler.get((length, f"head/{impl}"))[0]
    record(f"head/{impl}", sample_ms(
        head, lambda: (head_params, target_params, spec_state.drafter_state, anchor_b,
                       context_len_b), plan.repeats))
    for n in plan.budgets:
      run = compiler.get((length, f"verify/{impl}/{n}"))[0]
      record(f"verify/{impl}/{n}", sample_ms(
          run, lambda: (target_params, spec_state.cache, trees[n], context_len_b), plan.repeats))
      run = compiler.get((length, f"round/{impl}/{n}"))[0]
      record(f"round/{impl}/{n}", sample_ms(
          run, lambda: (target_params, head_params, copy_tree(spec_state)), plan.repeats))

  loop = compiler.get((length, "loop"))[0]
  rounds = plan.loop_rounds

  def check_rounds(state):
    done = int(jax.device_get(state.rounds_b).min())
    if done != rounds:
      raise RuntimeError(f"the loop ran {done} rounds, not {rounds}: a row finished early")

  def host_loop(target_params, head_params, state):
    for _ in range(rounds):
      state = loop(target_params, head_params, state, np.int32(1))
      if jax.device_get(state.done_b).all():  # a streaming loop's sync point, every round
        break
    return state

  fresh = lambda: (target_params, head_params, copy_tree(spec_state))
  record("device_loop", sample_ms(lambda *a: loop(*a, np.int32(rounds)), fresh, plan.repeats,
                                  rounds, check_rounds), "loop")
  record("host_loop", sample_ms(host_loop, fresh, plan.repeats, rounds, check_rounds), "loop")
  return dict(committed_length=length, batch=batch, cache_slots=int(spec_state.cache.size),
              pieces=pieces, prefill_compile_s=compile_s)


def add_ratios(plan: Plan, result: dict) -> None:
  """Ratios and target checks of one length's pieces, added to its record."""
  ms = {name: piece["ms"] for name, piece in result["pieces"].items()}
  ar = ms["ar_step"]
  ratios, targets = {}, []
  for impl in plan.attention:
    head = ms[f"head/{impl}"]
    ratios[f"head/ar_step/{impl}"] = head / ar
    for n in plan.budgets:
      verify_ms = ms[f"verify/{impl}/{n}"]
      ratios[f"round/(head+verify)/{impl}/{n}"] = ms[f"round/{impl}/{n}"] / (head + verify_ms)
      ratios[f"verify/ar_step/{impl}/{n}"] = verify_ms / ar
    top = max(plan.budgets)
    targets.append(dict(name=f"verify N={top} / AR step", impl=impl, limit=VERIFY_OVER_AR_MAX,
                        value=ms[f"verify/{impl}/{top}"] / ar))
    targets.append(dict(name="head / AR step", impl=impl, limit=HEAD_OVER_AR_MAX,
                        value=head / ar))
  if set(IMPLS) <= set(plan.attention):
    worst = max(plan.budgets, key=lambda n: ms[f"verify/pallas/{n}"] / ms[f"verify/xla/{n}"])
    targets.append(dict(name=f"pallas / xla verify, worst N={worst}", impl="pallas", limit=1.0,
                        value=ms[f"verify/pallas/{worst}"] / ms[f"verify/xla/{worst}"]))
  for target in targets:
    target["pass"] = target["value"] <= target["limit"]
  result["ratios"], result["targets"] = ratios, targets


def fmt(value, spec: str) -> str:
  """A table cell: `value` formatted, or n/a for a missing floor."""
  return "n/a" if value is None else format(value, spec)


def table(plan: Plan, result: dict) -> str:
  """Markdown: rows are pieces, columns attention impls (AR step and loops use no tree kernel),
  then the piece's bytes, FLOPs and floor, and each impl's measured / floor."""
  pieces, ratios = result["pieces"], result["ratios"]
  impls = plan.attention
  # (label, piece name per impl) for timed pieces, (label, value per impl) for ratios.
  timed = [("AR step (ms)", {i: "ar_step" for i in impls}),
           ("head forward (ms)", {i: f"head/{i}" for i in impls})]
  timed += [(f"verify N={n} (ms)", {i: f"verify/{i}/{n}" for i in impls}) for n in plan.budgets]
  timed += [(f"round N={n} (ms)", {i: f"round/{i}/{n}" for i in impls}) for n in plan.budgets]
  derived = [(f"round / (head + verify) N={n}", {i: ratios[f"round/(head+verify)/{i}/{n}"]
                                                 for i in impls}) for n in plan.budgets]
  derived += [(f"verify / AR step N={n}", {i: ratios[f"verify/ar_step/{i}/{n}"] for i in impls})
              for n in plan.budgets]
  derived.append(("head / AR step", {i: ratios[f"head/ar_step/{i}"] for i in impls}))
  loop = f"N={plan.loop_budget}, R={plan.loop_rounds}"
  loops = [(f"device loop {loop} (ms/round)", {impls[0]: "device_loop"}),
           (f"host loop {loop} (ms/round)", {impls[0]: "host_loop"})]
  lines = [f"committed length {result['committed_length']}, batch {result['batch']} "
           f"(cache buffer {result['cache_slots']} slots)", "",
           "| piece | " + " | ".join(impls) + " | GB | GFLOP | floor (ms) | "
           + " | ".join(f"{i} / floor" for i in impls) + " |",
           "|---|" + "---:|" * (2 * len(impls) + 3)]

  def timed_line(label, names):
    first = pieces[next(iter(names.values()))]  # bytes, FLOPs and floor are the impls' own
    cells = [f"{pieces[names[i]]['ms']:.3f}" if i in names else "" for i in impls]
    cells += [f"{first['bytes'] / 1e9:.4g}", f"{first['flops'] / 1e9:.4g}",
              fmt(first["floor_ms"], ".3f")]
    cells += [fmt(pieces[names[i]]["measured_over_floor"], ".2f") if i in names else ""
              for i in impls]
    return f"| {label} | " + " | ".join(cells) + " |"

  lines += [timed_line(label, names) for label, names in timed]
  for label, values in derived:
    cells = [f"{values[i]:.3f}" for i in impls] + [""] * (3 + len(impls))
    lines.append(f"| {label} | " + " | ".join(cells) + " |")
  lines += [timed_line(label, names) for label, names in loops]
  lines += ["", "targets (set for Qwen3-8B on a GPU):"]
  for t in result["targets"]:
    lines.append(f"- {t['name']} [{t['impl']}]: {t['value']:.3f} "
                 f"(limit {t['limit']:g}) {'pass' if t['pass'] else 'MISS'}")
  return "\n".join(lines)


def floor_record(plan: Plan, kinds: list[str]) -> dict:
  """`--floor-only`: every piece's bytes, FLOPs and floor on each device, per batch and length."""
  devices = {}
  for kind in kinds:
    device = roofline.device_for(kind)
    devices[kind] = dict(
        entry=dataclasses.asdict(device) if device else None,
        batches={str(b): {str(s): {name: roofline.summary(cost, device)
                                   for name, cost in floor_costs(plan, b, s).items()}
                          for s in plan.lengths} for b in plan.batches})
  return dict(preset=plan.preset_name, dtype=jnp.dtype(plan.dtype).name,
              config=dataclasses.asdict(plan.config),
              head_config=dataclasses.asdict(plan.head_config), top_k=plan.top_k,
              budgets=list(plan.budgets), batches=list(plan.batches),
              lengths=list(plan.lengths), loop_budget=plan.loop_budget, devices=devices)


def floor_table(record: dict, kind: str, batch: str) -> str:
  """Markdown of one device and batch: rows are pieces, columns each length's GB, TFLOP, ms."""
  lengths = record["devices"][kind]["batches"][batch]
  entry = record["devices"][kind]["entry"]
  peaks = (f"{entry['name']}: {entry['hbm_bytes_per_s'] / 1e12:g} TB/s, "
           f"{entry['flops_per_s'] / 1e12:g} TFLOP/s dense bf16" if entry else "not in the table")
  lines = [f"{kind} ({peaks}), batch {batch}", "",
           "| piece | " + " | ".join(f"S={s}: GB | TFLOP | floor (ms)" for s in lengths) + " |",
           "|---|" + "---:|" * (3 * len(lengths))]
  for name in next(iter(lengths.values())):
    cells = []
    for pieces in lengths.values():
      p = pieces[name]
      bound = f" ({p['bound']})" if p["bound"] else ""
      cells += [f"{p['bytes'] / 1e9:.3f}", f"{p['flops'] / 1e12:.3f}",
                fmt(p["floor_ms"], ".3f") + bound]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def run(plan: Plan) -> dict:
  """Compiles everything, then measures every length; returns the JSON record."""
  config, head_config = plan.config, plan.head_config
  if "pallas" in plan.attention and jax.default_backend() == "cpu":
    print("warning: pallas runs in interpret mode on CPU; its times say nothing about a GPU",
          file=sys.stderr)
  start = time.perf_counter()
  target_key, head_key = jax.random.split(jax.random.key(plan.seed))
  workers = min(8, max(2, (os.cpu_count() or 2) // 2))
  num_compiles = len(plan.lengths) * (4 + len(plan.attention) * (1 + 2 * len(plan.budgets)))
  with concurrent.futures.ThreadPoolExecutor(workers) as pool, \
      tqdm(total=num_compiles, desc="compile", unit="exe") as compile_bar:
    # Params are made on the default device while the main thread lowers.
    # Kernels stored as decoding on this backend stores them (`pair.load_pair`).
    layout = decode_kernel_layout()
    params_future = pool.submit(lambda: jax.block_until_ready((
        with_kernel_layout(init_params(config, target_key, plan.dtype), layout),
        with_kernel_layout(init_head_params(head_config, head_key, plan.dtype), layout))))
    compiler = Compiler(pool, compile_bar)
    target_abs = abstract_params(config, plan.dtype, layout)
    head_abs = jax.eval_shape(lambda: with_kernel_layout(
        init_head_params(head_config, jax.random.key(0), plan.dtype), layout))
    lower_all(plan, compiler, target_abs, head_abs)
    params = params_future.result()
    for job in compiler.jobs.values():
      job.result()
    compile_wall_s = time.perf_counter() - start

  measure_start = time.perf_counter()
  rng = np.random.default_rng(plan.seed)
  num_pieces = len(plan.lengths) * (3 + len(plan.attention) * (1 + 2 * len(plan.budgets)))
  results = {}
  device = jax.devices()[0]
  kind = getattr(device, "device_kind", str(device))
  # On the CPU, its own measured rates (roofline.host_device: measured once, then read).
  floor_device = roofline.host_device() if device.platform == "cpu" else roofline.device_for(kind)
  with tqdm(total=num_pieces, desc="measure", unit="piece") as bar:
    for length in plan.lengths:
      results[str(length)] = measure_length(plan, compiler, length, params, rng, bar,
                                            floor_device)
      add_ratios(plan, results[str(length)])
  return dict(
      preset=plan.preset_name, backend=jax.default_backend(), device=kind,
      floor_device=dataclasses.asdict(floor_device) if floor_device else None,
      batch=plan.batches[0], jax_version=jax.__version__,
      dtype=jnp.dtype(plan.dtype).name, kernel_layout=layout, config=dataclasses.asdict(config),
      head_config=dataclasses.asdict(head_config), budgets=list(plan.budgets),
      attention=list(plan.attention), repeats=plan.repeats, top_k=plan.top_k,
      loop=dict(rounds=plan.loop_rounds, budget=plan.loop_budget, attention=plan.attention[0]),
      compile_workers=workers, compile_wall_s=compile_wall_s,
      measure_wall_s=time.perf_counter() - measure_start,
      wall_s=time.perf_counter() - start, lengths=results)


def main(argv=None) -> None:
  args = parse_args(argv)

  def floors():
    plan = make_plan(args)
    kinds = ([k.strip() for k in args.device_kind.split(",") if k.strip()] if args.device_kind
             else [jax.devices()[0].device_kind])
    unknown = [k for k in kinds if roofline.device_for(k) is None]
    if unknown:
      raise InputError(f"no peaks known for device kind(s) {unknown}; --device-kind takes e.g. "
                       f"'NVIDIA H200' or a table name: {', '.join(roofline.DEVICES)}")
    record = floor_record(plan, kinds)
    print(f"{plan.preset_name} floors ({record['dtype']}, top-k {plan.top_k}, loops' round "
          f"N={plan.loop_budget}): max(bytes / HBM bandwidth, FLOPs / dense bf16 peak); a "
          "round's is the sum of its head's, verify's and commit's")
    for kind in kinds:
      for batch in record["devices"][kind]["batches"]:
        print()
        print(floor_table(record, kind, batch))
    write(plan.out, record)

  def write(path, record):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
      json.dump(record, f, indent=1, default=str)
    print(f"\nwrote {path}")

  def bench():
    plan = make_plan(args)
    if args.compile_cache:
      jax.config.update("jax_compilation_cache_dir", args.compile_cache)
    record = run(plan)
    print(f"{plan.preset_name}: {record['device']} ({record['backend']}), "
          f"{record['dtype']}, median of {plan.repeats} after a warm-up; compile "
          f"{record['compile_wall_s']:.1f} s on {record['compile_workers']} threads, "
          f"measure {record['measure_wall_s']:.1f} s")
    for length in plan.lengths:
      print()
      print(table(plan, record["lengths"][str(length)]))
    write(plan.out, record)

  cli.run(floors if args.floor_only else bench)


if __name__ == "__main__":
  main()
