"""Training data: prompt ids from every record kind, rows and masks, store-backed batches,
resumable regeneration into the token store."""

import json

import numpy as np
import pytest

import jetflow_jax
from jetflow_jax.decoding import generate
from jetflow_jax.errors import InputError
from jetflow_jax.sampling import Greedy
from jetflow_jax.text import bundled_qwen3_tokenizer_dir, load_tokenizer
from jetflow_jax.train.data import StoreBatches, fill_row, prompt_ids, read_jsonl, to_row
from jetflow_jax.train.packing import make_plan
from jetflow_jax.train.regenerate import local_mesh, regenerate
from jetflow_jax.train.regenerate_backends import jax_batches, static_generator, torch_batches
from jetflow_jax.train.store import ShardWriter, TokenStore


def write_store(directory, records):
  """A one-shard store of `{"prompt_ids", "response_ids"}` records, in order."""
  writer = ShardWriter(str(directory), 0, 1)
  writer.append((str(i), i, r["prompt_ids"], r["response_ids"]) for i, r in enumerate(records))
  writer.finish()
  writer.close()
  return TokenStore(str(directory))


@pytest.fixture(scope="module")
def tokenizer():
  return load_tokenizer(bundled_qwen3_tokenizer_dir())


def test_prompt_ids_from_text_messages_and_ids(tokenizer):
  from_prompt = prompt_ids({"prompt": "Sort a list."}, tokenizer, "r")
  from_messages = prompt_ids({"messages": [{"role": "user", "content": "Sort a list."},
                                           {"role": "assistant", "content": "old answer"}]},
                             tokenizer, "r")
  assert from_prompt == from_messages  # the old assistant turn is dropped, then regenerated
  text = tokenizer.decode(from_prompt)
  assert text.startswith("<|im_start|>user\nSort a list.<|im_end|>")
  assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off
  assert prompt_ids({"prompt_ids": [5, 6]}, None, "r") == [5, 6]
  with pytest.raises(InputError, match="need a tokenizer"):
    prompt_ids({"prompt": "x"}, None, "record 3")
  with pytest.raises(InputError, match="'prompt', 'messages' or 'prompt_ids'"):
    prompt_ids({"text": "x"}, tokenizer, "record 3")


def test_rows_are_padded_cut_and_masked_on_the_response():
  row = to_row({"prompt_ids": [1, 2, 3], "response_ids": [4, 5]}, 8)
  assert row["tokens"].tolist() == [1, 2, 3, 4, 5, 0, 0, 0]
  assert row["loss_mask"].tolist() == [False] * 3 + [True] * 2 + [False] * 3
  row = to_row({"prompt_ids": [1, 2, 3], "response_ids": [4, 5, 6, 7]}, 5)
  assert row["tokens"].tolist() == [1, 2, 3, 4, 5] and row["loss_mask"].sum() == 2


def batches_of(tmp_path, records, seq_len, batch_size, epochs, pack):
  store = write_store(tmp_path / "store", records)
  plan = make_plan(store.lengths, store.prompt_lengths, seq_len=seq_len, epochs=epochs, seed=0,
                   pack=pack)
  batches = StoreBatches(store, plan, seq_len, batch_size, pack=pack)
  return [batches[step] for step in range(len(batches))]


def test_dataset_batches_and_reshuffles_each_epoch(tmp_path):
  records = [{"prompt_ids": [i], "response_ids": [i, i]} for i in range(6)]
  batches = batches_of(tmp_path, records, 4, 3, epochs=2, pack=False)
  assert len(batches) == 4 and batches[0]["tokens"].shape == (3, 4)
  assert set(batches[0]) == {"tokens", "loss_mask"}
  first = np.concatenate([b["tokens"][:, 0] for b in batches[:2]])
  second = np.concatenate([b["tokens"][:, 0] for b in batches[2:]])
  assert sorted(first) == sorted(second) == list(range(6)) and list(first) != list(second)
  for batch in batches:
    for tokens, loss_mask in zip(batch["tokens"], batch["loss_mask"]):
      np.testing.assert_array_equal(tokens, to_row(records[tokens[0]], 4)["tokens"])
      np.testing.assert_array_equal(loss_mask, to_row(records[tokens[0]], 4)["loss_mask"])


def test_packed_rows_hold_whole_samples_once_per_epoch(tmp_path):
  rng = np.random.default_rng(0)
  records = [{"prompt_ids": [100 + i] * 2, "response_ids": [i] * int(rng.integers(1, 12))}
             for i in range(30)]
  batches = batches_of(tmp_path, records, 16, 2, epochs=2, pack=True)
  assert len(batches) < 30  # fewer rows than samples
  seen = []
  for batch in batches:
    assert set(batch) == {"tokens", "loss_mask", "segment_ids"}
    for tokens, loss_mask, segment_ids in zip(batch["tokens"], batch["loss_mask"],
                                              batch["segment_ids"]):
      assert (np.diff(segment_ids[segment_ids > 0]) >= 0).all()  # samples are contiguous
      assert not loss_mask[segment_ids == 0].any()
      for segment in np.unique(segment_ids[segment_ids > 0]):
        sample = tokens[segment_ids == segment]
        i = int(sample[0]) - 100
        expected = to_row(records[i], len(sample))
        np.testing.assert_array_equal(sample, expected["tokens"])
        np.testing.assert_array_equal(loss_mask[segment_ids == segment], expected["loss_mask"])
        seen.append(i)
  # Each sample once per epoch, bar those of the dropped last partial batch (at most one row).
  counts = np.bincount(seen, minlength=30)
  assert counts.max() <= 2 and counts.sum() >= 2 * 30 - 16 // 3


