"""How many times should the Triton tree kernel read the cache? A sweep of rows per program.

  python bench/gpu_kernel_tiles.py [--out bench/results/gpu/gpu_kernel_tiles.json]

A program holds `max_rows` (query, head) rows and reads its (batch row, kv head)'s cache once,
so the cache is read ceil(T * G / max_rows) times: at Qwen3-8B shapes (G = 4), max_rows =
4 * N reads it once. Holding more rows costs registers (each row's float32 state stays in
them for the whole cache walk), so this measures, at N = 16 / 64 / 256 tree nodes, batch 8,
bfloat16, a 32,768-slot buffer holding 8,192 or 32,768 - N tokens, every max_rows from 64 to
4 * N against 4, 8 and 16 warps (a configuration Triton cannot compile is recorded as such).
Each time is set against two floors: the cache read once at the GPU's memory bandwidth, and
the attention's matmul FLOPs at its dense bf16 peak. Needs a GPU; prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # measure this checkout

import jax
import jax.numpy as jnp
import numpy as np

from gpu_kernels import HEAD_DIM, KV_HEADS, N_HEADS, make_inputs, median_ms
from jetflow_jax.kernels.tree_attention_pallas import tree_attention_pallas

# H100 / H200 SXM: HBM bandwidth (H200) and dense bf16 tensor-core peak, for the floors only.
HBM_BYTES_PER_S = 4.8e12
BF16_FLOPS_PER_S = 989e12
SLOTS, BATCH = 32768, 8


def floors_ms(t: int, committed: int) -> tuple[float, float]:
  """(cache read once, matmul FLOPs at peak) in ms for one call."""
  cache_bytes = BATCH * committed * KV_HEADS * HEAD_DIM * 2 * 2  # K and V, bf16
  flops = BATCH * t * N_HEADS * (committed + t) * HEAD_DIM * 4  # QK^T and PV, 2 flops a MAC
  return cache_bytes / HBM_BYTES_PER_S * 1e3, flops / BF16_FLOPS_PER_S * 1e3


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "gpu",
                                                    "gpu_kernel_tiles.json"))
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  group = N_HEADS // KV_HEADS
  rows_out = []
  for t in (16, 64, 256):
    # One executable per tile and warp count, shared by both lengths (same shapes).
    configs = [(m, w) for m in (64, 128, 256, 512, 1024) if m <= max(64, group * t)
               for w in (4, 8, 16)]
    fns = {(m, w): jax.jit(lambda *a, m=m, w=w: tree_attention_pallas(*a, max_rows=m,
                                                                      num_warps=w))
           for m, w in configs}
    for committed in (8192, SLOTS - t):
      inputs = make_inputs(rng, BATCH, t, SLOTS, [committed] * BATCH, jnp.bfloat16)
      read_ms, flop_ms = floors_ms(t, committed)
      print(f"N={t} committed {committed}: floors: cache once {read_ms:.3f} ms, "
            f"FLOPs {flop_ms:.3f} ms", flush=True)
      for (max_rows, warps), fn in fns.items():
        row = {"nodes": t, "committed": committed, "max_rows": max_rows, "num_warps": warps,
               "cache_reads": -(-group * t // max_rows), "floor_read_once_ms": read_ms,
               "floor_flops_ms": flop_ms}
        try:
          row["ms"] = median_ms(fn, inputs)
        except Exception as e:  # a tile Triton cannot fit: recorded, the sweep goes on
          row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows_out.append(row)
        print(f"  max_rows {max_rows:4d} ({row['cache_reads']} reads) warps {warps:2d}: "
              + (f"{row['ms']:7.3f} ms" if "ms" in row else row["error"][:100]), flush=True)
      del inputs
    # Written after every N, so a run cut short by a time limit keeps what it measured.
    report = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "slots": SLOTS, "batch": BATCH, "rows": rows_out}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(report, f, indent=2)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
