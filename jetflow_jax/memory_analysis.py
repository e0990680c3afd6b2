"""Memory of a computation compiled ahead of time, as XLA accounts for it: the buffers live at
its peak, read from the dump XLA writes while compiling, and fake host devices for a mesh larger
than the machine. `train.py --memory_report` (`train/memory_report.py`) and
`decode.py --memory_report` (`decode_memory.py`) both read their compiles through it.
"""

from __future__ import annotations

import glob
import math
import os
import re
import sys

import jax
import jax.numpy as jnp

from jetflow_jax.errors import ConfigError

_REEXEC_MARK = "JETFLOW_MEMORY_REPORT_REEXEC"
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
                "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


# Buffers are assigned before code generation, so sizing a program needs no optimized machine
# code: these halve a CPU compile and leave its memory analysis as it is.
SIZING_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def use_host_devices(count: int) -> None:
  """Makes jax start with `count` CPU devices; JAX_PLATFORMS, when set, still picks the platform.

  Backend options only take effect before jax's first backend call. When that call
  already happened with fewer devices, the process re-executes itself with
  `XLA_FLAGS=--xla_force_host_platform_device_count=N`, once.
  """
  try:
    jax.config.update("jax_num_cpu_devices", count)  # raises once backends are up
  except RuntimeError:
    if len(jax.devices()) >= count:
      return
    if os.environ.get(_REEXEC_MARK) or not os.path.isfile(sys.argv[0]):
      raise ConfigError(f"the mesh needs {count} devices but jax started with "
                        f"{len(jax.devices())}; start it with JAX_PLATFORMS=cpu "
                        f"XLA_FLAGS=--xla_force_host_platform_device_count={count}")
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                   os.environ.get("XLA_FLAGS", ""))
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{_REEXEC_MARK: "1"},
               XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={count}".strip())
    print(f"memory report: re-running on {count} host CPU devices", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)
  if not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", "cpu")


