"""The rollout fine-tune plot: a chained run's steps count on from the run it continued."""

import json

import numpy as np

from jetflow_jax.embedded import plot


def _workdir(path, steps, loss):
  path.mkdir()
  with open(path / "metrics.jsonl", "w") as f:
    for step, value in zip(steps, loss):
      f.write(json.dumps({"step": step, "heldout_loss": value, "heldout_distinct_4gram": 0.5,
                          "heldout_rollout_reference_nll": 1.0}) + "\n")
  return str(path)


def test_a_chained_fine_tune_is_one_line_with_steps_counted_on(tmp_path, monkeypatch):
  first = _workdir(tmp_path / "first", [100, 200], [2.6, 2.5])
  second = _workdir(tmp_path / "second", [100, 200], [2.45, 2.4])
  alone = _workdir(tmp_path / "alone", [100], [2.7])
  figures = []
  monkeypatch.setattr(plot, "save_figure", lambda fig, out: figures.append(fig) or out)
  plot.plot_rollout_finetunes(alone, f"{first},{second}", out=str(tmp_path / "p.png"))
  loss_axis = figures[0].axes[0]
  lines = {line.get_label(): line for line in loss_axis.lines}
  chained = lines["first then second"]
  np.testing.assert_array_equal(chained.get_xdata(), [100, 200, 300, 400])
  np.testing.assert_allclose(chained.get_ydata(), [2.6, 2.5, 2.45, 2.4])
  np.testing.assert_array_equal(lines["alone"].get_xdata(), [100])
  stage_lines = [line for line in loss_axis.lines if list(line.get_xdata()) == [200, 200]]
  assert len(stage_lines) == 1  # where the second stage starts
