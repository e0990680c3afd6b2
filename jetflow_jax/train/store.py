"""The token store: regenerated records as flat int32 tokens and an int64 index, memory-mapped.

  STORE/store.json                           format, version, number of shards
  STORE/shard-00000-of-00002/tokens.i32      every record's prompt + response tokens, back to back
                             index.i64       per record: end offset in tokens, prompt length,
                                             source index (its place among the prompts)
                             ids.txt         record ids, one per line
                             complete.json   written once the shard's share is done

One writer per shard (one process each), appending whole batches: tokens, then ids, then
the index rows, flushed in that order, so the index is the commit. A writer reopening a
shard cut short by a kill drops whatever the index does not cover, so regeneration resumes
from the last whole batch. Readers take complete shards only, check every file's size
against the index, and see the records of all shards in source order, whichever process
count wrote them. Nothing is held in Python beyond the per-record index.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import tempfile
import zlib
from typing import Iterable, Sequence

import numpy as np
import tqdm

from jetflow_jax.errors import InputError

FORMAT = "jetflow_jax token store"
VERSION = 1
STORE_FILE = "store.json"
COMPLETE_FILE = "complete.json"
INDEX_FIELDS = 3  # end offset, prompt length, source index
TOKEN_DTYPE = np.dtype("<i4")
INDEX_DTYPE = np.dtype("<i8")


def shard_name(index: int, count: int) -> str:
  return f"shard-{index:05d}-of-{count:05d}"


def is_store(path: str) -> bool:
  return os.path.isfile(os.path.join(path, STORE_FILE))


def num_shards(directory: str) -> int | None:
  """Shards of the store at `directory` (the process count that regenerated it), None if none."""
  if not is_store(directory):
    return None
  return int(_read_json(os.path.join(directory, STORE_FILE)).get("num_shards", 0))


def _write_json(path: str, value: dict) -> None:
  """Whole or not at all: written beside, then renamed over."""
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(value, f, indent=2)
  os.replace(tmp, path)


def _read_json(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise InputError(f"{path} is unreadable ({e})") from None


def create_store(directory: str, num_shards: int, **info) -> None:
  """Makes `directory` a store of `num_shards` shards, or checks that it already is one."""
  path = os.path.join(directory, STORE_FILE)
  if os.path.isfile(path):
    existing = _read_json(path)
    if existing.get("num_shards") != num_shards:
      raise InputError(f"{directory} is a token store of {existing.get('num_shards')} shards; "
                       f"this run writes {num_shards} (one per process). Use the same process "
                       "count to resume it, or a new directory")
    return
  os.makedirs(directory, exist_ok=True)
  _write_json(path, {"format": FORMAT, "version": VERSION, "num_shards": num_shards, **info})


class ShardWriter:
  """Appends records to one shard of a store; resumes after a kill from the last whole batch."""

  def __init__(self, directory: str, shard: int, num_shards: int):
    create_store(directory, num_shards)
    self.path = os.path.join(directory, shard_name(shard, num_shards))
    os.makedirs(self.path, exist_ok=True)
    self._files = {name: os.path.join(self.path, name) for name in ("tokens.i32", "index.i64",
                                                                    "ids.txt")}
    for path in self._files.values():
      open(path, "ab").close()
    self._recover()
    self._tokens = open(self._files["tokens.i32"], "ab")
    self._ids = open(self._files["ids.txt"], "a")
    self._index = open(self._files["index.i64"], "ab")

  def _recover(self) -> None:
    """Cuts every file back to the records the index commits (a kill may have torn a batch)."""
    row_bytes = INDEX_FIELDS * INDEX_DTYPE.itemsize
    index_bytes = os.path.getsize(self._files["index.i64"])
    num_records = index_bytes // row_bytes
    index = np.fromfile(self._files["index.i64"], INDEX_DTYPE, num_records * INDEX_FIELDS)
    num_tokens = int(index[-INDEX_FIELDS]) if num_records else 0
    if os.path.getsize(self._files["tokens.i32"]) < num_tokens * TOKEN_DTYPE.itemsize:
      raise InputError(f"{self.path}: tokens.i32 is shorter than its index says "
                       f"({num_tokens} tokens); the shard is torn. Delete it to regenerate it")
    with open(self._files["ids.txt"]) as f:
      ids = f.read().split("\n")[:num_records]
    if len(ids) < num_records:
      raise InputError(f"{self.path}: ids.txt lists {len(ids)} of the index's {num_records} "
                       "records; the shard is torn. Delete it to regenerate it")
    os.truncate(self._files["index.i64"], num_records * row_bytes)
    os.truncate(self._files["tokens.i32"], num_tokens * TOKEN_DTYPE.itemsize)
    with open(self._files["ids.txt"], "w") as f:
      f.write("".join(i + "\n" for i in ids))
    self.done_ids = set(ids)
    self.num_records = num_records
    self.num_tokens = num_tokens
    self.max_token = int(max((np.max(c) for c in self._token_chunks()), default=-1))

  def _token_chunks(self, size: int = 1 << 24):
    tokens = np.memmap(self._files["tokens.i32"], TOKEN_DTYPE, "r") if self.num_tokens else []
    for start in range(0, len(tokens), size):
      yield tokens[start:start + size]

  def append(self, records: Iterable[tuple[str, int, Sequence[int], Sequence[int]]]) -> None:
    """Commits `(id, source index, prompt ids, response ids)` records, all or none of them."""
    pieces, rows, ids = [], [], []
    end = self.num_tokens
    for record_id, source_index, prompt, response in records:
      record_id = str(record_id)
      if "\n" in record_id:
        raise InputError(f"record id {record_id!r} holds a line break")
      tokens = np.concatenate([np.asarray(prompt, np.int64).reshape(-1),
                               np.asarray(response, np.int64).reshape(-1)])
      if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.int32).max):
        raise InputError(f"record {record_id}: token ids must be in [0, 2**31)")
      end += tokens.size
      pieces.append(tokens.astype(TOKEN_DTYPE))
      rows.append((end, len(prompt), source_index))
      ids.append(record_id)
    if not rows:
      return
    complete = os.path.join(self.path, COMPLETE_FILE)
    if os.path.exists(complete):  # more records after all: no longer complete
      os.remove(complete)
    tokens = np.concatenate(pieces)
    for handle, data in ((self._tokens, tokens.tobytes()),
                         (self._ids, "".join(i + "\n" for i in ids)),
                         (self._index, np.asarray(rows, INDEX_DTYPE).tobytes())):
      handle.write(data)
      handle.flush()
      os.fsync(handle.fileno())
    self.num_records += len(rows)
    self.num_tokens = end
    self.max_token = max(self.max_token, int(tokens.max(initial=-1)))
    self.done_ids.update(ids)

  def finish(self) -> None:
    """Marks the shard complete: training reads only complete shards."""
    _write_json(os.path.join(self.path, COMPLETE_FILE),
                {"num_records": self.num_records, "num_tokens": self.num_tokens,
                 "max_token": self.max_token})

  def close(self) -> None:
    for handle in (self._tokens, self._ids, self._index):
      handle.close()


class TokenStore:
  """A store's complete shards, memory-mapped; record i is the i-th in source order.

  Args:
    directory: the store (written by regeneration, or `convert_jsonl`).

  Raises:
    InputError: no such directory, not a token store, another format version, or a missing,
      incomplete or torn shard (named).
  """

  def __init__(self, directory: str):
    self.directory = directory
    if not os.path.isdir(directory):
      raise InputError(f"token store not found: {directory}")
    if not is_store(directory):
      raise InputError(f"{directory} is not a token store (it has no {STORE_FILE})")
    info = _read_json(os.path.join(directory, STORE_FILE))
    if info.get("format") != FORMAT or info.get("version") != VERSION:
      raise InputError(f"{directory}/{STORE_FILE} is not a version-{VERSION} token store")
    self.info = info
    num_shards = int(info["num_shards"])
    self._tokens, indices, self.max_token = [], [], -1
    for shard in range(num_shards):
      tokens, index, complete = self._open_shard(shard_name(shard, num_shards))
      self._tokens.append(tokens)
      indices.append(index)
      self.max_token = max(self.max_token, complete.get("max_token", -1))
    ends = [i[:, 0] for i in indices]
    starts = [np.concatenate([[0], e[:-1]]) for e in ends]
    shard_of = np.concatenate([np.full(len(i), s, np.int32) for s, i in enumerate(indices)])
    source = np.concatenate([i[:, 2] for i in indices])
    order = np.argsort(source, kind="stable")
    self.shard_of = shard_of[order]
    self.starts = np.concatenate(starts)[order]
    self.lengths = (np.concatenate(ends) - np.concatenate(starts))[order]
    self.prompt_lengths = np.concatenate([i[:, 1] for i in indices])[order]
    self.num_records = len(order)
    self.num_tokens = int(self.lengths.sum())

  def _open_shard(self, name: str):
    path = os.path.join(self.directory, name)
    if not os.path.isdir(path):
      raise InputError(f"{self.directory}: shard {name} is missing")
    if not os.path.isfile(os.path.join(path, COMPLETE_FILE)):
      raise InputError(f"{self.directory}: shard {name} is incomplete (its regeneration has not "
                       "finished; rerun it to complete the shard)")
    complete = _read_json(os.path.join(path, COMPLETE_FILE))
    row_bytes = INDEX_FIELDS * INDEX_DTYPE.itemsize
    sizes = {f: os.path.getsize(os.path.join(path, f)) if os.path.isfile(os.path.join(path, f))
             else -1 for f in ("index.i64", "tokens.i32")}
    want = {"index.i64": complete["num_records"] * row_bytes,
            "tokens.i32": complete["num_tokens"] * TOKEN_DTYPE.itemsize}
    for f, size in sizes.items():
      if size != want[f]:
        raise InputError(f"{self.directory}: shard {name} is torn: {f} holds {max(size, 0)} bytes, "
                         f"{COMPLETE_FILE} says {want[f]}")
    if not complete["num_records"]:
      return np.zeros(0, TOKEN_DTYPE), np.zeros((0, INDEX_FIELDS), np.int64), complete
    index = np.fromfile(os.path.join(path, "index.i64"), INDEX_DTYPE).reshape(-1, INDEX_FIELDS)
    if int(index[-1, 0]) != complete["num_tokens"]:
      raise InputError(f"{self.directory}: shard {name} is torn: its index ends at token "
                       f"{int(index[-1, 0])}, {COMPLETE_FILE} says {complete['num_tokens']}")
    if not complete["num_tokens"]:
      return np.zeros(0, TOKEN_DTYPE), index.astype(np.int64), complete
    tokens = np.memmap(os.path.join(path, "tokens.i32"), TOKEN_DTYPE, "r")
    # Samples are read in shuffled order: read-ahead would pull in pages no batch asks for.
    tokens._mmap.madvise(mmap.MADV_RANDOM)
    return tokens, index.astype(np.int64), complete

  def tokens(self, record: int) -> np.ndarray:
    """Prompt + response tokens of record `record` (a view of the memory map)."""
    start = self.starts[record]
    return self._tokens[self.shard_of[record]][start:start + self.lengths[record]]

  def fingerprint(self) -> dict:
    """What a packing plan depends on: the records' count, lengths and prompt lengths."""
    crc = zlib.crc32(self.lengths.astype(np.int64).tobytes())
    crc = zlib.crc32(self.prompt_lengths.astype(np.int64).tobytes(), crc)
    return {"num_records": self.num_records, "num_tokens": self.num_tokens, "lengths_crc": crc}


