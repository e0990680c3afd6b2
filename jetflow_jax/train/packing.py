"""The packing plan: which samples fill which row, for every epoch, from the lengths alone.

Each epoch shuffles the usable samples (its own seed) and, with packing, fills rows of
`seq_len` tokens first-fit over a few open rows: a sample goes into the first open row with
room for it, or, when none has room, the fullest open row is closed and a new one opened.
That loop is vectorised across chunks of an epoch (each chunk packs independently, all
chunks advance one sample per NumPy step), so a million samples pack in about a second.
Without packing every row holds one sample. Rows are batched in order; the last partial
batch is dropped.

The plan is computed once, saved in the workdir and reloaded (memory-mapped) on resume: a
restart costs the same whatever the number of records, and the data position is just the
step, which any process count can take up.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np

from jetflow_jax.errors import ConfigError, InputError

PLAN_DIR = "packing_plan"
OPEN_ROWS = 16  # rows a chunk fills at once; more fills rows a little better, more slowly
CHUNK = 16384  # samples per independently packed chunk: bounds the NumPy loop's length


@dataclasses.dataclass(frozen=True)
class PackingPlan:
  """Rows as runs of sample indices: row r holds `samples[row_starts[r]:row_starts[r + 1]]`."""

  row_starts: np.ndarray  # [num_rows + 1]
  samples: np.ndarray  # [num_slots] record indices of the store, row by row
  meta: dict  # what the plan was made from, and its fill

  @property
  def num_rows(self) -> int:
    return len(self.row_starts) - 1

  def num_steps(self, batch_size: int) -> int:
    return self.num_rows // batch_size

  def row(self, r: int) -> np.ndarray:
    return self.samples[self.row_starts[r]:self.row_starts[r + 1]]


def usable_samples(lengths: np.ndarray, prompt_lengths: np.ndarray, seq_len: int) -> np.ndarray:
  """Records with a response that starts inside `seq_len` (room for an anchor and its label)."""
  return np.flatnonzero((lengths > prompt_lengths) & (prompt_lengths < seq_len - 1))


def first_fit_rows(sizes_kc: np.ndarray, seq_len: int, open_rows: int = OPEN_ROWS) -> np.ndarray:
  """Row serial (within its chunk) of every sample, first-fit packing each chunk independently.

  `sizes_kc` is [chunks, samples per chunk]; zero sizes are padding (placed anywhere, unused).
  """
  chunks, steps = sizes_kc.shape
  fill = np.zeros((chunks, open_rows), np.int64)
  serial = np.tile(np.arange(open_rows), (chunks, 1))
  next_serial = np.full(chunks, open_rows)
  rows_kc = np.empty((chunks, steps), np.int64)
  every = np.arange(chunks)
  for t in range(steps):
    size = sizes_kc[:, t]
    fits = fill + size[:, None] <= seq_len
    fitted = fits.any(1)
    slot = np.where(fitted, fits.argmax(1), fill.argmax(1))
    opened = every[~fitted]
    serial[opened, slot[opened]] = next_serial[opened]
    next_serial[opened] += 1
    fill[opened, slot[opened]] = 0
    fill[every, slot] += size
    rows_kc[:, t] = serial[every, slot]
  return rows_kc


def _pack_epochs(orders: list[np.ndarray], sizes: np.ndarray, seq_len: int,
                 open_rows: int) -> tuple[np.ndarray, np.ndarray]:
  """(row_starts, samples) of all epochs' orders packed, epoch after epoch, chunk after chunk."""
  chunk_runs = [run for order in orders
                for run in np.array_split(order, max(1, -(-len(order) // CHUNK)))]
  width = max(len(run) for run in chunk_runs)
  samples_kc = np.full((len(chunk_runs), width), -1, np.int64)
  for k, run in enumerate(chunk_runs):
    samples_kc[k, :len(run)] = run
  sizes_kc = np.where(samples_kc >= 0, sizes[np.maximum(samples_kc, 0)], 0)
  rows_kc = first_fit_rows(sizes_kc, seq_len, open_rows)
  real = samples_kc >= 0
  # Rows in chunk order, then in the order they were opened; samples within a row in the order
  # they were placed (the stable sort keeps it).
  keys = (np.arange(len(chunk_runs))[:, None] * (width + open_rows + 1) + rows_kc)[real]
  _, row_of = np.unique(keys, return_inverse=True)
  order = np.argsort(row_of, kind="stable")
  counts = np.bincount(row_of)
  return np.concatenate([[0], np.cumsum(counts)]), samples_kc[real][order]


def make_plan(lengths: np.ndarray, prompt_lengths: np.ndarray, *, seq_len: int, epochs: int,
              seed: int, pack: bool, open_rows: int = OPEN_ROWS, source: dict | None = None
              ) -> PackingPlan:
  """The plan for `epochs` epochs of the records with these lengths.

  Each epoch shuffles the usable records (seeded by `seed` and the epoch); with `pack`, each
  row is filled first-fit with as many whole samples as fit, else one sample a row.

  Returns:
    The `PackingPlan`: row r holds samples `samples[row_starts[r]:row_starts[r + 1]]`.

  Raises:
    InputError: no record has a response within `seq_len`.
  """
  usable = usable_samples(lengths, prompt_lengths, seq_len)
  if not len(usable):
    raise InputError(f"no record has a response within seq_len={seq_len} "
                     f"({len(lengths)} records in the store)")
  orders = [np.random.default_rng([seed, epoch]).permutation(usable) for epoch in range(epochs)]
  sizes = np.minimum(lengths, seq_len)
  if pack:
    row_starts, samples = _pack_epochs(orders, sizes, seq_len, open_rows)
  else:
    samples = np.concatenate(orders)
    row_starts = np.arange(len(samples) + 1)
  num_rows = len(row_starts) - 1
  meta = {"inputs": plan_inputs(seq_len=seq_len, epochs=epochs, seed=seed, pack=pack,
                                open_rows=open_rows, source=source),
          "num_rows": num_rows, "usable_records": int(len(usable)),
          "fill": float(sizes[samples].sum() / (num_rows * seq_len))}
  return PackingPlan(row_starts.astype(np.int64), samples.astype(np.int32), meta)


def plan_inputs(*, seq_len: int, epochs: int, seed: int, pack: bool, open_rows: int = OPEN_ROWS,
                source: dict | None = None) -> dict:
  """Everything a plan depends on; a saved plan is reused only when these agree."""
  return {"seq_len": seq_len, "epochs": epochs, "seed": seed, "pack": pack,
          "open_rows": open_rows if pack else 0, "store": source}


def save_plan(plan: PackingPlan, workdir: str) -> None:
  """Writes `workdir/packing_plan/` whole: built beside it, then renamed into place."""
  final = os.path.join(workdir, PLAN_DIR)
  tmp = f"{final}.tmp{os.getpid()}"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  np.save(os.path.join(tmp, "row_starts.npy"), plan.row_starts)
  np.save(os.path.join(tmp, "samples.npy"), plan.samples)
  with open(os.path.join(tmp, "plan.json"), "w") as f:
    json.dump(plan.meta, f, indent=2)
  shutil.rmtree(final, ignore_errors=True)
  os.replace(tmp, final)


def load_plan(workdir: str) -> PackingPlan | None:
  """The saved plan (memory-mapped), or None when the workdir has none."""
  directory = os.path.join(workdir, PLAN_DIR)
  if not os.path.isfile(os.path.join(directory, "plan.json")):
    return None
  with open(os.path.join(directory, "plan.json")) as f:
    meta = json.load(f)
  load = lambda name: np.load(os.path.join(directory, name), mmap_mode="r")
  return PackingPlan(load("row_starts.npy"), load("samples.npy"), meta)


def check_plan(plan: PackingPlan, inputs: dict, workdir: str) -> None:
  """Refuses to resume with a plan made for other data or settings."""
  saved = plan.meta["inputs"]
  changed = [f"{key} {saved.get(key)!r} -> {value!r}" for key, value in inputs.items()
             if saved.get(key) != value]
  if changed:
    raise ConfigError(f"{workdir} was trained on another data plan ({'; '.join(changed)}); "
                      "resume with the settings it started with, or use a new --workdir")
