"""Per-device memory of the jitted train step, compiled ahead of time on abstract shapes.

No weights are read: the target's shape comes from its config.json, the random spec
(`target.random_init`) or the config file's `target.shape` (the published architecture),
and every argument of the step is a `jax.ShapeDtypeStruct` carrying its sharding. XLA
compiles the step exactly as `loop.train_and_evaluate` jits it and reports its buffers;
beside them sits an analytic estimate, so a reader sees which part dominates. A mesh
larger than the host runs on fake CPU devices (see `memory_analysis.use_host_devices`).
"""

from __future__ import annotations

import tempfile
import time

import jax
import jax.numpy as jnp
import ml_collections

from jetflow_jax import cli, memory_analysis, partitioning
from jetflow_jax.config import Qwen3Config
from jetflow_jax.config_files import head_config, target_shape
from jetflow_jax.errors import ConfigError, InputError
from jetflow_jax.head import split_frozen
from jetflow_jax.head_checkpoint import abstract_head_params
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.memory_analysis import per_device_bytes, read_buffers, use_host_devices
from jetflow_jax.model import abstract_params
from jetflow_jax.train.loop import build_train_step
from jetflow_jax.train.sharding import (RULES, batch_sharding, check_batch, make_mesh,
                                        param_sharding)
from jetflow_jax.train.step import TrainState

GIB = 2**30
_CPU_UPCAST_NOTE = ("XLA's CPU backend upcasts bfloat16 matmul operands to float32, so it holds "
                    "temporaries a GPU would not; buffers marked [f32 copy of bf16 param] are such "
                    "copies of frozen target weights.")


def devices_needed(config: ml_collections.ConfigDict) -> int:
  """Devices the configured mesh uses; `mesh.data=-1` counts as one data row here."""
  data, fsdp = config.mesh.data, config.mesh.fsdp
  if fsdp < 1 or not (data >= 1 or data == -1):
    raise ConfigError(f"mesh data={data} x fsdp={fsdp}: fsdp must be >= 1 and data >= 1 "
                      "(or -1)")
  return fsdp * max(data, 1)


def abstract_arguments(config: ml_collections.ConfigDict, mesh, target: Qwen3Config,
                       head: HeadConfig, optimizer) -> tuple:
  """(state, target_params, *row arrays), placed as `train_and_evaluate` places them.

  The row arrays are tokens and loss mask, and segment ids when `data.pack` is on.
  """
  place = lambda tree: partitioning.abstract(tree, param_sharding(mesh, tree))
  head_params = abstract_head_params(head)
  state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), head_params=head_params,
                     opt_state=jax.eval_shape(optimizer.init, split_frozen(head_params)[0]))
  target_params = abstract_params(target, cli.parse_dtype(config.target.dtype))
  shape_bt = (config.train.batch_size, config.data.seq_len)
  rows = batch_sharding(mesh)
  row_arrays = [jax.ShapeDtypeStruct(shape_bt, dtype, sharding=rows)
                for dtype in (jnp.int32, jnp.bool_, jnp.int32)[:3 if config.data.pack else 2]]
  return place(state), place(target_params), *row_arrays


# --- the analytic estimate ---

def analytic_estimate(config: ml_collections.ConfigDict, mesh, target: Qwen3Config,
                      head: HeadConfig, state, target_params) -> dict[str, int]:
  """Per-device bytes of the step's big parts, by formula (what dominates, not an exact sum)."""
  t = config.train
  b = t.batch_size // mesh.size
  length, anchors, depth = config.data.seq_len, t.num_anchors, head.depth
  rows = anchors * head.block_size  # packed block rows of the head forward
  keys = length + rows  # context slots + block slots
  compute = jnp.dtype(cli.parse_dtype(config.head.dtype)).itemsize
  frozen = jnp.dtype(cli.parse_dtype(config.target.dtype)).itemsize
  head_bytes = per_device_bytes(state.head_params)
  layer_bytes = max(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(layer))
                    for name, layer in target_params.items() if name.startswith("layers_"))
  loss_chunk = min(t.loss_chunk_anchors or anchors, anchors)
  heads = head.num_attention_heads
  if t.head_attention == "pallas":  # the kernel keeps a tile of scores, never the matrix
    attention = {}
  elif t.head_attention == "split" and 0 < t.attention_chunk_anchors < anchors:
    chunk_rows = t.attention_chunk_anchors * head.block_size
    # One chunk of one layer at a time; its scores, probabilities and their gradient.
    attention = {"head attention, one anchor chunk (3 x [b,N,chunk*block,T+block] f32)":
                 3 * b * heads * chunk_rows * (length + head.block_size) * 4}
  else:
    attention = {"head attention probs, all layers ([b,N,A*block,T+A*block] f32)":
                 head.num_layers * b * heads * rows * keys * 4}
  return {
      "frozen target, split (argument)": per_device_bytes(target_params),
      "frozen target, the largest layer gathered for use": layer_bytes,
      "head params, float32": head_bytes,
      "optimizer state (Adam mu, nu)": per_device_bytes(state.opt_state),
      "head gradients, float32": head_bytes,
      "logits of one loss chunk: teacher, draft, draft grad (3 x [b,chunk,k,V] f32)":
          3 * b * loss_chunk * depth * target.vocab_size * 4,
      **attention,
      "head MLP and residual activations, all layers":
          head.num_layers * b * rows * (3 * head.intermediate_size + 4 * head.hidden_size)
          * compute,
      "target attention scores, one layer ([b,N,T,T] f32)":
          b * target.num_attention_heads * length * length * 4,
      "target taps ([b,T,taps,D]) and head K/V caches (L x 2 x [b,T+A*block,K,H])":
          b * length * head.num_taps * target.hidden_size * frozen
          + head.num_layers * 2 * b * keys * head.num_key_value_heads * head.head_dim * compute,
  }


