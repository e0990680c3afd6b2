"""Kernels per decode round, from the compiled device loop, and optionally a profiler trace.

Run from the repository root:

  python bench/profile_round.py                          # tiny random pair, float32, CPU
  python bench/profile_round.py --preset qwen3-8b --trace /tmp/round_trace   # on a GPU
  python bench/profile_round.py --budget 256 --batch 8 --length 4096 --out OUT.json

Two rounds are compiled at the same shapes, each as the device loop runs it
(`decoding.loop.decode`, one `lax.while_loop` of `decode_round`): AR (`TreeShape("root")` with
`NoDrafter`, XLA attention, as `bench/step_costs.py`'s AR step) and JetFlow (the head drafter, the
exact top-N tree of `--budget` nodes, `--attention`). Params are random (bfloat16 for
qwen3-8b, made on the device); a round's kernels depend on shapes only.

How kernels are counted: in the optimized HLO of the compiled loop (`compiled.as_text()`), the
round is the body and condition of the entry computation's `while` (the largest one, should
XLA keep another there). Each instruction of those computations is one kernel launch, except
those that launch nothing (parameters, constants, tuples and their elements, bitcasts, ...):
a `fusion` counts once, whatever it fuses; a `custom-call` (cuBLAS, Triton, a Pallas kernel)
once; an op XLA left unfused once. A `call` (e.g. a GPU command buffer) counts the kernels of
what it calls; a `conditional` those of its largest branch; a nested `while` (the length-bounded
attention loops) those of its body and condition once each, since its trip count is a runtime
value: so the counts are launches per round when every nested loop runs once, and
`nested_loops` says how many such loops a round holds. Work outside the loop (once per call,
not per round) is `outside_loop`.

With `--trace DIR`, each loop also runs `--trace-rounds` rounds (after a warm-up) under
`jax.profiler.trace(DIR/<method>)`; the JSON gives the trace folders (open them in Perfetto or
TensorBoard's profile plugin; module.hlo beside each names its kernels) and `time_by_op`:
where a round's time went, summed from the trace's per-kernel events and grouped by the source
they came from (the round's named scope and Flax module path, layers folded together:
`verify/Qwen3/layers_*/mlp/down_proj`), with each group's busiest opcode. `wall_ms_per_round`
is the loop's own clock; kernels that run on several host threads at once can add up to more.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # measure this checkout's jetflow_jax

import jax
import jax.numpy as jnp
import numpy as np

import step_costs  # bench/ is on sys.path: Python puts a script's own folder first
from jetflow_jax import cli
from jetflow_jax.decoding.loop import decode
from jetflow_jax.decoding.prefill import prefill
from jetflow_jax.decoding.round import RoundSpec, TreeShape
from jetflow_jax.drafters import HeadDrafter, NoDrafter
from jetflow_jax.errors import InputError
from jetflow_jax.head import init_head_params
from jetflow_jax.model import (abstract_params, decode_kernel_layout, init_params,
                               with_kernel_layout)
from jetflow_jax.partitioning import abstract
from jetflow_jax.tree import validate_tree_args


@dataclasses.dataclass(frozen=True)
class Shapes:
  """A preset of `step_costs.PRESETS`, shrunk where given, and the default committed length."""

  base: str
  length: int
  layers: int | None = None
  vocab: int | None = None


PRESETS = {"tiny": Shapes("cpu-small", 64, layers=2, vocab=512),
           "qwen3-0.6b": Shapes("qwen3-0.6b", 512),
           "qwen3-8b": Shapes("qwen3-8b", 4096)}

# Opcodes that launch no kernel of their own.
NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
             "opt-barrier", "partition-id", "replica-id", "add-dependency", "domain"}
_LOOP_PARTS = ("while", "body", "cond")
_CONTAINERS = ("while", "call", "conditional")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = (.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_CALLED = re.compile(r"\b(calls|to_apply|body|condition|branch_computations|true_computation|"
                     r"false_computation)=(\{[^}]*\}|%?[\w.\-]+)")


@dataclasses.dataclass
class Instruction:
  opcode: str
  called: dict[str, list[str]]  # attribute -> computation names


def _opcode(rhs: str) -> str:
  """The opcode of `SHAPE OPCODE(operands), attrs` (a tuple shape holds parentheses)."""
  if rhs.startswith("("):
    depth = 0
    for i, ch in enumerate(rhs):
      depth += {"(": 1, ")": -1}.get(ch, 0)
      if depth == 0:
        rhs = rhs[i + 1:]
        break
  else:
    rhs = rhs.split(" ", 1)[1]
  return rhs.strip().split("(", 1)[0]


def parse_hlo(text: str) -> tuple[dict[str, list[Instruction]], str]:
  """Computations of an HLO module's text, by name, and the entry computation's name."""
  computations, entry, current = {}, None, None
  for line in text.splitlines():
    if current is None:
      match = _HEADER.match(line)
      if match and "->" in line:
        current = computations.setdefault(match.group(1), [])
        entry = match.group(1) if line.startswith("ENTRY") else entry
      continue
    if line.startswith("}"):
      current = None
      continue
    if " = " not in line:
      continue
    rhs = line.split(" = ", 1)[1]
    called = {name: [c.strip().lstrip("%") for c in value.strip("{}").split(",") if c.strip()]
              for name, value in _CALLED.findall(rhs)}
    current.append(Instruction(_opcode(rhs), called))
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return computations, entry


def count_kernels(computations, name: str, counts: collections.Counter) -> int:
  """Adds the kernels one run of computation `name` launches to `counts` (by opcode; nested
  loops under "nested_loops"); returns how many."""
  total = 0
  for inst in computations[name]:
    if inst.opcode in NO_KERNEL or inst.opcode.endswith("-done"):  # a -done only waits
      continue
    if inst.opcode == "while":
      counts["nested_loops"] += 1
      total += sum(count_kernels(computations, inst.called[k][0], counts)
                   for k in ("body", "condition"))
    elif inst.opcode == "call":
      total += count_kernels(computations, inst.called["to_apply"][0], counts)
    elif inst.opcode == "conditional":
      branches = (inst.called.get("branch_computations")
                  or inst.called.get("true_computation", []) + inst.called.get(
                      "false_computation", []))
      tries = []
      for branch in branches:
        trial = collections.Counter()
        tries.append((count_kernels(computations, branch, trial), trial))
      best, trial = max(tries, key=lambda t: t[0])
      counts.update(trial)
      total += best
    else:
      counts[inst.opcode] += 1
      total += 1
  return total


def round_kernels(hlo_text: str) -> dict:
  """Kernels per round of a compiled device loop (the module docstring says how)."""
  computations, entry = parse_hlo(hlo_text)
  loops = [inst for inst in computations[entry] if inst.opcode == "while"]
  if not loops:
    raise ValueError("the entry computation holds no while loop")
  sized = []
  for inst in loops:
    counts = collections.Counter()
    total = sum(count_kernels(computations, inst.called[k][0], counts)
                for k in ("body", "condition"))
    sized.append((total, counts))
  total, counts = max(sized, key=lambda t: t[0])
  everything = count_kernels(computations, entry, collections.Counter())
  nested = counts.pop("nested_loops", 0)
  return dict(kernels=total, nested_loops=nested, by_opcode=dict(counts.most_common()),
              outside_loop=everything - sum(t for t, _ in sized))


def source_of(op_name: str) -> str:
  """`jit(decode)/while/body/verify/Qwen3/layers_3/mlp/down_proj/dot_general` ->
  `verify/Qwen3/layers_*/mlp/down_proj`: the scope and module path, primitive and jits dropped."""
  parts = [part for part in op_name.split("/") if part
           and not part.startswith(("jit(", "vmap(", "checkpoint")) and part not in _LOOP_PARTS]
  return re.sub(r"layers_\d+", "layers_*", "/".join(parts[:-1]) or "(top level)")


def time_by_op(trace_path: str, hlo_text: str, rounds: int, top: int = 15) -> list[dict]:
  """Kernel time per round from a perfetto trace under `trace_path`, grouped by `source_of`
  each instruction of the compiled module `hlo_text`; the `top` largest groups first."""
  sources, opcodes = {}, {}
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    name, rhs = match.groups()
    opcodes[name] = _opcode(rhs)
    named = _OP_NAME.search(rhs)
    # XLA's own rewrites (a canonicalized dot, say) carry no source: named by opcode and shape.
    sources[name] = (source_of(named.group(1)) if named
                     else f"({opcodes[name]} {rhs.split(' ', 1)[0].split('{')[0]})")
  paths = glob.glob(os.path.join(trace_path, "**", "*.trace.json.gz"), recursive=True)
  if not paths:
    raise FileNotFoundError(f"no perfetto trace under {trace_path}")
  with gzip.open(max(paths, key=os.path.getmtime)) as f:
    events = json.load(f)["traceEvents"]
  us, calls, busiest = collections.Counter(), collections.Counter(), {}
  for event in events:
    name = event.get("name")
    if event.get("ph") != "X" or name not in sources or opcodes[name] in _CONTAINERS:
      continue  # a loop's or call's event spans its body's kernels, counted on their own
    source = sources[name]
    us[source] += event.get("dur", 0)
    calls[source] += 1
    by_op = busiest.setdefault(source, collections.Counter())
    by_op[opcodes[name]] += event.get("dur", 0)
  total = sum(us.values()) or 1
  return [dict(source=source, ms_per_round=t / 1e3 / rounds, share=t / total,
               kernels_per_round=calls[source] / rounds,
               busiest_opcode=busiest[source].most_common(1)[0][0])
          for source, t in us.most_common(top)]


def greedy_spec(config, drafter, tree_shape, impl: str) -> RoundSpec:
  return RoundSpec(config=config, drafter=drafter, tree_shape=tree_shape, impl=impl,
                   sampled=False, filtered=False)


def profile_round(preset: str = "tiny", budget: int = 64, top_k: int = 7, batch: int = 1,
                  length: int | None = None, attention: str | None = None,
                  trace_dir: str | None = None, trace_rounds: int = 3, seed: int = 0,
                  kernel_layout: str = "auto") -> dict:
  """Compiles the AR and the JetFlow device loop at one shape, counts each round's kernels,
  and with `trace_dir` traces `trace_rounds` rounds of each; returns the JSON record. The
  target's and head's kernels are stored in `kernel_layout` (auto: the backend's fastest,
  `model.decode_kernel_layout`)."""
  shapes = PRESETS[preset]
  base = step_costs.PRESETS[shapes.base]
  config, head_config = step_costs.preset_pair(base, shapes.layers, shapes.vocab)
  dtype, depth = base.dtype, head_config.depth
  length = length or shapes.length
  impl = attention or ("pallas" if jax.default_backend() == "gpu" else "xla")
  if length < 2 or batch < 1 or trace_rounds < 1:
    raise InputError("--length must be >= 2, --batch and --trace-rounds >= 1")
  validate_tree_args(depth, config.vocab_size, budget, top_k)
  capacity = length + (trace_rounds + 2) * (depth + 1)  # room for the traced rounds
  layout = decode_kernel_layout() if kernel_layout == "auto" else kernel_layout
  target_abs = abstract_params(config, dtype, layout)
  head_abs = jax.eval_shape(lambda: with_kernel_layout(
      init_head_params(head_config, jax.random.key(0), dtype), layout))
  prompt_bt = np.random.default_rng(seed).integers(0, config.vocab_size, (batch, length - 1))
  rows = step_costs.greedy_rows(prompt_bt.astype(np.int32), np.full((batch,), length - 1,
                                                                    np.int32),
                                np.int32(10 * capacity), seed)
  methods = {
      "ar": (NoDrafter(), TreeShape("root"), "xla", None),
      f"jetflow/{budget}": (HeadDrafter(head_config, dtype, impl),
                            TreeShape("top_n", budget, top_k), impl, head_abs)}
  params = None
  record = dict(preset=preset, backend=jax.default_backend(), device=jax.devices()[0].device_kind,
                dtype=jnp.dtype(dtype).name, kernel_layout=layout, batch=batch,
                committed_length=length, budget=budget, top_k=top_k, attention=impl, methods={})
  for name, (drafter, shape, method_impl, drafter_abs) in methods.items():
    spec = greedy_spec(config, drafter, shape, method_impl)
    start = time.perf_counter()
    prefill_kwargs = dict(config=config, drafter=drafter, slots=capacity + depth + 1,
                          capacity=capacity, sampled=False, filtered=False)
    state_abs = prefill.lower(target_abs, drafter_abs, *abstract(rows), **prefill_kwargs).out_info
    loop = decode.lower(target_abs, drafter_abs, state_abs, jax.ShapeDtypeStruct((), jnp.int32),
                        spec=spec).compile()
    entry = dict(round_kernels(loop.as_text()), compile_s=time.perf_counter() - start)
    if trace_dir:
      if params is None:
        target_key, head_key = jax.random.split(jax.random.key(seed))
        params = (with_kernel_layout(init_params(config, target_key, dtype), layout),
                  with_kernel_layout(init_head_params(head_config, head_key, dtype), layout))
      drafter_params = params[1] if drafter_abs is not None else None
      fill = prefill.lower(params[0], drafter_params, *rows, **prefill_kwargs).compile()
      fresh = lambda: fill(params[0], drafter_params, *rows)
      jax.block_until_ready(loop(params[0], drafter_params, fresh(), np.int32(1)))  # warm-up
      state = jax.block_until_ready(fresh())
      path = os.path.join(trace_dir, name.replace("/", "_"))
      with jax.profiler.trace(path, create_perfetto_trace=True):
        start = time.perf_counter()
        jax.block_until_ready(loop(params[0], drafter_params, state, np.int32(trace_rounds)))
        wall_s = time.perf_counter() - start
      hlo_text = loop.as_text()
      with open(os.path.join(path, "module.hlo"), "w") as f:  # the trace's kernels by name
        f.write(hlo_text)
      entry.update(trace=path, trace_rounds=trace_rounds,
                   wall_ms_per_round=wall_s * 1e3 / trace_rounds,
                   time_by_op=time_by_op(path, hlo_text, trace_rounds))
    record["methods"][name] = entry
  return record


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
  parser.add_argument("--budget", type=int, default=64, help="JetFlow tree budget N")
  parser.add_argument("--top-k", type=int, default=7, help="candidate children per depth")
  parser.add_argument("--batch", type=int, default=1, help="rows")
  parser.add_argument("--length", type=int, help="committed tokens per row (preset's default)")
  parser.add_argument("--attention", choices=step_costs.IMPLS,
                      help="the tree round's attention (default: pallas on a GPU, else xla)")
  parser.add_argument("--trace", help="record a jax.profiler trace of each loop under this folder")
  parser.add_argument("--trace-rounds", type=int, default=3, help="rounds traced per loop")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--kernel-layout", choices=("auto", "in_out", "out_in"), default="auto",
                      help="how projection kernels are stored (auto: the backend's fastest, "
                           "model.decode_kernel_layout)")
  parser.add_argument("--out", help="JSON path (default bench/results/profile_round_<preset>.json)")
  return parser.parse_args(argv)


def main(argv=None) -> None:
  args = parse_args(argv)

  def run():
    record = profile_round(args.preset, args.budget, args.top_k, args.batch, args.length,
                           args.attention, args.trace, args.trace_rounds, args.seed,
                           args.kernel_layout)
    print(f"{record['preset']} on {record['device']} ({record['dtype']}), batch "
          f"{record['batch']}, {record['committed_length']} committed tokens")
    for name, entry in record["methods"].items():
      top = ", ".join(f"{op} {n}" for op, n in list(entry["by_opcode"].items())[:6])
      print(f"{name}: {entry['kernels']} kernels per round ({top}); {entry['nested_loops']} "
            f"nested loops; {entry['outside_loop']} outside the loop"
            + (f"; trace in {entry['trace']}" if "trace" in entry else ""))
      if "time_by_op" in entry:
        print(f"  {entry['wall_ms_per_round']:.1f} ms a round; kernel time by source:")
        for group in entry["time_by_op"]:
          print(f"  {group['ms_per_round']:8.2f} ms {group['share']:6.1%} "
                f"{group['kernels_per_round']:6.0f}x {group['busiest_opcode']:<14} "
                f"{group['source']}")
    out = args.out or os.path.join(ROOT, "bench", "results", f"profile_round_{args.preset}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
      json.dump(record, f, indent=1)
    print(f"wrote {out}")

  cli.run(run)


if __name__ == "__main__":
  main()