def test_fill_row_cuts_and_numbers_samples():
  row = fill_row([(np.array([1, 2, 3]), 1), (np.array([4, 5, 6, 7]), 2)], 6)
  assert row["tokens"].tolist() == [1, 2, 3, 4, 5, 6]
  assert row["loss_mask"].tolist() == [False, True, True, False, False, True]
  assert row["segment_ids"].tolist() == [1, 1, 1, 2, 2, 2]


def test_bad_data_files_are_named(tmp_path):
  with pytest.raises(InputError, match="not found"):
    list(read_jsonl(str(tmp_path / "none.jsonl")))
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "a"}\n{oops\n')
  with pytest.raises(InputError, match="bad.jsonl:2: not valid JSON"):
    list(read_jsonl(str(bad)))
  store = write_store(tmp_path / "short", [{"prompt_ids": [1] * 50, "response_ids": [2]}])
  with pytest.raises(InputError, match="no record has a response within seq_len=16"):
    make_plan(store.lengths, store.prompt_lengths, seq_len=16, epochs=1, seed=0, pack=True)


def test_regeneration_resumes_and_matches_generate(make_checkpoint, tmp_path):
  directory, _ = make_checkpoint(num_hidden_layers=2)
  config, params = jetflow_jax.load_qwen3(directory)
  rng = np.random.default_rng(0)
  records = [{"id": f"p{i}", "prompt_ids": rng.integers(0, 90, int(rng.integers(3, 9))).tolist()}
             for i in range(7)]
  out = tmp_path / "store"
  generator = lambda: static_generator(jax_batches(params, config, Greedy()), 3)
  kwargs = dict(max_new_tokens=6, max_prompt_len=64)
  assert regenerate(records[:4], str(out), generator, **kwargs) == 4
  shard = out / "shard-00000-of-00001"
  with open(shard / "tokens.i32", "ab") as f:  # a batch torn by a kill: tokens written,
    f.write(np.arange(9, dtype=np.int32).tobytes())
  with open(shard / "ids.txt", "a") as f:  # its ids half written, its index not at all
    f.write("p5\np")
  assert regenerate(records, str(out), generator, **kwargs) == 3
  assert regenerate(records, str(out), lambda: pytest.fail("nothing left to load for"),
                    **kwargs) == 0
  store = TokenStore(str(out))
  assert store.num_records == 7
  for i, record in enumerate(records):  # source order, whatever order they were written in
    tokens = store.tokens(i).tolist()
    prompt = record["prompt_ids"]
    assert tokens[:store.prompt_lengths[i]] == prompt
    assert tokens[len(prompt):] == generate(params, config, [prompt], 6).tokens[0]


def test_torch_regeneration_decodes_like_our_loop(make_checkpoint):
  """transformers' greedy generate, left-padded in one batch, gives our loop's tokens per prompt."""
  directory, _ = make_checkpoint(num_hidden_layers=2, eos_token_id=23)  # some rows emit it
  config, params = jetflow_jax.load_qwen3(directory)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(8, 90, n).tolist() for n in (3, 9, 5, 12)]
  responses = torch_batches(directory, temperature=0.0)(prompts, 10, 0)
  assert responses == jax_batches(params, config, Greedy())(prompts, 10, 0)
  assert [len(r) for r in responses if r[-1] == 23 and len(r) < 10], "no row stopped early"
  with pytest.raises(InputError, match="Hugging Face checkpoint directory"):
    torch_batches(str(directory) + "-missing", 0.0)


def test_regeneration_splits_a_target_too_big_for_one_device(make_checkpoint):
  """`--mesh tp=2`: two copies of the target over pytest's 4 devices, each split in two; the
  same responses as one device. A mesh the devices cannot take is refused."""
  directory, _ = make_checkpoint(num_hidden_layers=2)
  config, params = jetflow_jax.load_qwen3(directory)
  mesh = local_mesh("tp=2")
  assert (mesh.size("data"), mesh.size("tp")) == (2, 2)
  _, split = jetflow_jax.load_qwen3(directory, shardings=mesh.param_shardings)
  prompts = [[5, 17, 3], [9, 1, 2, 3, 4, 5], [60, 61], [7, 8, 9, 10]]
  want = jax_batches(params, config, Greedy())(prompts, 8, 0)
  assert jax_batches(split, config, Greedy(), mesh)(prompts, 8, 0) == want
  with pytest.raises(InputError, match="needs 3 devices a copy; this process has 4"):
    local_mesh("tp=3")
  with pytest.raises(InputError, match="names data"):
    local_mesh("data=2")
