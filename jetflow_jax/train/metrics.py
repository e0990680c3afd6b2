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


def _step_of(line: str) -> float:
  """The step of a metrics line; infinity for a line torn by a kill (so it is dropped)."""
  try:
    return json.loads(line)["step"]
  except (json.JSONDecodeError, KeyError, TypeError):
    return float("inf")


class MetricsWriter:
  """Appends one JSON object per logged step to `workdir/metrics.jsonl`.

  Rows past `resume_step` (logged by a run that died before its next checkpoint)
  are dropped, so a resumed run's file reads as one uninterrupted run.
  """

  def __init__(self, workdir: str, resume_step: int = 0):
    path = os.path.join(workdir, "metrics.jsonl")
    if os.path.isfile(path):
      with open(path) as f:
        kept = [line for line in f if _step_of(line) <= resume_step]
      with open(path, "w") as f:
        f.writelines(kept)
    self._jsonl = open(path, "a")
    self._tensorboard = _tensorboard_writer(os.path.join(workdir, "tensorboard"))

  @staticmethod
  def row(step: int, metrics: dict, seconds: float) -> dict:
    """One logged step as plain numbers."""
    row = {"step": step}
    for name, value in metrics.items():
      value = np.asarray(value)
      row[name] = value.tolist() if value.ndim else value.item()
    row["seconds_per_step"] = seconds
    return row

  def write(self, step: int, metrics: dict, seconds: float) -> dict:
    row = self.row(step, metrics, seconds)
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