def _mesh_axes(entry) -> list[str]:
  return [] if entry is None else [entry] if isinstance(entry, str) else list(entry)


def placement(mesh, target: Qwen3Config, target_params) -> dict:
  """Which mesh axes the batch rows, the logits and the frozen target's parameters split over
  (every activation of the step keeps its rows as the batch's: `sharding.activation_layout`)."""
  rows = partitioning.spec(("batch",), RULES, mesh)
  logits = partitioning.spec(("batch", "vocab"), RULES, mesh, (None, target.vocab_size))
  leaves = jax.tree.leaves(target_params)
  nbytes = lambda xs: sum(x.size * x.dtype.itemsize for x in xs)
  return {
      "rows": _mesh_axes(rows[0] if rows else None),
      "logits_rows": _mesh_axes(logits[0] if logits else None),
      "logits_vocab": _mesh_axes(logits[1] if logits else None),
      "target_params_bytes": nbytes(leaves),
      "target_params_split_bytes": nbytes(
          x for x in leaves if x.sharding.shard_shape(x.shape) != x.shape),
  }


# --- the report ---

def job_layout(num_processes: int | None, devices_per_process: int | None,
               coordinator_address: str | None = None, process_id: int | None = None) -> dict:
  """The job `--num_processes` x `--devices_per_process` to size (no hosts needed), as kwargs
  of `memory_report`; {} sizes the configured mesh alone."""
  if coordinator_address is not None or process_id is not None:
    raise InputError("--memory_report sizes a job without joining one: give it --num_processes "
                     "and --devices_per_process, not --coordinator_address or --process_id")
  if (num_processes is None) != (devices_per_process is None):
    raise InputError("with --memory_report, --num_processes and --devices_per_process go together")
  if num_processes is None:
    return {}
  if num_processes < 1 or devices_per_process < 1:
    raise InputError(f"--num_processes={num_processes} and --devices_per_process="
                     f"{devices_per_process} must be >= 1")
  return {"num_processes": num_processes, "devices_per_process": devices_per_process}


def memory_report(config: ml_collections.ConfigDict, limit: int = 16, num_processes: int = 1,
                  devices_per_process: int | None = None) -> dict:
  """Compiles the train step for the configured mesh on abstract inputs; returns the numbers.

  With `devices_per_process`, the mesh is that of a job of `num_processes` such processes
  (`mesh.data=-1` fills it), compiled here on as many fake devices.
  """
  count = (num_processes * devices_per_process if devices_per_process
           else devices_needed(config))
  use_host_devices(count)
  target, source = target_shape(config)
  head = head_config(config, target)
  mesh = make_mesh(config.mesh.data, config.mesh.fsdp, devices=jax.devices()[:count],
                   num_processes=num_processes)
  t = config.train
  check_batch(mesh, t.batch_size, num_processes=num_processes)
  # The schedule's length does not change any shape; any positive step count compiles the same.
  optimizer, _, train_step = build_train_step(config, head, target, max(t.num_steps, 1000), mesh)
  state, target_params, *row_arrays = abstract_arguments(config, mesh, target, head, optimizer)
  start = time.perf_counter()
  with tempfile.TemporaryDirectory() as dump_dir:
    compiled = train_step.lower(state, target_params, *row_arrays).compile(
        compiler_options={"xla_dump_to": dump_dir, "xla_dump_hlo_as_text": True,
                          **memory_analysis.SIZING_OPTIONS})
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    buffers = read_buffers(dump_dir, compiled.as_text(), target_params, limit,
                           module="jit_train_step")
  arguments, outputs = stats.argument_size_in_bytes, stats.output_size_in_bytes
  aliased, temporaries = stats.alias_size_in_bytes, stats.temp_size_in_bytes
  platform = jax.devices()[0].platform
  return {
      "num_devices": mesh.size,
      "platform": platform,
      "mesh": dict(mesh.shape),
      "num_processes": num_processes,
      "devices_per_process": devices_per_process or mesh.size,
      "batch_per_process": t.batch_size // num_processes,
      "compile_seconds": round(seconds, 1),
      "target": {"source": source, "layers": target.num_hidden_layers,
                 "hidden_size": target.hidden_size, "vocab_size": target.vocab_size,
                 "num_experts": target.num_experts, "dtype": config.target.dtype},
      "head": {"layers": head.num_layers, "block_size": head.block_size, "causal": head.causal,
               "dtype": config.head.dtype},
      "batch_size": t.batch_size,
      "batch_per_device": t.batch_size // mesh.size,
      "seq_len": config.data.seq_len,
      "num_anchors": t.num_anchors,
      # Donated state: `aliased` output bytes reuse argument buffers, so they count once.
      "per_device_bytes": {"arguments": arguments, "outputs": outputs, "aliased": aliased,
                           "temporaries": temporaries,
                           "total": arguments + outputs - aliased + temporaries},
      **buffers,
      "f32_copies_of_bf16_params_bytes": sum(b["bytes"] for b in buffers["largest_buffers"]
                                             if b["f32_copy_of_bf16_param"]),
      "estimate_bytes": analytic_estimate(config, mesh, target, head, state, target_params),
      "placement": placement(mesh, target, target_params),
  }


