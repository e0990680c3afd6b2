"""Plot a training run's metrics.jsonl: loss and per-depth agreement with the target.

  python -m jetflow_jax.train.plot WORKDIR            # writes WORKDIR/training.png
"""

from __future__ import annotations

import argparse
import json
import os

from jetflow_jax import cli
from jetflow_jax.errors import InputError


def plot_metrics(workdir: str, out: str | None = None) -> str:
  """Writes a two-panel PNG next to the metrics (or to `out`); returns its path."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.isfile(path):
    raise InputError(f"{workdir} has no metrics.jsonl; is it a training workdir?")
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    raise InputError("plotting needs matplotlib: pip install 'jetflow_jax[plot]'") from None
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  steps = [r["step"] for r in rows]
  fig, (loss_ax, agree_ax) = plt.subplots(1, 2, figsize=(11, 4))
  loss_ax.plot(steps, [r["loss"] for r in rows], label="loss")
  loss_ax.plot(steps, [r["forward_kl"] for r in rows], "--", label="forward KL")
  loss_ax.set(xlabel="step", title="training loss", yscale="log")
  loss_ax.legend()
  depth = len(rows[0]["agreement_k"])
  for k in range(min(depth, 5)):
    agree_ax.plot(steps, [r["agreement_k"][k] for r in rows], label=f"depth {k + 1}")
  agree_ax.set(xlabel="step", ylim=(0, 1), title="top-1 agreement with the target")
  agree_ax.legend()
  fig.tight_layout()
  out = out or os.path.join(workdir, "training.png")
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("workdir")
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  cli.run(lambda: print(plot_metrics(args.workdir, args.out)))


if __name__ == "__main__":
  main()
