"""Training metrics: JSON lines always, TensorBoard when a SummaryWriter is installed."""

from __future__ import annotations

import json
import os

import numpy as np


def _tensorboard_writer(logdir: str):
  for module in ("tensorboardX", "torch.utils.tensorboard"):
    try:
      return __import__(module, fromlist=["SummaryWriter"]).SummaryWriter(logdir)
    except ImportError:
      continue
  return None


class MetricsWriter:
  """Appends one JSON object per logged step to `workdir/metrics.jsonl`."""

  def __init__(self, workdir: str):
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")
    self._tensorboard = _tensorboard_writer(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, metrics: dict, seconds: float) -> dict:
    row = {"step": step}
    for name, value in metrics.items():
      value = np.asarray(value)
      row[name] = value.tolist() if value.ndim else value.item()
    row["seconds_per_step"] = seconds
    self._jsonl.write(json.dumps(row) + "\n")
    self._jsonl.flush()
    if self._tensorboard is not None:
      for name, value in row.items():
        if name == "step":
          continue
        values = value if isinstance(value, list) else [value]
        suffixes = [f"/depth{k + 1}" for k in range(len(values))] if isinstance(value, list) else [""]
        for suffix, v in zip(suffixes, values):
          self._tensorboard.add_scalar(name + suffix, v, step)
    return row

  @staticmethod
  def summary(row: dict) -> dict:
    """The few numbers that fit on a progress bar."""
    agreement = row.get("agreement_k", [])
    return {"loss": f"{row['loss']:.4f}", "lr": f"{row['learning_rate']:.2e}",
            "agree@1..3": "/".join(f"{a:.2f}" for a in agreement[:3])}

  def close(self) -> None:
    self._jsonl.close()
    if self._tensorboard is not None:
      self._tensorboard.close()
