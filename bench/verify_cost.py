"""What a tree verify costs against the KV buffer's size and the committed length (CPU, XLA).

  python bench/verify_cost.py                        # the embedded target, N = 64 tree nodes
  python bench/verify_cost.py --buffers 528,32784 --committed 256 --repeats 5 --no-decode

The embedded target (8 layers, width 256, 2 kv heads of 64) verifies a fixed 64-node tree
for one row holding `committed` tokens in a cache buffer of `buffer` slots. `now` is the
library's forward (attention in blocks up to the row's length); `full buffer` is the same
forward with the cache attention done the way it was before, over every slot of the buffer,
masked. Then `decode.py --json` decodes 64 JetFlow tokens on the embedded pair with the
default cache and with 32,768 slots, `--decode-runs` times each, alternating: the wall times
(compilation excluded) and their ratio. Medians; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # measure this checkout

import jax
import jax.numpy as jnp
import numpy as np

from jetflow_jax import embedded
from jetflow_jax.checkpoint import load_qwen3
from jetflow_jax.model import KVCache, forward, lm_logits
from jetflow_jax.tree import build_tree


def full_buffer_attention(q_btnh, k_cache_bskh, v_cache_bskh, cache_len_b, k_new_btkh,
                          v_new_btkh, new_mask_btt):
  """The verify attention as it was: scores against every slot of the buffer, then masked."""
  b, t, n, h = q_btnh.shape
  s, k = k_cache_bskh.shape[1], k_cache_bskh.shape[2]
  q = q_btnh.reshape(b, t, k, n // k, h) / np.sqrt(h)
  scores = lambda keys: jnp.einsum("btkgh,bskh->bkgts", q, keys)
  s_cache = jnp.where((jnp.arange(s) < cache_len_b[:, None])[:, None, None, None],
                      scores(k_cache_bskh), -jnp.inf)
  s_new = jnp.where(new_mask_btt[:, None, None], scores(k_new_btkh), -jnp.inf)
  p = jax.nn.softmax(jnp.concatenate([s_cache, s_new], axis=-1), axis=-1)
  v = jnp.concatenate([v_cache_bskh, v_new_btkh], axis=1)
  return jnp.einsum("bkgts,bskh->btkgh", p, v).reshape(b, t, n, h)


def verify_fn(config, full_buffer: bool):
  def verify(params, tree, cache, committed_b):
    context_b = committed_b - 1
    hidden, _, _ = forward(params, config, tree.tokens,
                           positions_bt=context_b[:, None] + tree.depths, cache=cache,
                           cache_index_b=context_b, tree_mask_btt=tree.ancestor_mask)
    return lm_logits(params, config, hidden)
  if not full_buffer:
    return jax.jit(verify)
  import jetflow_jax.model as model

  def with_full_buffer(*args):
    original = model.tree_attention
    model.tree_attention = lambda *a, **kw: full_buffer_attention(*a)
    try:
      return verify(*args)
    finally:
      model.tree_attention = original
  return jax.jit(with_full_buffer)


def median_ms(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def decode_wall_s(cache_size: int | None) -> float:
  command = [sys.executable, os.path.join(ROOT, "decode.py"), "--prompt", "def fibonacci(n):",
             "--max-new-tokens", "64", "--json"]
  if cache_size:
    command += ["--cache-size", str(cache_size)]
  done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  if done.returncode:
    raise SystemExit(done.stderr[-2000:])
  return json.loads(done.stdout)["wall_s"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--buffers", default="528,2064,8208,32784")
  parser.add_argument("--committed", default="256,2048,8192")
  parser.add_argument("--nodes", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=9)
  parser.add_argument("--decode-runs", type=int, default=5)
  parser.add_argument("--no-decode", action="store_true")
  parser.add_argument("--out", default="bench/results/verify_cost.json")
  args = parser.parse_args()

  config, params = load_qwen3(embedded.default_target())
  rng = np.random.default_rng(0)
  logprobs = jax.nn.log_softmax(jnp.asarray(rng.standard_normal((1, 15, config.vocab_size)) * 3,
                                            jnp.float32))
  tree = build_tree(logprobs, args.nodes, 7)
  fns = {"now": verify_fn(config, False), "full buffer": verify_fn(config, True)}
  rows = []
  for buffer in map(int, args.buffers.split(",")):
    shape = (1, buffer, config.num_key_value_heads, config.head_dim)
    layers = range(config.num_hidden_layers)
    cache = KVCache(k=tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in layers),
                    v=tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in layers))
    for committed in map(int, args.committed.split(",")):
      if committed + args.nodes > buffer:
        continue
      inputs = (params, tree, cache, jnp.array([committed], jnp.int32))
      row = {"buffer": buffer, "committed": committed,
             **{f"{name}_ms": median_ms(fn, inputs, args.repeats) for name, fn in fns.items()}}
      rows.append(row)
      print(f"buffer {buffer:6d}, committed {committed:5d}: now {row['now_ms']:7.2f} ms, full "
            f"buffer {row['full buffer_ms']:7.2f} ms", flush=True)
  report = {"nodes": args.nodes, "verify": rows}
  if not args.no_decode:
    walls = {"default": [], "32768": []}
    for _ in range(args.decode_runs):
      walls["default"].append(decode_wall_s(None))
      walls["32768"].append(decode_wall_s(32768))
    medians = {name: statistics.median(w) for name, w in walls.items()}
    report["decode_wall_s"] = {"runs": walls, "median": medians,
                               "ratio": medians["32768"] / medians["default"]}
    print(f"decode.py, 64 JetFlow tokens: default cache {medians['default']:.3f} s, 32,768 "
          f"slots {medians['32768']:.3f} s ({report['decode_wall_s']['ratio']:.2f}x)")
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(report, f, indent=2)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
