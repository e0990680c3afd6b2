"""Training data: JSONL records -> prompt ids; token store + packing plan -> batches.

Input records (one JSON object per line) are any of
  {"prompt": "text"}                        one user turn, chat-templated
  {"messages": [{"role": ..., "content": ...}, ...]}   a conversation; a final
                                            assistant turn is dropped and regenerated
  {"prompt_ids": [1, 2, 3]}                 an already tokenized prompt
each with an optional "id". Regenerated records (see `regenerate.py`) are
{"id", "prompt_ids", "response_ids"}: the loss covers the response only.
Regenerated records live in a token store (`store.py`); a packing plan (`packing.py`)
says which samples fill each row. Rows hold one sample each (right-padded) or, with
packing, as many as fit, told apart by `segment_ids` (1, 2, ... per sample, 0 on padding).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator, Sequence

import grain
import numpy as np

from jetflow_jax.errors import InputError
from jetflow_jax.text import encode_chat
from jetflow_jax.train.packing import PackingPlan
from jetflow_jax.train.store import TokenStore

# A batch's arrays, in the order the train step takes them; `segment_ids` only in packed rows.
ROW_ARRAYS = ("tokens", "loss_mask", "segment_ids")


def read_jsonl(path: str) -> Iterator[dict[str, Any]]:
  """The records of a JSONL file, with errors that name the file and line."""
  if not os.path.isfile(path):
    raise InputError(f"data file not found: {path}")
  with open(path) as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise InputError(f"{path}:{number}: not valid JSON ({e.msg})") from None
      if not isinstance(record, dict):
        raise InputError(f"{path}:{number}: each line must be a JSON object")
      yield record


def record_id(record: dict[str, Any], index: int) -> str:
  return str(record.get("id", index))


def prompt_ids(record: dict[str, Any], tokenizer, where: str) -> list[int]:
  """Token ids of a record's prompt (chat template, thinking off, generation prompt added)."""
  if "prompt_ids" in record:
    return [int(t) for t in record["prompt_ids"]]
  if tokenizer is None:
    raise InputError(f"{where}: text prompts need a tokenizer (set data.tokenizer) or give "
                     "prompt_ids")
  if "prompt" in record:
    messages = [{"role": "user", "content": record["prompt"]}]
  elif "messages" in record:
    messages = list(record["messages"])
    if messages and messages[-1].get("role") == "assistant":
      messages = messages[:-1]
  else:
    raise InputError(f"{where}: a record needs 'prompt', 'messages' or 'prompt_ids'")
  return encode_chat(tokenizer, messages)


def fill_row(samples: Sequence[tuple[np.ndarray, int]], seq_len: int) -> dict[str, np.ndarray]:
  """One row of `seq_len` from `(tokens, prompt length)` samples placed back to back.

  Each sample is cut to `seq_len`; the loss mask marks response tokens; `segment_ids`
  numbers the samples 1, 2, ... (0 on the right padding: token 0, outside the loss).
  """
  tokens = np.zeros(seq_len, np.int32)
  loss_mask = np.zeros(seq_len, bool)
  segment_ids = np.zeros(seq_len, np.int32)
  at = 0
  for segment, (sample, prompt_len) in enumerate(samples, 1):
    n = min(len(sample), seq_len - at)
    tokens[at:at + n] = sample[:n]
    loss_mask[at + min(prompt_len, n):at + n] = True
    segment_ids[at:at + n] = segment
    at += n
  return {"tokens": tokens, "loss_mask": loss_mask, "segment_ids": segment_ids}


def to_row(record: dict[str, Any], seq_len: int) -> dict[str, np.ndarray]:
  """A regenerated record alone in a row: prompt + response cut to `seq_len`, loss on the
  response, right-padded."""
  tokens = np.asarray(list(record["prompt_ids"]) + list(record["response_ids"]), np.int32)
  row = fill_row([(tokens, len(record["prompt_ids"]))], seq_len)
  return {"tokens": row["tokens"], "loss_mask": row["loss_mask"]}


class StoreBatches:
  """Global batch `step` of a packing plan, as the rows `rows` of it that this process feeds.

  Random access by step (a grain data source): resuming at step s is starting at index s,
  whatever the number of processes before or now. Without packing, rows carry no
  `segment_ids` (one sample each).
  """

  def __init__(self, store: TokenStore, plan: PackingPlan, seq_len: int, batch_size: int,
               rows: slice | None = None, pack: bool = True):
    self.store, self.plan, self.seq_len, self.batch_size = store, plan, seq_len, batch_size
    self.rows = rows or slice(0, batch_size)
    self.names = ROW_ARRAYS if pack else ROW_ARRAYS[:2]

  def __len__(self) -> int:
    return self.plan.num_steps(self.batch_size)

  def __getitem__(self, step: int) -> dict[str, np.ndarray]:
    first = step * self.batch_size
    rows = [fill_row([(self.store.tokens(i), int(self.store.prompt_lengths[i]))
                      for i in self.plan.row(first + r)], self.seq_len)
            for r in range(self.rows.start, self.rows.stop)]
    return {name: np.stack([row[name] for row in rows]) for name in self.names}


def batch_iterator(batches: StoreBatches, start_step: int, prefetch: int = 4) -> Iterator[dict]:
  """Batches from `start_step` on, assembled by a background thread `prefetch` steps ahead."""
  dataset = grain.MapDataset.source(batches)[start_step:]
  return iter(dataset.to_iter_dataset(grain.ReadOptions(num_threads=1,
                                                        prefetch_buffer_size=prefetch)))
