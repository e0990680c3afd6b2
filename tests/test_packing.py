"""The packing plan: the vectorised first-fit equals a plain loop, every epoch holds every usable
sample once, rows fit, and a saved plan is reused only for the data it was made for."""

import numpy as np
import pytest

from jetflow_jax.errors import ConfigError
from jetflow_jax.train import packing
from jetflow_jax.train.packing import (check_plan, load_plan, make_plan, plan_inputs, save_plan,
                                       usable_samples)


def first_fit_loop(sizes, seq_len, open_rows):
  """The packing rule, one sample at a time: rows as lists of positions in `sizes`."""
  rows, open_ = [], []  # open_: indices into rows
  for i, size in enumerate(sizes):
    fits = [r for r in open_ if sum(sizes[j] for j in rows[r]) + size <= seq_len]
    if fits:
      rows[fits[0]].append(i)
      continue
    if len(open_) == open_rows:  # close the fullest open row (the first of equals), open a new one
      fill = [sum(sizes[j] for j in rows[r]) for r in open_]
      open_[open_.index(open_[int(np.argmax(fill))])] = len(rows)
    else:
      open_.append(len(rows))
    rows.append([i])
  return sorted(rows, key=lambda row: row[0])


@pytest.mark.parametrize("chunk", [10_000, 37])
def test_vectorised_first_fit_equals_the_loop(monkeypatch, chunk):
  monkeypatch.setattr(packing, "CHUNK", chunk)
  rng = np.random.default_rng(0)
  lengths = rng.integers(3, 60, 300)
  prompt_lengths = np.minimum(rng.integers(1, 10, 300), lengths - 1)
  plan = make_plan(lengths, prompt_lengths, seq_len=64, epochs=2, seed=5, pack=True, open_rows=4)
  rows = [plan.row(r).tolist() for r in range(plan.num_rows)]
  usable = usable_samples(lengths, prompt_lengths, 64)
  want = []
  for epoch in range(2):
    order = np.random.default_rng([5, epoch]).permutation(usable)
    for run in np.array_split(order, max(1, -(-len(order) // chunk))):
      loop_rows = first_fit_loop(np.minimum(lengths[run], 64).tolist(), 64, 4)
      # The plan orders a chunk's rows by when they were opened: by their first sample here.
      want += [[int(run[i]) for i in row] for row in loop_rows]
  assert rows == want  # epoch by epoch, chunk by chunk, rows in the order they were opened
  assert sorted(sum(rows, [])) == sorted(list(usable) * 2)
  assert all(np.minimum(lengths[row], 64).sum() <= 64 for row in rows)


def test_epochs_shuffle_differently_and_unpacked_rows_hold_one_sample():
  rng = np.random.default_rng(1)
  lengths = rng.integers(20, 3000, 1000)
  prompt_lengths = rng.integers(1, 20, 1000)
  plan = make_plan(lengths, prompt_lengths, seq_len=3072, epochs=3, seed=0, pack=False)
  assert plan.num_rows == 3000 and (np.diff(plan.row_starts) == 1).all()
  epochs = plan.samples.reshape(3, 1000)
  assert all(sorted(e) == list(range(1000)) for e in epochs)
  assert (epochs[0] != epochs[1]).any() and (epochs[1] != epochs[2]).any()
  packed = make_plan(lengths, prompt_lengths, seq_len=3072, epochs=3, seed=0, pack=True)
  assert packed.meta["fill"] > 0.88 and packed.num_rows < 1700  # about two samples a row


def test_saved_plan_round_trips_and_refuses_other_data(tmp_path):
  lengths, prompt_lengths = np.array([5, 9, 3, 7]), np.array([1, 2, 1, 1])
  plan = make_plan(lengths, prompt_lengths, seq_len=10, epochs=2, seed=0, pack=True,
                   source={"num_records": 4})
  save_plan(plan, str(tmp_path))
  loaded = load_plan(str(tmp_path))
  np.testing.assert_array_equal(loaded.samples, plan.samples)
  np.testing.assert_array_equal(loaded.row_starts, plan.row_starts)
  assert isinstance(loaded.samples, np.memmap)  # read on demand, not held
  same = plan_inputs(seq_len=10, epochs=2, seed=0, pack=True, source={"num_records": 4})
  check_plan(loaded, same, str(tmp_path))
  other = plan_inputs(seq_len=12, epochs=2, seed=0, pack=True, source={"num_records": 5})
  with pytest.raises(ConfigError, match=r"seq_len 10 -> 12.*num_records"):
    check_plan(loaded, other, str(tmp_path))
  assert load_plan(str(tmp_path / "none")) is None
