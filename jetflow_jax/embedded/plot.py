"""Curves of the embedded pair: the target's pre-training, and the two heads' training.

  python -m jetflow_jax.embedded.plot runs/embedded/pretrain [runs/embedded/pretrain2 ...] \
      docs/figures/embedded_pretraining.png
  python -m jetflow_jax.embedded.plot --heads runs/embedded/head_jetflow \
      runs/embedded/head_dflash docs/figures/embedded_heads.png
  python -m jetflow_jax.embedded.plot --rollouts runs/embedded/unlikelihood \
      runs/embedded/teacher,runs/embedded/teacher2 \
      docs/figures/target_rollout_finetune.png
"""

from __future__ import annotations

import argparse
import json
import os


def _rows(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def _running_mean(values: list[float], window: int) -> list[float]:
  return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
          for i in range(len(values))]


def _pyplot():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def save_figure(fig, out: str) -> str:
  """Writes `fig` to `out` (its directory made) and returns `out`."""
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=110)
  return out


def plot_pretraining(*workdirs: str, out: str) -> str:
  """Loss against tokens; each further workdir is a stage that continued the one before."""
  plt = _pyplot()
  rows, stage_starts = [], []
  for workdir in workdirs:
    offset = rows[-1]["tokens"] if rows else 0
    rows += [dict(r, tokens=r["tokens"] + offset) for r in _rows(workdir)]
    stage_starts.append(offset)
  tokens = [r["tokens"] / 1e6 for r in rows]
  window = 50  # the per-step loss is noisy; show its running mean
  smooth = _running_mean([r["loss"] for r in rows], window)
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(tokens, smooth, label=f"train (running mean of {window} steps)")
  # Runs before the held-out sample existed logged only the hand-picked modules, as heldout_loss.
  has_sample = any("heldout_modules_loss" in r for r in rows)
  curves = ({"heldout_loss": "held-out sample (40 random files)",
             "heldout_modules_loss": "held-out modules (16 hand-picked)"} if has_sample
            else {"heldout_loss": "held-out stdlib modules"})
  for key, label in curves.items():
    ax.plot(*zip(*[(r["tokens"] / 1e6, r[key]) for r in rows if key in r]), marker="o",
            markersize=3, label=label)
  for stage_start in stage_starts[1:]:
    ax.axvline(stage_start / 1e6, color="grey", linewidth=0.8)
  ax.axhline(2.5, color="grey", linestyle=":", label="quality bar 2.5")
  ax.set_xlabel("training tokens (millions); vertical lines: a stage starts")
  ax.set_ylabel("loss (nats / token)")
  ax.set_ylim(1.5, 6)
  ax.legend()
  ax.set_title("embedded target pre-training (CPU)")
  return save_figure(fig, out)


def _continued(workdirs) -> list[dict]:
  """Metrics rows of runs that each continued the one before, with steps counted on."""
  rows = []
  for workdir in workdirs:
    offset = rows[-1]["step"] if rows else 0
    rows += [dict(r, step=r["step"] + offset) for r in _rows(workdir)]
  return rows


def plot_heads(*workdirs: str, out: str) -> str:
  """Training top-1 agreement at depths 1, 4 and 8 of both heads against step.

  `workdirs` are (JetFlow, DFlash) pairs, one pair per run; a later pair started from the
  earlier pair's heads (`train.init_head`), so its steps count on after a vertical line.
  """
  if not workdirs or len(workdirs) % 2:
    raise SystemExit("--heads takes (JetFlow workdir, DFlash workdir) pairs, one per run")
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(7, 4))
  for label, runs, color in (("JetFlow (causal)", workdirs[0::2], "C0"),
                             ("DFlash (bidirectional)", workdirs[1::2], "C1")):
    rows = _continued(runs)
    steps = [r["step"] for r in rows]
    for depth, style in ((1, "-"), (4, "--"), (8, ":")):
      agreement = _running_mean([r["agreement_k"][depth - 1] for r in rows], 5)
      ax.plot(steps, agreement, style, color=color, label=f"{label}, depth {depth}")
  for runs_before in range(1, len(workdirs) // 2):
    ax.axvline(_continued(workdirs[0:2 * runs_before:2])[-1]["step"], color="grey", linewidth=0.8)
  ax.axhline(0.6, color="grey", linewidth=0.8, label="depth-1 bar 0.6 (held-out)")
  ax.set(xlabel="step" + (" (vertical line: a run continues from the last one's heads)"
                          if len(workdirs) > 2 else ""),
         ylabel="top-1 agreement with the target", ylim=(0, 1),
         title="embedded heads: training agreement (running mean of 5 logs)")
  ax.legend(fontsize=7)
  return save_figure(fig, out)


def plot_rollout_finetunes(*workdirs: str, out: str) -> str:
  """Held-out loss, distinct 4-grams of held-out snippets' greedy continuations and their NLL
  under the starting model against step, one line per fine-tune (`pretrain
  --unlikelihood-batch`), labelled by its workdir's name; `A,B` is one line of a run B that
  continued A (`--init-from A/checkpoint.pt`), its steps counted on."""
  plt = _pyplot()
  panels = (("heldout_loss", "held-out loss (nats/token)", 2.5),
            ("heldout_distinct_4gram", "distinct 4-grams, held-out snippets", 0.4),
            ("heldout_rollout_reference_nll", "their NLL under the starting model", None))
  chains = []  # (label, rows, steps where a later stage starts from a new model)
  for chain in workdirs:
    stages = chain.split(",")
    chains.append((" then ".join(os.path.basename(stage) for stage in stages),
                   _continued(stages),
                   [_continued(stages[:count])[-1]["step"] for count in range(1, len(stages))]))
  fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
  for ax, (key, title, bar) in zip(axes, panels):
    for i, (label, rows, stage_starts) in enumerate(chains):
      points = [(r["step"], r[key]) for r in rows if key in r]
      if points:
        ax.plot(*zip(*points), marker="o", markersize=3, color=f"C{i}", label=label)
      for step in stage_starts:
        ax.axvline(step, color=f"C{i}", linewidth=0.8, linestyle="--")
    if bar is not None:
      ax.axhline(bar, color="grey", linestyle=":", label=f"bar {bar}")
    ax.set(xlabel="fine-tuning step", title=title)
    ax.legend(fontsize=7)
  return save_figure(fig, out)


def main():
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--heads", action="store_true",
                      help="the two head workdirs (JetFlow, then DFlash) instead of the target's")
  parser.add_argument("--rollouts", action="store_true",
                      help="fine-tunes against the target's loops (pretrain --unlikelihood-batch)")
  parser.add_argument("workdirs", nargs="+")
  parser.add_argument("out")
  args = parser.parse_args()
  if args.heads:
    print(plot_heads(*args.workdirs, out=args.out))
  elif args.rollouts:
    print(plot_rollout_finetunes(*args.workdirs, out=args.out))
  else:
    print(plot_pretraining(*args.workdirs, out=args.out))


if __name__ == "__main__":
  main()
