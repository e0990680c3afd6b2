"""Training data: JSONL records -> prompt ids -> (regenerated) token rows -> grain batches.

Input records (one JSON object per line) are any of
  {"prompt": "text"}                        one user turn, chat-templated
  {"messages": [{"role": ..., "content": ...}, ...]}   a conversation; a final
                                            assistant turn is dropped and regenerated
  {"prompt_ids": [1, 2, 3]}                 an already tokenized prompt
each with an optional "id". Regenerated records (see `regenerate.py`) are
{"id", "prompt_ids", "response_ids"}: the loss covers the response only.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

import grain
import numpy as np

from jetflow_jax.errors import InputError
from jetflow_jax.text import encode_chat


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


def to_row(record: dict[str, Any], seq_len: int) -> dict[str, np.ndarray]:
  """prompt + response, cut or right-padded to `seq_len`; the loss mask marks the response."""
  prompt, response = record["prompt_ids"], record["response_ids"]
  tokens = np.zeros((seq_len,), np.int32)
  loss_mask = np.zeros((seq_len,), bool)
  sequence = (list(prompt) + list(response))[:seq_len]
  tokens[:len(sequence)] = sequence
  loss_mask[len(prompt):len(sequence)] = True
  return {"tokens": tokens, "loss_mask": loss_mask}


def load_regenerated(path: str, seq_len: int) -> list[dict[str, Any]]:
  """Regenerated records whose response starts inside the sequence length."""
  records = [r for r in read_jsonl(path) if r.get("response_ids")]
  usable = [r for r in records if len(r["prompt_ids"]) < seq_len - 1]
  if not usable:
    raise InputError(f"{path}: no record has a response within seq_len={seq_len} "
                     f"({len(records)} records read)")
  return usable


def make_dataset(records: list[dict[str, Any]], seq_len: int, batch_size: int, seed: int,
                 epochs: int) -> grain.MapDataset:
  """Shuffled (differently each epoch), padded, batched rows; the last partial batch dropped."""
  if len(records) < batch_size:
    raise InputError(f"{len(records)} training records are fewer than batch_size={batch_size}")
  return (grain.MapDataset.source(records).shuffle(seed=seed).repeat(epochs)
          .map(lambda r: to_row(r, seq_len)).batch(batch_size, drop_remainder=True))