def _size(n: int) -> str:
  return f"{n / GIB:8.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:8.2f} MiB"


def format_report(report: dict) -> str:
  """The report as text: XLA's analysis, the buffers live at its peak, the estimate."""
  r, m = report, report["per_device_bytes"]
  target, head = r["target"], r["head"]
  experts = f", {target['num_experts']} experts" if target["num_experts"] else ""
  lines = [
      f"target: {target['layers']} layers, hidden {target['hidden_size']}, vocab "
      f"{target['vocab_size']}{experts}, {target['dtype']} (from {target['source']}); head: "
      f"{head['layers']} layers, block {head['block_size']}, compute {head['dtype']}",
      f"mesh {r['mesh']} on {r['num_devices']} {r['platform']} devices; batch {r['batch_size']} "
      f"({r['batch_per_device']} per device), seq {r['seq_len']}, {r['num_anchors']} anchors; "
      f"compiled in {r['compile_seconds']:.1f} s",
  ]
  if r["num_processes"] > 1:
    per_host, fsdp = r["devices_per_process"], r["mesh"]["fsdp"]
    where = ("each fsdp group stays on one process" if per_host % fsdp == 0
             else "fsdp groups span processes: the target's all-gathers cross the network")
    lines.append(f"job: {r['num_processes']} processes x {per_host} devices, "
                 f"{r['batch_per_process']} rows of each batch per process; {where}")
  where = r["placement"]
  ways = lambda axes: " x ".join(f"{a} ({r['mesh'][a]})" for a in axes) or "nothing (replicated)"
  lines += [
      f"placement: rows of the batch and of every activation over {ways(where['rows'])}; "
      f"logits: rows over {ways(where['logits_rows'])}, vocabulary over "
      f"{ways(where['logits_vocab'])}; frozen target: "
      f"{where['target_params_split_bytes'] / max(where['target_params_bytes'], 1):.1%} of its "
      f"bytes split over {ways(['fsdp'])}",
  ]
  lines += [
      "",
      "XLA memory analysis, per device:",
      f"  arguments    {_size(m['arguments'])}",
      f"  outputs      {_size(m['outputs'])}",
      f"  aliased      {_size(m['aliased'])}  (donated state: outputs written over arguments)",
      f"  temporaries  {_size(m['temporaries'])}",
      f"  total        {_size(m['total'])}  (arguments + outputs - aliased + temporaries)",
  ]
  if r["peak_live_bytes"]:
    lines.append(f"  peak live    {_size(r['peak_live_bytes'])}  (XLA's live ranges; temporaries "
                 "share one allocation, with gaps)")
  lines += ["", "Largest buffers live at the peak:" if r["peak_live_bytes"]
            else "Largest values in the optimized HLO (no live-range dump):"]
  for b in r["largest_buffers"]:
    flag = "  [f32 copy of bf16 param]" if b["f32_copy_of_bf16_param"] else ""
    op = b["op"] if len(b["op"]) <= 64 else "..." + b["op"][-61:]
    lines.append(f"  {_size(b['bytes'])}  {b['kind']:<9} {b['shape']:<26} {op}{flag}")
  estimate = r["estimate_bytes"]
  lines += ["", "Analytic estimate, per device (b batch per device, A anchors, k depth, V vocab, "
            "N heads, T seq):"]
  for name, n in sorted(estimate.items(), key=lambda kv: -kv[1]):
    lines.append(f"  {_size(n)}  {name}")
  if r["platform"] == "cpu" and "bfloat16" in (target["dtype"], head["dtype"]):
    copies = r["f32_copies_of_bf16_params_bytes"]
    lines += ["", f"Note: {_CPU_UPCAST_NOTE} " + (
        f"Those above: {_size(copies).strip()}." if copies else "None is among those above.")]
  return "\n".join(lines)