def _jsonl_record(line: bytes, where: str) -> tuple[str | None, np.ndarray, np.ndarray]:
  try:
    record = json.loads(line)
  except json.JSONDecodeError as e:
    raise InputError(f"{where}: not valid JSON ({e.msg})") from None
  if not isinstance(record, dict):
    raise InputError(f"{where}: each line must be a JSON object")
  ids = []
  for key in ("prompt_ids", "response_ids"):
    value = record.get(key)
    array = np.asarray(value) if isinstance(value, list) else None
    if array is None or array.ndim != 1 or (array.size and array.dtype.kind != "i"):
      raise InputError(f"{where}: not a regenerated record (needs {key!r}, a list of token ids)")
    ids.append(array.astype(np.int64))
  record_id = record.get("id")
  return None if record_id is None else str(record_id), ids[0], ids[1]


def convert_jsonl(jsonl_path: str, out_dir: str, batch_records: int = 4096) -> TokenStore:
  """Writes a one-shard store from a regenerated JSONL (`{"id", "prompt_ids", "response_ids"}`
  per line), with a progress bar. Nothing is left at `out_dir` unless every line converts.

  Returns:
    The new store, opened.

  Raises:
    InputError: no such file, or a line that is not a regenerated record (named).
  """
  if not os.path.isfile(jsonl_path):
    raise InputError(f"data file not found: {jsonl_path}")
  stat = os.stat(jsonl_path)
  parent = os.path.dirname(os.path.abspath(out_dir))
  made_parent = not os.path.isdir(parent)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".converting-", dir=parent)
  try:
    writer = ShardWriter(tmp, 0, 1)
    pending = []
    with open(jsonl_path, "rb") as f, tqdm.tqdm(total=stat.st_size, unit="B", unit_scale=True,
                                               desc=f"convert {os.path.basename(jsonl_path)}") as bar:
      for number, line in enumerate(f, 1):
        bar.update(len(line))
        if not line.strip():
          continue
        record_id, prompt, response = _jsonl_record(line, f"{jsonl_path}:{number}")
        pending.append((record_id or str(number - 1), number - 1, prompt, response))
        if len(pending) == batch_records:
          writer.append(pending)
          pending = []
    writer.append(pending)
    writer.finish()
    writer.close()
    _write_json(os.path.join(tmp, STORE_FILE),
                {"format": FORMAT, "version": VERSION, "num_shards": 1,
                 "source": {"path": os.path.abspath(jsonl_path), "size": stat.st_size,
                            "mtime_ns": stat.st_mtime_ns}})
    os.replace(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    if made_parent:
      os.rmdir(parent)
    raise
  return TokenStore(out_dir)


def converted_from(store_dir: str) -> dict | None:
  """The JSONL a converted store came from (path, size, mtime), if it was converted."""
  if not is_store(store_dir):
    return None
  return _read_json(os.path.join(store_dir, STORE_FILE)).get("source")
