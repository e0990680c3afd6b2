"""The embedded target's pre-training curve: train and held-out loss against tokens.

  python -m jetflow_jax.embedded.plot runs/embedded/pretrain docs/embedded_pretraining.png
"""

from __future__ import annotations

import argparse
import json
import os


def plot_pretraining(workdir: str, out: str) -> str:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  tokens = [r["tokens"] / 1e6 for r in rows]
  window = 50  # the per-step loss is noisy; show its running mean
  losses = [r["loss"] for r in rows]
  smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
            for i in range(len(losses))]
  held = [(r["tokens"] / 1e6, r["heldout_loss"]) for r in rows if "heldout_loss" in r]
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(tokens, smooth, label=f"train (running mean of {window} steps)")
  ax.plot(*zip(*held), marker="o", label="held-out stdlib modules")
  ax.axhline(2.5, color="grey", linestyle=":", label="quality bar 2.5")
  ax.set_xlabel("training tokens (millions)")
  ax.set_ylabel("loss (nats / token)")
  ax.set_ylim(1.5, 6)
  ax.legend()
  ax.set_title("embedded target pre-training (CPU)")
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("workdir")
  parser.add_argument("out")
  args = parser.parse_args()
  print(plot_pretraining(args.workdir, args.out))


if __name__ == "__main__":
  main()