def per_device_bytes(tree) -> int:
  """Bytes one device holds of a tree of sharded arrays or abstract values."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree))


def _strip_layout(shape: str) -> str:
  return re.sub(r"\{[^{}]*\}", "", shape)


def _shape_bytes(shape: str) -> int:
  match = re.fullmatch(r"(\w+)\[([\d,]*)\]", shape)
  if not match:
    return 0
  dims = [int(d) for d in match.group(2).split(",") if d]
  return _DTYPE_BYTES.get(match.group(1), 4) * math.prod(dims)


def _hlo_ops(hlo_text: str) -> dict[str, tuple[str, str]]:
  """Instruction name -> (result shape, jax op name) over every computation of an HLO module.

  XLA leaves some fusions and copies without metadata; they borrow the op name of the
  computation they call, else of their first named operand.
  """
  shapes, names, calls, operands, first_in = {}, {}, {}, {}, {}
  computation = None
  for line in hlo_text.splitlines():
    if " = " not in line and line.rstrip().endswith("{"):
      header = re.match(r"\s*(?:ENTRY\s+)?%?([\w.\-]+)", line)
      computation = header.group(1) if header else None
      continue
    match = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+) = (\S+) [\w\-]+\(([^)]*)\)", line)
    if not match:
      continue
    name = match.group(1)
    op = re.search(r'op_name="((?:[^"\\]|\\.)*)"', line)
    names[name] = (re.sub(r"^jit\([\w.]+\)/", "", op.group(1).replace("\\'", "'")
                          .replace('\\"', '"')) if op else "")
    shapes[name] = _strip_layout(match.group(2))
    operands[name] = re.findall(r"%([\w.\-]+)", match.group(3))
    called = re.search(r"calls=%([\w.\-]+)", line)
    if called:
      calls[name] = called.group(1)
    if computation and names[name]:
      first_in.setdefault(computation, names[name])
  resolve = lambda n: (names[n] or first_in.get(calls.get(n), "")
                       or next((names[o] for o in operands[n] if names.get(o)), ""))
  return {n: (shapes[n], resolve(n)) for n in names}


def _allocation_kind(header: str) -> str:
  """What an allocation of a buffer-assignment dump holds, from its header line."""
  if "parameter" in header:
    return "argument"
  if "output shape" in header or "maybe-live-out" in header:
    return "output"  # outputs that do not reuse a donated argument
  if "thread-local" in header or "constant" in header:
    return "thread-local" if "thread-local" in header else "constant"
  return "temporary"


def _buffer_assignment(text: str) -> tuple[dict[str, tuple[str, str]], dict[str, int]]:
  """From a `*-buffer-assignment.txt` dump: value name -> (kind, shape), and bytes per kind."""
  values, totals, kind = {}, {}, "temporary"
  for line in text.splitlines():
    header = re.match(r"allocation \d+: size (\d+), (.*)$", line)
    if header:
      kind = _allocation_kind(header.group(2))
      totals[kind] = totals.get(kind, 0) + int(header.group(1))
      continue
    value = re.match(r"\s*value: <\d+ (\S+) @\d+> \(size=\d+,offset=\d+\): (.+)$", line)
    if value:
      values[value.group(1)] = (kind, _strip_layout(value.group(2).strip()))
  return values, totals


def _peak_live(live_range_text: str) -> list[tuple[str, int]]:
  """(value name, bytes) of every buffer live at the peak, from a `*-live-range.txt` dump."""
  live, inside = [], False
  for line in live_range_text.splitlines():
    if re.match(r"\s*Live ranges at \d+ \(peak\):", line):
      inside = True
      continue
    entry = re.match(r"\s*(\S+): (\d+) bytes", line) if inside else None
    if inside and not entry:
      break
    if entry:
      live.append((entry.group(1), int(entry.group(2))))
  return live


def _read_dump(dump_dir: str, suffix: str, module: str) -> str:
  paths = sorted(glob.glob(os.path.join(dump_dir, f"*{module}*after_optimizations{suffix}")))
  if not paths:
    return ""
  with open(paths[-1]) as f:
    return f.read()


def _upcast_shapes(bf16_arguments) -> set[str]:
  """f32 shapes of every bf16 leaf (weights, caches): whole, per-device shard, and transposed."""
  shapes = set()
  for leaf in jax.tree.leaves(bf16_arguments):
    if leaf.dtype != jnp.bfloat16:
      continue
    sharding = getattr(leaf, "sharding", None)
    for dims in {leaf.shape, sharding.shard_shape(leaf.shape) if sharding else leaf.shape}:
      for order in (dims, dims[::-1]):
        shapes.add(f"f32[{','.join(map(str, order))}]")
  return shapes


def read_buffers(dump_dir: str, hlo_text: str, bf16_arguments, limit: int, module: str) -> dict:
  """XLA's own account of the buffers of one compiled function (`module`: its jit name, e.g.
  `jit_train_step`), from the dump it wrote while compiling.

  `largest_buffers`: the biggest buffers live at the peak of XLA's live ranges (without
  the dump, the largest result shapes of the optimized HLO, live or not), each flagged when
  it is a float32 copy of a bf16 leaf of `bf16_arguments` (XLA on CPU upcasts dot operands);
  `peak_live_bytes`: everything live at that peak; `allocation_bytes`: the buffer
  assignment's allocations summed by kind (empty when not dumped), a second account of
  `memory_analysis()` that also shows thread-local scratch and constants.
  """
  ops = _hlo_ops(_read_dump(dump_dir, ".txt", module) or hlo_text)
  values, allocations = _buffer_assignment(_read_dump(dump_dir, "-buffer-assignment.txt",
                                                      module))
  live = _peak_live(_read_dump(dump_dir, "-live-range.txt", module))
  upcast = _upcast_shapes(bf16_arguments)
  rows = []
  for name, size in live:
    bare = name[:-2] if name.endswith("{}") else name
    kind, shape = values.get(name) or values.get(bare) or ("temporary", ops.get(bare, ("?",))[0])
    rows.append({"name": bare, "kind": kind, "shape": shape, "bytes": size,
                 "op": ops.get(re.sub(r"\{[\d,]*\}$", "", bare), ("", ""))[1],
                 "f32_copy_of_bf16_param": kind == "temporary" and shape in upcast})
  if not live:
    for name, (shape, op) in ops.items():
      rows.append({"name": name, "kind": "hlo value", "shape": shape, "bytes": _shape_bytes(shape),
                   "op": op, "f32_copy_of_bf16_param": shape in upcast})
  rows.sort(key=lambda r: -r["bytes"])
  return {"largest_buffers": rows[:limit], "peak_live_bytes": sum(size for _, size in live),
          "allocation_bytes": allocations}
