"""The training data path at scale: JSONL -> token store -> packing plan -> batches.

  python bench/data_pipeline.py                       # 1K, 10K, 100K and 1M records
  python bench/data_pipeline.py --records 1000,10000 --out /tmp/dp.json

For each size, synthetic regenerated records with chat-like lengths (prompt + response
100-3000 tokens, log-normal around 600; prompts 10-1000 around 120) are written as the
JSONL that older runs produced, then each phase runs in a fresh process so its time and
peak RSS are its own:

- convert: the JSONL into a one-shard store (what `data.regenerated=FILE.jsonl` does once);
- first start: open the store, make and save the packing plan (6 epochs, seq 3072);
- resume: open the store and reload the saved plan (every restart);
- batches: the rows one process of an 8-GPU host feeds (8 rows of 3072 tokens a step),
  built by `StoreBatches` behind grain's prefetching iterator, from a step in the middle.

The train step's appetite is estimated from its FLOPs (configs/qwen3_8b.py: seq 3072, 512
anchors, block 16, a 5-layer head) on an H100's dense bfloat16 peak, i.e. at 100% MFU: the
pipeline must feed at least 10x that, per device. Writes JSON (and a PNG beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

SEQ_LEN, EPOCHS, ROWS_PER_PROCESS = 3072, 6, 8
H100_BF16_FLOPS = 989e12  # dense peak


def synthetic_jsonl(path: str, count: int, seed: int = 0) -> int:
  """Writes `count` regenerated records; returns their total tokens."""
  rng = np.random.default_rng(seed)
  totals = np.clip(rng.lognormal(np.log(600), 0.8, count), 100, 3000).astype(int)
  prompts = np.minimum(np.clip(rng.lognormal(np.log(120), 0.8, count), 10, 1000).astype(int),
                       totals - 10)
  with open(path, "w") as f:
    for i in range(count):
      tokens = rng.integers(0, 151936, totals[i]).tolist()
      f.write(f'{{"id": {i}, "prompt_ids": [{",".join(map(str, tokens[:prompts[i]]))}], '
              f'"response_ids": [{",".join(map(str, tokens[prompts[i]:]))}]}}\n')
  return int(totals.sum())


def memory() -> dict:
  """Peak RSS, and the anonymous (heap) part now: the rest is pages of memory-mapped files,
  which the kernel maps in around every read and can drop at any time."""
  status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
  return {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
          "anon_rss_mib": int(status["RssAnon"].split()[0]) / 1024}


def phase(name: str, directory: str, steps: int) -> dict:
  """One phase, in this (fresh) process."""
  import jax  # the training process has these loaded anyway: count them in every phase alike
  del jax
  from jetflow_jax.train import packing
  from jetflow_jax.train.data import StoreBatches, batch_iterator
  from jetflow_jax.train.store import TokenStore, convert_jsonl
  store_dir, jsonl = os.path.join(directory, "store"), os.path.join(directory, "data.jsonl")
  start = time.perf_counter()
  if name == "convert":
    convert_jsonl(jsonl, store_dir)
    return {"seconds": time.perf_counter() - start, **memory()}
  store = TokenStore(store_dir)
  inputs = packing.plan_inputs(seq_len=SEQ_LEN, epochs=EPOCHS, seed=0, pack=True,
                               source=store.fingerprint())
  if name == "first_start":
    plan = packing.make_plan(store.lengths, store.prompt_lengths, seq_len=SEQ_LEN, epochs=EPOCHS,
                             seed=0, pack=True, source=inputs["store"])
    packing.save_plan(plan, directory)
    return {"seconds": time.perf_counter() - start, **memory(), "rows": plan.num_rows,
            "fill": plan.meta["fill"]}
  plan = packing.load_plan(directory)
  packing.check_plan(plan, inputs, directory)
  if name == "resume":
    return {"seconds": time.perf_counter() - start, **memory()}
  batches = StoreBatches(store, plan, SEQ_LEN, ROWS_PER_PROCESS)
  first = len(batches) // 2
  steps = min(steps, len(batches) - first)
  iterator = batch_iterator(batches, first)
  next(iterator)  # the prefetching thread's start-up
  start, tokens = time.perf_counter(), 0
  for _ in range(steps - 1):
    tokens += int((next(iterator)["segment_ids"] > 0).sum())
  seconds = time.perf_counter() - start
  return {"batches_per_s": (steps - 1) / seconds, "tokens_per_s": tokens / seconds,
          "slots_per_s": (steps - 1) * ROWS_PER_PROCESS * SEQ_LEN / seconds, **memory()}


def run_phase(name: str, directory: str, steps: int) -> dict:
  done = subprocess.run([sys.executable, __file__, "--phase", name, "--dir", directory,
                         "--steps", str(steps)], capture_output=True, text=True,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  if done.returncode:
    raise SystemExit(f"phase {name} failed:\n{done.stderr[-3000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def step_flops_per_row() -> float:
  """FLOPs of one 3072-token row of the Qwen3-8B train step (configs/qwen3_8b.py)."""
  layers, hidden, heads, kv_heads, head_dim, ffn, vocab = 36, 4096, 32, 8, 128, 12288, 151936
  head_layers, anchors, block, seq = 5, 512, 16, 3072
  q, kv = heads * head_dim, kv_heads * head_dim
  layer_params = hidden * (2 * q + 2 * kv) + 3 * hidden * ffn
  target = 2 * layers * layer_params * seq + 2 * layers * seq * seq * q  # causal: half of 4·T²
  depth = block - 1
  teacher_logits = 2 * hidden * vocab * anchors * depth
  block_rows = anchors * block
  head = 6 * head_layers * layer_params * block_rows  # forward and backward
  head += 3 * 4 * head_layers * block_rows * (seq / 2) * q  # attention over ~half the context
  head += 3 * 2 * head_layers * seq * 2 * hidden * kv  # context K/V from the fused taps
  draft_logits = 4 * hidden * vocab * anchors * depth  # frozen LM head: forward + input grads
  return target + teacher_logits + head + draft_logits


def plot(results: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  records = [r["records"] for r in results]
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
  for key, label in (("convert", "convert JSONL (once)"), ("first_start", "first start (plan)"),
                     ("resume", "resume")):
    axes[0].plot(records, [r[key]["seconds"] for r in results], "o-", label=label)
    axes[1].plot(records, [r[key]["peak_rss_mib"] for r in results], "o-", label=label)
  axes[1].plot(records, [r["batches"]["peak_rss_mib"] for r in results], "o-",
               label="feeding batches (mapped file pages included)")
  axes[1].plot(records, [r["batches"]["anon_rss_mib"] for r in results], "o--",
               label="feeding batches, heap only")
  for ax, ylabel in zip(axes, ("seconds", "peak RSS (MiB)")):
    ax.set_xscale("log")
    ax.set_xlabel("records")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
  axes[0].set_yscale("log")
  axes[0].legend()
  axes[1].legend()
  fig.suptitle("token store + packing plan: cost against the number of records")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--records", default="1000,10000,100000,1000000")
  parser.add_argument("--steps", type=int, default=500, help="batches timed per size")
  parser.add_argument("--out", default="bench/results/data_pipeline.json")
  parser.add_argument("--workdir", default=None, help="scratch space (default: a temp dir)")
  parser.add_argument("--phase", help=argparse.SUPPRESS)
  parser.add_argument("--dir", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.phase:
    print(json.dumps(phase(args.phase, args.dir, args.steps)))
    return

  consumed = H100_BF16_FLOPS / step_flops_per_row() * SEQ_LEN  # token slots/s, one device
  scratch = tempfile.mkdtemp(dir=args.workdir, prefix="data_pipeline-")
  results = []
  try:
    for count in map(int, args.records.split(",")):
      directory = os.path.join(scratch, str(count))
      os.makedirs(directory)
      tick = time.perf_counter()
      tokens = synthetic_jsonl(os.path.join(directory, "data.jsonl"), count)
      row = {"records": count, "tokens": tokens,
             "jsonl_bytes": os.path.getsize(os.path.join(directory, "data.jsonl")),
             "write_jsonl_seconds": time.perf_counter() - tick}
      for name in ("convert", "first_start", "resume", "batches"):
        row[name] = run_phase(name, directory, args.steps)
      row["feed_over_consumption"] = row["batches"]["slots_per_s"] / consumed
      results.append(row)
      print(f"{count:>9,} records: convert {row['convert']['seconds']:7.1f} s, first start "
            f"{row['first_start']['seconds']:6.2f} s, resume {row['resume']['seconds']:5.2f} s "
            f"({row['resume']['peak_rss_mib']:.0f} MiB), {row['batches']['batches_per_s']:6.0f} "
            f"batches/s = {row['feed_over_consumption']:.0f}x one H100's appetite", flush=True)
      shutil.rmtree(directory)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  report = {"seq_len": SEQ_LEN, "epochs": EPOCHS, "rows_per_process_step": ROWS_PER_PROCESS,
            "train_step_flops_per_row": step_flops_per_row(),
            "h100_token_slots_per_s_at_peak": consumed, "results": results}
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(report, f, indent=2)
  plot(results, os.path.splitext(args.out)[0] + ".png")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
