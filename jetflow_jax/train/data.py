"""Training data: JSONL records -> prompt ids -> (regenerated) token rows -> grain batches.

Input records (one JSON object per line) are any of
  {"prompt": "text"}                        one user turn, chat-templated
  {"messages": [{"role": ..., "content": ...}, ...]}   a conversation; a final
                                            assistant turn is dropped and regenerated
  {"prompt_ids": [1, 2, 3]}                 an already tokenized prompt
each with an optional "id". Regenerated records (see `regenerate.py`) are
{"id", "prompt_ids", "response_ids"}: the loss covers the response only.
Rows hold one sample each (right-padded) or, with packing, as many as fit, told
apart by `segment_ids` (1, 2, ... per sample, 0 on padding).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

import grain
import numpy as np

from jetflow_jax.errors import InputError
from jetflow_jax.text import encode_chat

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


def to_sample(record: dict[str, Any], seq_len: int) -> dict[str, np.ndarray]:
  """prompt + response, cut to `seq_len`; the loss mask marks the response."""
  prompt, response = record["prompt_ids"], record["response_ids"]
  tokens = np.asarray((list(prompt) + list(response))[:seq_len], np.int32)
  return {"tokens": tokens, "loss_mask": np.arange(len(tokens)) >= len(prompt)}


def to_row(record: dict[str, Any], seq_len: int) -> dict[str, np.ndarray]:
  """`to_sample` right-padded to `seq_len` (padding: token 0, outside the loss)."""
  sample = to_sample(record, seq_len)
  pad = seq_len - len(sample["tokens"])
  return {name: np.pad(x, (0, pad)) for name, x in sample.items()}


def load_regenerated(path: str, seq_len: int) -> list[dict[str, Any]]:
  """Regenerated records whose response starts inside the sequence length."""
  records = [r for r in read_jsonl(path) if r.get("response_ids")]
  usable = [r for r in records if len(r["prompt_ids"]) < seq_len - 1]
  if not usable:
    raise InputError(f"{path}: no record has a response within seq_len={seq_len} "
                     f"({len(records)} records read)")
  return usable


def make_dataset(records: list[dict[str, Any]], seq_len: int, batch_size: int, seed: int,
                 epochs: int, pack: bool = False) -> tuple[grain.DatasetIterator, int]:
  """(iterator over batches, number of batches): samples shuffled differently each epoch.

  Without `pack`, one padded sample per row. With it, grain's first-fit packing fills
  each row with whole samples (`segment_ids` tells them apart). The last partial batch
  is dropped either way.
  """
  if len(records) < batch_size:
    raise InputError(f"{len(records)} training records are fewer than batch_size={batch_size}")
  samples = grain.MapDataset.source(records).shuffle(seed=seed).repeat(epochs)
  if not pack:
    rows = samples.map(lambda r: to_row(r, seq_len)).batch(batch_size, drop_remainder=True)
    return iter(rows), len(rows)

  def packed_rows(samples: grain.MapDataset) -> grain.IterDataset:
    return grain.experimental.FirstFitPackIterDataset(
        samples.to_iter_dataset(), length_struct={"tokens": seq_len, "loss_mask": seq_len},
        num_packing_bins=batch_size, shuffle_bins=False).map(
            lambda row: {"tokens": row["tokens"], "loss_mask": row["loss_mask"],
                         "segment_ids": row["tokens_segment_ids"]})

  # An iterable dataset has no length: count the rows by packing the lengths alone.
  lengths = samples.map(lambda r: {name: np.zeros(len(x), np.int8)
                                   for name, x in to_sample(r, seq_len).items()})
  num_rows = sum(1 for _ in packed_rows(lengths))
  rows = packed_rows(samples.map(lambda r: to_sample(r, seq_len)))
  return iter(rows.batch(batch_size, drop_remainder=True)), num_rows // batch_size
