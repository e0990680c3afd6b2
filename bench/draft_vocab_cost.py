"""What a draft vocabulary buys: the head's cost over K of the target's tokens, against its floor.

Run from the repository root (it measures this checkout's `jetflow_jax`):

  python bench/draft_vocab_cost.py                              # both presets, default K lists
  python bench/draft_vocab_cost.py --presets cpu-small --vocabs 0,4096,2048 --repeats 20

Per preset and draft vocabulary K (0: the target's whole vocabulary), one `HeadDrafter.draft`
after `--committed` tokens: its roofline floor on each accelerator of `roofline.DEVICES` in
bfloat16 (what serving would run; `--batch` rows), and its time measured here on the CPU in
float32 at batch 1 (least and median of `--repeats`) against the CPU's own floor
(`roofline.host_device()`: its measured read bandwidth and matmul rate at the piece's row
count; `JETFLOW_HOST_ROOFLINE=FILE` measures it afresh into FILE). Presets: `cpu-small`
(step_costs.py's: a 6-layer width-256 target over 8,192 tokens, 2-layer head) and `qwen3-8b`
(Qwen3-8B shapes, untied as Qwen3-8B is, the reference's 5-layer head: ~9 GB in float32).
Params are constants: values do not change a matmul's time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # before the imports below: measure this checkout, installed or not

import jax
import jax.numpy as jnp
import numpy as np

from jetflow_jax import roofline
from jetflow_jax.config import Qwen3Config
from jetflow_jax.drafters import HeadDrafter
from jetflow_jax.head import with_draft_vocab
from jetflow_jax.head_checkpoint import abstract_head_params
from jetflow_jax.head_config import HeadConfig

PRESETS = {
    "cpu-small": (Qwen3Config(vocab_size=8192, hidden_size=256, intermediate_size=768,
                              num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=64), 2, (1, 3), (0, 4096, 2048)),
    "qwen3-8b": (Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                             num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                             head_dim=128), 5, (1, 9, 17, 25, 33), (0, 32000, 8192, 2048)),
}


def constant_params(abstract):
  return jax.tree.map(lambda s: jnp.full(s.shape, 0.01, s.dtype), abstract)


def measure(target: Qwen3Config, head: HeadConfig, committed: int,
            repeats: int) -> tuple[float, float]:
  """(least, median) seconds of one jitted float32 draft on this machine; on a shared machine
  the least is the one other work disturbed least."""
  shape = (target.vocab_size, target.hidden_size)
  target_params = {"embed_tokens": {"embedding": jnp.full(shape, 0.01, jnp.float32)}}
  if not target.tie_word_embeddings:  # only what a draft reads: the table and the LM head
    target_params["lm_head"] = {"kernel": jnp.full(shape[::-1], 0.01, jnp.float32)}
  full = dataclasses.replace(head, draft_vocab_size=0)
  params = constant_params(abstract_head_params(full))
  if head.draft_vocab_size:
    params = jax.jit(with_draft_vocab, static_argnums=2)(
        params, target_params, target, np.arange(head.draft_vocab_size, dtype=np.int32))
  drafter = HeadDrafter(head)
  taps = jnp.full((1, committed - 1, head.num_taps, head.hidden_size), 0.01, jnp.float32)
  state = jax.jit(drafter.init_state, static_argnums=3)(params, None, taps, committed)
  anchor, context_len = jnp.zeros((1,), jnp.int32), jnp.full((1,), committed - 1, jnp.int32)
  draft = jax.jit(lambda p, t, s: drafter.draft(p, t, target, s, anchor, context_len))
  draft(params, target_params, state).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    draft(params, target_params, state).block_until_ready()
    times.append(time.perf_counter() - start)
  return min(times), statistics.median(times)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--presets", default=",".join(PRESETS))
  parser.add_argument("--vocabs", default="", help="K values (0: full); default per preset")
  parser.add_argument("--committed", type=int, default=512)
  parser.add_argument("--batch", type=int, default=1, help="rows drafting at once (floors; "
                      "the CPU measures batch 1)")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--no-measure", action="store_true", help="floors only")
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results",
                                                    "draft_vocab_cost.json"))
  args = parser.parse_args()
  records = []
  host = roofline.host_device()
  for name in args.presets.split(","):
    target, layers, taps, vocabs = PRESETS[name]
    vocabs = [int(k) for k in args.vocabs.split(",")] if args.vocabs else vocabs
    for k in vocabs:
      head = HeadConfig.for_target(target, num_layers=layers, target_layer_ids=taps,
                                   mask_token_id=target.vocab_size - 1, draft_vocab_size=k)
      floors = {device.name: roofline.summary(
          roofline.head_forward(target, head, jnp.bfloat16, args.batch, args.committed), device)
          for device in roofline.DEVICES.values()}
      cpu = roofline.head_forward(target, head, jnp.float32, 1, args.committed)
      record = dict(preset=name, draft_vocab=k or target.vocab_size, floors_bf16=floors,
                    cpu_float32=roofline.summary(cpu, host))
      if not args.no_measure:
        least, median = measure(target, head, args.committed, args.repeats)
        record.update(cpu_ms=1e3 * least, cpu_median_ms=1e3 * median)
      records.append(record)
      h200, cpu_floor = floors["H200"], record["cpu_float32"]["floor_ms"]
      print(f"{name:10s} K={record['draft_vocab']:>6d}  H200 floor {h200['floor_ms']:.3f} ms "
            f"({h200['bytes'] / 1e9:.2f} GB bf16)  CPU float32: floor {cpu_floor:.1f} ms"
            + (f", measured {record['cpu_ms']:.1f} ms ({record['cpu_ms'] / cpu_floor:.1f}x)"
               if "cpu_ms" in record else ""), flush=True)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(dict(committed=args.committed, batch=args.batch, repeats=args.repeats,
                   jax_version=jax.__version__, load_average=os.getloadavg(),
                   host=dataclasses.asdict(host), records=records), f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
