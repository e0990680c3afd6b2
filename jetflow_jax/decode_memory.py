"""Per-device memory of decoding (prefill, then speculative rounds) for a model and a mesh,
compiled ahead of time on abstract shapes: no weights, fake CPU devices for the mesh.

  python decode.py --memory_report --config configs/qwen3_235b_a22b.py --mesh tp=4,ep=2 \
      --batch-size 8 --budget 256 --cache-size 8192 [--json]

The target's architecture and the head's come from a training config file (its
`target.shape`, or `target.checkpoint`'s config.json when set); `--checkpoint DIR` reads
a checkpoint's config.json instead. The prompt fills the context up to one round's room.
XLA's CPU backend upcasts bfloat16 dot operands to float32, so a CPU compile holds float32
copies of bf16 weights and caches that a GPU or TPU would not; the buffers live at each
phase's peak (from XLA's dump) tell them apart, and the reported peak leaves them out.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import time

import jax
import jax.numpy as jnp

from jetflow_jax import cli
from jetflow_jax.config import load_config
from jetflow_jax.config_files import head_config, load_config_file, target_shape
from jetflow_jax.decoding.loop import Rows, compile_decode
from jetflow_jax.decoding.policy import tree_shape_for
from jetflow_jax.decoding.round import RoundSpec
from jetflow_jax.decoding.state import stop_rows
from jetflow_jax.drafters import HeadDrafter
from jetflow_jax.errors import InputError
from jetflow_jax.head_checkpoint import abstract_head_params
from jetflow_jax.memory_analysis import per_device_bytes, read_buffers, use_host_devices
from jetflow_jax.mesh import DecodeMesh
from jetflow_jax.model import abstract_params
from jetflow_jax.partitioning import abstract
from jetflow_jax.sampling import Greedy, RowSampling

GIB = 2**30


def analysis(compiled, dump_dir: str, module: str, bf16_arguments) -> dict:
  """XLA's per-device bytes for one executable, and how much of its peak is float32 copies of
  bfloat16 arguments (weights, caches): XLA's CPU backend upcasts bf16 dot operands, a GPU or
  TPU does not, so `peak_without_cpu_copies` is the figure for those."""
  stats = compiled.memory_analysis()
  total = (stats.argument_size_in_bytes + stats.output_size_in_bytes
           - stats.alias_size_in_bytes + stats.temp_size_in_bytes)
  buffers = read_buffers(dump_dir, compiled.as_text(), bf16_arguments, limit=10**9,
                         module=module)
  copies = sum(b["bytes"] for b in buffers["largest_buffers"] if b["f32_copy_of_bf16_param"])
  return {"arguments": stats.argument_size_in_bytes, "outputs": stats.output_size_in_bytes,
          "aliased": stats.alias_size_in_bytes, "temporaries": stats.temp_size_in_bytes,
          "total": total, "cpu_f32_copies_at_peak": copies,
          "peak_without_cpu_copies": total - copies,
          "largest_at_peak": [{k: b[k] for k in ("shape", "bytes", "op", "f32_copy_of_bf16_param")}
                              for b in buffers["largest_buffers"][:6]],
          "at_peak_by_op": _by_op(buffers["largest_buffers"])}


def _by_op(buffers: list[dict], limit: int = 8) -> list[tuple[str, int, int]]:
  """(op with layer numbers folded, buffers, bytes) of what is live at the peak, largest first."""
  totals: dict[str, list[int]] = {}
  for b in buffers:
    op = re.sub(r"layers_\d+", "layers_*", b["op"] or b["shape"])
    entry = totals.setdefault(op, [0, 0])
    entry[0] += 1
    entry[1] += b["bytes"]
  return sorted(((op, n, size) for op, (n, size) in totals.items()), key=lambda t: -t[2])[:limit]


def memory_report(config_spec: str, mesh_sizes: dict[str, int], *, batch: int, budget: int,
                  top_k: int, context: int, dtype_name: str = "bfloat16",
                  checkpoint: str | None = None) -> dict:
  """Compiles prefill and the decode loop for this layout; returns per-device bytes."""
  config = load_config_file(config_spec)
  if checkpoint:
    config.unlock().target.checkpoint = checkpoint
  count = math.prod(mesh_sizes.values()) if mesh_sizes else 1
  use_host_devices(count)
  target, source = target_shape(config)
  if checkpoint:
    target = load_config(os.path.expanduser(checkpoint))
  head = head_config(config, target)
  mesh = DecodeMesh.create(**mesh_sizes)
  dtype = cli.parse_dtype(dtype_name)
  if batch % mesh.size("data"):
    raise InputError(f"--batch-size {batch} does not split over data={mesh.size('data')}")
  if context <= head.block_size + 1:
    raise InputError(f"--cache-size {context} leaves no room for a prompt")

  target_params = abstract_params(target, dtype)
  target_params = abstract(target_params, mesh.param_shardings(target, target_params))
  head_params = abstract(abstract_head_params(head, dtype), mesh.replicated())
  prompt_len = context - head.block_size  # the prompt fills the context up to one round's room
  lengths_b = jnp.full((batch,), prompt_len, jnp.int32)
  rows = Rows(prompt_bt=jnp.zeros((batch, prompt_len), jnp.int32), lengths_b=lengths_b,
              max_lengths_b=lengths_b + head.block_size,
              keys_b=jax.vmap(jax.random.key)(jnp.arange(batch)),
              sampling=RowSampling.of([Greedy()] * batch),
              stop_tokens_bk=stop_rows([target.eos_token_ids] * batch))
  spec = RoundSpec(target, HeadDrafter(head, dtype, "xla"),
                   tree_shape_for("jetflow", budget, top_k), sampled=False, filtered=False,
                   mesh=mesh)
  start = time.perf_counter()
  with tempfile.TemporaryDirectory() as dump_dir:
    options = (("xla_dump_to", dump_dir), ("xla_dump_hlo_as_text", True))
    prefill, decode = compile_decode(target_params, head_params, rows, spec, context,
                                     compiler_options=options)
    seconds = time.perf_counter() - start
    state = abstract(prefill.out_info, prefill.output_shardings)
    # Every bf16 argument a CPU dot may upcast: the weights and the decode state's caches.
    bf16_arguments = (target_params, head_params, state)
    phases = {name: analysis(compiled, dump_dir, module, bf16_arguments)
              for name, compiled, module in (("prefill", prefill, "jit_prefill"),
                                             ("decode loop (rounds)", decode, "jit_decode"))}

  return {
      "mesh": {axis: mesh.size(axis) for axis in ("data", "tp", "ep")},
      "num_devices": mesh.mesh.size, "platform": jax.devices()[0].platform,
      "target": {"source": source if not checkpoint else "config.json",
                 "layers": target.num_hidden_layers, "hidden_size": target.hidden_size,
                 "num_experts": target.num_experts, "kv_heads": target.num_key_value_heads,
                 "dtype": jnp.dtype(dtype).name},
      "head": {"layers": head.num_layers, "block_size": head.block_size},
      "batch": batch, "budget": budget, "top_k": top_k, "context": context,
      "prompt_len": prompt_len, "compile_seconds": round(seconds, 1),
      "per_device_bytes": {
          "target weights": per_device_bytes(target_params),
          "head weights": per_device_bytes(head_params),
          "target KV cache": per_device_bytes(state.cache),
          "head context cache": per_device_bytes(state.drafter_state),
          **phases},
      "kv_cache_split_over_tp": mesh.kv_heads_axis(target) is not None,
  }


def format_report(report: dict) -> str:
  r, m = report, report["per_device_bytes"]
  size = lambda n: f"{n / GIB:8.2f} GiB"
  target = r["target"]
  experts = f", {target['num_experts']} experts" if target["num_experts"] else ""
  lines = [
      f"target: {target['layers']} layers, hidden {target['hidden_size']}{experts}, "
      f"{target['kv_heads']} kv heads, {target['dtype']} (from {target['source']}); head: "
      f"{r['head']['layers']} layers, block {r['head']['block_size']}",
      f"mesh {r['mesh']} on {r['num_devices']} {r['platform']} devices; batch {r['batch']}, "
      f"budget {r['budget']} (top-k {r['top_k']}), context {r['context']} (prompt "
      f"{r['prompt_len']}); compiled in {r['compile_seconds']:.1f} s",
      "", "Per device:",
      f"  target weights      {size(m['target weights'])}",
      f"  head weights        {size(m['head weights'])}  (replicated)",
      f"  target KV cache     {size(m['target KV cache'])}  "
      f"({'split over tp' if r['kv_cache_split_over_tp'] else 'replicated over tp'})",
      f"  head context cache  {size(m['head context cache'])}",
  ]
  for phase in ("prefill", "decode loop (rounds)"):
    a = m[phase]
    lines.append(f"  {phase + ':':<20}{size(a['total'])}  (arguments {size(a['arguments']).strip()}"
                 f", temporaries {size(a['temporaries']).strip()}, outputs not aliased "
                 f"{size(a['outputs'] - a['aliased']).strip()}); without the CPU's f32 copies "
                 f"of bf16 arguments {size(a['peak_without_cpu_copies']).strip()}")
  peak = max(m[phase]["peak_without_cpu_copies"] for phase in ("prefill", "decode loop (rounds)"))
  lines += ["", f"  peak {size(peak).strip()} per device: "
            f"{'fits' if peak <= 80 * GIB else 'does not fit'} an 80 GiB device"]
  if r["platform"] == "cpu" and target["dtype"] == "bfloat16":
    lines.append("  (XLA on CPU upcasts bfloat16 dot operands to float32, a GPU or TPU does not: "
                 "the peak leaves out the float32 copies of bf16 weights and caches live at it)")
  return "\n".join(lines)
