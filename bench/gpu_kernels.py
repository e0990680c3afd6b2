"""Tree-verify attention on a real GPU: the Triton kernel and the XLA path against a float64
reference, then their times against the buffer's size and the committed length.

  python bench/gpu_kernels.py [--out bench/results/gpu_kernels.json]

Qwen3-8B attention shapes (32 query heads on 8 kv heads of 128), one row per sequence,
random trees of N = 16 / 64 / 256 nodes. Check: relative error ||out - ref|| / ||ref|| in
float32 and bfloat16 at cache lengths 0, partial and full. Times: median of 20 runs after
a warm-up (device synchronised), batch 8, at a 32,768-slot buffer holding 1,024 / 8,192 /
32,768 committed tokens, so a path whose cost follows the buffer (not the length) shows it.
Needs a GPU; prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # measure this checkout

import jax
import jax.numpy as jnp
import numpy as np

from jetflow_jax.kernels import tree_attention

N_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def random_tree_mask(rng: np.random.Generator, t: int) -> np.ndarray:
  """[T, T] ancestor-or-self mask of a random tree rooted at node 0."""
  parents = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
  mask = np.eye(t, dtype=bool)
  for i in range(1, t):
    mask[i] |= mask[parents[i]]
  return mask


def make_inputs(rng, batch, t, slots, lengths, dtype):
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
  return (normal(batch, t, N_HEADS, HEAD_DIM), normal(batch, slots, KV_HEADS, HEAD_DIM),
          normal(batch, slots, KV_HEADS, HEAD_DIM), jnp.asarray(lengths, jnp.int32),
          normal(batch, t, KV_HEADS, HEAD_DIM), normal(batch, t, KV_HEADS, HEAD_DIM),
          jnp.asarray(np.stack([random_tree_mask(rng, t) for _ in range(batch)])))


def reference(q, k_cache, v_cache, lengths, k_new, v_new, mask) -> np.ndarray:
  """float64 on the host: each node attends to the cache prefix and its ancestors."""
  q, k_cache, v_cache, k_new, v_new = (np.asarray(x, np.float64)
                                       for x in (q, k_cache, v_cache, k_new, v_new))
  lengths, mask = np.asarray(lengths), np.asarray(mask)
  group = N_HEADS // KV_HEADS
  out = np.zeros(q.shape)
  for b in range(q.shape[0]):
    k_all = np.concatenate([k_cache[b, :lengths[b]], k_new[b]])  # [S' + T, K, H]
    v_all = np.concatenate([v_cache[b, :lengths[b]], v_new[b]])
    k_all, v_all = (np.repeat(x, group, axis=1) for x in (k_all, v_all))
    scores = np.einsum("tnh,snh->nts", q[b], k_all) / np.sqrt(HEAD_DIM)
    allowed = np.concatenate([np.ones((q.shape[1], lengths[b]), bool), mask[b]], axis=1)
    scores = np.where(allowed[None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    out[b] = np.einsum("nts,snh->tnh", p / p.sum(-1, keepdims=True), v_all)
  return out


def relative_error(got, want) -> float:
  return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


def median_ms(fn, args, repeats=20) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "gpu_kernels.json"))
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  fns = {impl: jax.jit(lambda *a, impl=impl: tree_attention(*a, impl=impl))
         for impl in ("xla", "pallas")}
  report = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
            "errors": [], "times": []}

  slots = 2048
  for dtype in (jnp.float32, jnp.bfloat16):
    for t in (16, 64, 256):
      lengths = [0, 777, slots]
      inputs = make_inputs(rng, 3, t, slots, lengths, dtype)
      want = reference(*inputs)
      row = {"dtype": jnp.dtype(dtype).name, "nodes": t, "slots": slots, "lengths": lengths}
      for impl, fn in fns.items():
        row[impl] = relative_error(fn(*inputs).astype(jnp.float32), want)
      report["errors"].append(row)
      print(f"error {row['dtype']:8s} N={t:3d}: xla {row['xla']:.2e}, pallas {row['pallas']:.2e}",
            flush=True)

  slots, batch = 32768, 8
  for t in (16, 64, 256):
    for committed in (1024, 8192, 32768 - t):
      inputs = make_inputs(rng, batch, t, slots, [committed] * batch, jnp.bfloat16)
      row = {"nodes": t, "slots": slots, "committed": committed, "batch": batch,
             **{f"{impl}_ms": median_ms(fn, inputs) for impl, fn in fns.items()}}
      report["times"].append(row)
      print(f"time N={t:3d} committed {committed:5d} / {slots}: xla {row['xla_ms']:7.3f} ms, "
            f"pallas {row['pallas_ms']:7.3f} ms", flush=True)
      del inputs

  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(report, f, indent=2)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
