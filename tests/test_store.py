"""The token store: appends, recovery after a kill, shards read in source order, conversion
from JSONL, a store of another process count read as it is, and every bad store named."""

import json
import os

import numpy as np
import pytest

from jetflow_jax.errors import InputError
from jetflow_jax.train import setup
from jetflow_jax.train.store import ShardWriter, TokenStore, convert_jsonl, converted_from


def random_records(rng, count):
  return [(f"r{i}", i, rng.integers(0, 1000, int(rng.integers(1, 6))).tolist(),
           rng.integers(0, 1000, int(rng.integers(0, 9))).tolist()) for i in range(count)]


def write(directory, records, shard=0, num_shards=1, batches=3, finish=True):
  writer = ShardWriter(str(directory), shard, num_shards)
  for part in np.array_split(np.arange(len(records)), batches):
    writer.append(records[i] for i in part)
  if finish:
    writer.finish()
  writer.close()


def test_shards_read_back_in_source_order(tmp_path):
  records = random_records(np.random.default_rng(0), 23)
  for shard in range(3):  # process p of 3 wrote records p, p + 3, ...
    write(tmp_path, records[shard::3], shard, 3)
  store = TokenStore(str(tmp_path))
  assert store.num_records == 23
  for i, (_, _, prompt, response) in enumerate(records):
    assert store.tokens(i).tolist() == prompt + response
    assert store.prompt_lengths[i] == len(prompt) and store.lengths[i] == len(prompt + response)
  assert store.num_tokens == sum(len(p) + len(r) for _, _, p, r in records)
  assert store.max_token == max(max(p + r) for _, _, p, r in records)
  one_shard = tmp_path / "one"
  write(one_shard, records)
  assert TokenStore(str(one_shard)).fingerprint() == store.fingerprint()


def test_a_torn_batch_is_dropped_on_reopen(tmp_path):
  records = random_records(np.random.default_rng(1), 10)
  write(tmp_path, records[:6], finish=False)
  shard = tmp_path / "shard-00000-of-00001"
  with open(shard / "tokens.i32", "ab") as f:
    f.write(np.arange(5, dtype=np.int32).tobytes())
  with open(shard / "ids.txt", "a") as f:
    f.write("r6\nr")
  with open(shard / "index.i64", "ab") as f:
    f.write(b"\x01\x02\x03")  # part of one index row
  writer = ShardWriter(str(tmp_path), 0, 1)
  assert writer.done_ids == {f"r{i}" for i in range(6)}
  writer.append(records[6:])
  writer.finish()
  writer.close()
  store = TokenStore(str(tmp_path))
  assert [store.tokens(i).tolist() for i in range(10)] == [p + r for _, _, p, r in records]


def test_bad_stores_are_named(tmp_path):
  records = random_records(np.random.default_rng(2), 8)
  with pytest.raises(InputError, match="token store not found"):
    TokenStore(str(tmp_path / "none"))
  os.makedirs(tmp_path / "empty")
  with pytest.raises(InputError, match="not a token store"):
    TokenStore(str(tmp_path / "empty"))
  write(tmp_path / "s", records[0::2], 0, 2)
  with pytest.raises(InputError, match="shard shard-00001-of-00002 is missing"):
    TokenStore(str(tmp_path / "s"))
  write(tmp_path / "s", records[1::2], 1, 2, finish=False)
  with pytest.raises(InputError, match="shard shard-00001-of-00002 is incomplete"):
    TokenStore(str(tmp_path / "s"))
  with pytest.raises(InputError, match="store of 2 shards; this run writes 3"):
    ShardWriter(str(tmp_path / "s"), 0, 3)
  write(tmp_path / "s", [], 1, 2)
  TokenStore(str(tmp_path / "s"))
  tokens = tmp_path / "s" / "shard-00001-of-00002" / "tokens.i32"
  os.truncate(tokens, os.path.getsize(tokens) - 4)
  with pytest.raises(InputError, match="shard shard-00001-of-00002 is torn: tokens.i32"):
    TokenStore(str(tmp_path / "s"))


def test_jsonl_converts_once_and_bad_lines_leave_nothing(tmp_path):
  records = random_records(np.random.default_rng(3), 12)
  jsonl = tmp_path / "regenerated.jsonl"
  with open(jsonl, "w") as f:
    for record_id, _, prompt, response in records:
      f.write(json.dumps({"id": record_id, "prompt_ids": prompt, "response_ids": response,
                          "response": "text"}) + "\n")
    f.write("\n")
  store = convert_jsonl(str(jsonl), str(tmp_path / "store"))
  assert [store.tokens(i).tolist() for i in range(12)] == [p + r for _, _, p, r in records]
  assert converted_from(str(tmp_path / "store"))["size"] == os.path.getsize(jsonl)

  for line, problem in (('{"prompt_ids": [1], "response_ids": [2]}\n{oops', "bad.jsonl:2: not "
                         "valid JSON"),
                        ('{"prompt_ids": [1], "response_ids": [2]}\n{"prompt_ids": [1]}',
                         "bad.jsonl:2: not a regenerated record .*response_ids"),
                        ('[1, 2]', "bad.jsonl:1: each line must be a JSON object"),
                        ('{"prompt_ids": [1], "response_ids": [-3]}', "token ids must be in")):
    (tmp_path / "bad.jsonl").write_text(line)
    with pytest.raises(InputError, match=problem):
      convert_jsonl(str(tmp_path / "bad.jsonl"), str(tmp_path / "bad_store"))
    assert not [n for n in os.listdir(tmp_path) if n.startswith("bad_store")]


def test_a_store_of_another_process_count_trains_as_it_is(tmp_path):
  from configs import tiny
  records = random_records(np.random.default_rng(4), 7)
  (tmp_path / "prompts.jsonl").write_text("".join(
      json.dumps({"id": record_id, "prompt_ids": prompt}) + "\n"
      for record_id, _, prompt, _ in records))
  config = tiny.get_config()
  config.data.prompts = str(tmp_path / "prompts.jsonl")
  config.data.store = str(tmp_path / "store")
  for shard in range(2):  # regenerated by 2 processes; this one resumes the run alone
    write(tmp_path / "store", records[shard::2], shard, 2)
  store = setup.training_store(config, str(tmp_path / "workdir"))
  assert [store.tokens(i).tolist() for i in range(7)] == [p + r for _, _, p, r in records]
  os.remove(tmp_path / "store" / "shard-00001-of-00002" / "complete.json")
  with pytest.raises(InputError, match="shard-00001-of-00002 is incomplete.*2 processes "
                                       "regenerated it and this job has 1: finish it with 2"):
    setup.training_store(config, str(tmp_path / "workdir"))
