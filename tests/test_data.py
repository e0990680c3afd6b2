"""Training data: prompt ids from every record kind, rows and masks, resumable regeneration."""

import json

import numpy as np
import pytest

import jetflow_jax
from jetflow_jax.errors import InputError
from jetflow_jax.generate import generate
from jetflow_jax.text import bundled_qwen3_tokenizer_dir, load_tokenizer
from jetflow_jax.train.data import load_regenerated, make_dataset, prompt_ids, read_jsonl, to_row
from jetflow_jax.train.regenerate import jax_generator, regenerate, torch_generator
from jetflow_jax.sampling import Greedy


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


def test_dataset_batches_and_reshuffles_each_epoch():
  records = [{"prompt_ids": [i], "response_ids": [i, i]} for i in range(6)]
  iterator, num_batches = make_dataset(records, 4, 3, seed=0, epochs=2, pack=False)
  batches = list(iterator)
  assert len(batches) == num_batches == 4 and batches[0]["tokens"].shape == (3, 4)
  first = np.concatenate([b["tokens"][:, 0] for b in batches[:2]])
  second = np.concatenate([b["tokens"][:, 0] for b in batches[2:]])
  assert sorted(first) == sorted(second) == list(range(6)) and list(first) != list(second)


def test_packed_rows_hold_whole_samples_once_per_epoch():
  rng = np.random.default_rng(0)
  records = [{"prompt_ids": [100 + i] * 2, "response_ids": [i] * int(rng.integers(1, 12))}
             for i in range(30)]
  iterator, num_batches = make_dataset(records, 16, 2, seed=0, epochs=2, pack=True)
  batches = list(iterator)
  assert len(batches) == num_batches and num_batches < 30  # fewer rows than samples
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
  # Each sample once per epoch, bar those of the dropped last row (at most 16 // 3 of >= 3 tokens).
  counts = np.bincount(seen, minlength=30)
  assert counts.max() <= 2 and counts.sum() >= 2 * 30 - 16 // 3


def test_bad_data_files_are_named(tmp_path):
  with pytest.raises(InputError, match="not found"):
    list(read_jsonl(str(tmp_path / "none.jsonl")))
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "a"}\n{oops\n')
  with pytest.raises(InputError, match="bad.jsonl:2: not valid JSON"):
    list(read_jsonl(str(bad)))
  short = tmp_path / "short.jsonl"
  short.write_text(json.dumps({"id": 0, "prompt_ids": [1] * 50, "response_ids": [2]}) + "\n")
  with pytest.raises(InputError, match="no record has a response within seq_len=16"):
    load_regenerated(str(short), 16)


def test_regeneration_resumes_and_matches_generate(make_checkpoint, tmp_path):
  directory, _ = make_checkpoint(num_hidden_layers=2)
  config, params = jetflow_jax.load_qwen3(directory)
  rng = np.random.default_rng(0)
  records = [{"id": f"p{i}", "prompt_ids": rng.integers(0, 90, int(rng.integers(3, 9))).tolist()}
             for i in range(7)]
  out = tmp_path / "regenerated.jsonl"
  generate_batch = jax_generator(params, config, max_new_tokens=6, sampler=Greedy())
  kwargs = dict(batch_size=3, max_prompt_len=64)
  assert regenerate(records[:4], str(out), generate_batch, **kwargs) == 4
  with open(out, "a") as f:
    f.write('{"id": "p5", "prompt_ids": [1')  # a write torn by a kill
  assert regenerate(records, str(out), generate_batch, **kwargs) == 3
  lines = [json.loads(line) for line in open(out)]
  assert sorted(line["id"] for line in lines) == [f"p{i}" for i in range(7)]
  for line in lines:
    want = generate(params, config, [line["prompt_ids"]], 6).tokens[0]
    assert line["response_ids"] == want


def test_torch_regeneration_decodes_like_our_loop(make_checkpoint):
  """transformers' greedy generate, left-padded in one batch, gives our loop's tokens per prompt."""
  directory, _ = make_checkpoint(num_hidden_layers=2, eos_token_id=23)  # some rows emit it
  config, params = jetflow_jax.load_qwen3(directory)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(8, 90, n).tolist() for n in (3, 9, 5, 12)]
  responses = torch_generator(directory, max_new_tokens=10, temperature=0.0)(prompts, 0)
  assert responses == jax_generator(params, config, 10, Greedy())(prompts, 0)
  assert [len(r) for r in responses if r[-1] == 23 and len(r) < 10], "no row stopped early"
  with pytest.raises(InputError, match="Hugging Face checkpoint directory"):
    torch_generator(str(directory) + "-missing", 4, 0.0)
