"""The embedded target: loads in our code and in transformers, and they decode alike."""

import jax
import numpy as np
import torch

import jetflow_jax
from conftest import run_cli
from jetflow_jax import embedded
from jetflow_jax.embedded import corpus
from jetflow_jax.embedded.evaluation import distinct_ngram_ratio
from jetflow_jax.embedded.head_eval import (agreement_split_by_copy_rule,
                                            copy_rule_agreement_by_depth, copy_rule_next_tokens)
from jetflow_jax.decoding import generate
from jetflow_jax.embedded.prompts import documented_functions


def test_held_out_files_are_never_training_files():
  train, heldout = corpus.split_files()
  assert len(heldout) == len(corpus.HELDOUT_FILES) and not set(train) & set(heldout)
  assert len(train) > 500 and all(f.endswith(".py") for f in train)
  assert set(heldout) == set(corpus.HELDOUT_SAMPLE) | set(corpus.HELDOUT_MODULES)
  assert not set(corpus.HELDOUT_SAMPLE) & set(corpus.HELDOUT_MODULES)
  # The sample is drawn like the corpus: test suites and library modules both.
  assert sum(map(corpus.is_test_file, corpus.HELDOUT_SAMPLE)) == 24


def test_test_suites_are_told_apart_and_get_their_share_of_each_batch():
  from jetflow_jax.embedded.pretrain import training_batch
  assert corpus.is_test_file("test/test_os.py") and corpus.is_test_file("unittest/test/x.py")
  assert corpus.is_test_file("ctypes/tests/util.py") and corpus.is_test_file("test_x.py")
  assert not corpus.is_test_file("os.py") and not corpus.is_test_file("unittest/case.py")
  splits = {"train": np.zeros(100, np.uint16), "train_lib": np.ones(100, np.uint16),
            "train_test": np.full(100, 2, np.uint16)}
  rng = np.random.default_rng(0)
  shared = training_batch(splits, rng, batch=8, seq_len=5, test_share=0.25)
  assert shared.shape == (8, 6) and sorted(shared[:, 0].tolist()) == [1] * 6 + [2] * 2
  assert (training_batch(splits, rng, batch=8, seq_len=5, test_share=None) == 0).all()


def test_bf16_autocast_only_where_the_cpu_has_it(tmp_path):
  from jetflow_jax.embedded.pretrain import cpu_has_native_bf16
  cpuinfo = tmp_path / "cpuinfo"
  cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n")
  assert not cpu_has_native_bf16(str(cpuinfo))
  cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n")
  assert cpu_has_native_bf16(str(cpuinfo))
  assert cpu_has_native_bf16(str(tmp_path / "missing"))  # unknown: trust the flag


def test_a_run_can_start_from_the_shipped_target(tmp_path):
  from jetflow_jax.embedded.pretrain import init_tokenizer_dir, init_weights, model_config
  from transformers import Qwen3ForCausalLM
  shipped = embedded.default_target()
  assert init_tokenizer_dir(shipped) == shipped
  assert init_tokenizer_dir("runs/x/checkpoint.pt").endswith("runs/x/tokenizer")
  weights = init_weights(shipped)
  model = Qwen3ForCausalLM(model_config(8192, 0))
  model.load_state_dict(weights)  # strict: every name and shape of a fresh run's model
  reference = Qwen3ForCausalLM.from_pretrained(shipped, dtype=torch.float32).state_dict()
  assert all(torch.equal(model.state_dict()[k], reference[k]) for k in reference)
  torch.save({"model": weights}, tmp_path / "checkpoint.pt")  # a run's own form reads alike
  assert torch.equal(init_weights(str(tmp_path / "checkpoint.pt"))["lm_head.weight"],
                     reference["lm_head.weight"])


def test_distinct_ngram_ratio():
  assert distinct_ngram_ratio([1, 2, 3, 4, 5, 6]) == 1.0
  assert distinct_ngram_ratio([7, 8] * 20) == 2 / 37  # a 2-token loop has 2 distinct 4-grams
  assert distinct_ngram_ratio([1, 2]) == 0.0


def test_function_prompts_are_signature_and_docstring_dedented():
  source = (
      "class Box:\n"
      "    @property\n"
      "    def size(self, unit='cm'):\n"
      "        \"\"\"The box's size.\n\n        In `unit`.\n        \"\"\"\n"
      "        return 3\n"
      "\n"
      "    def plain(self):\n"
      "        return 1\n"
      "\n"
      "async def fetch():\n"
      "    'Fetches.'\n"
      "    pass\n")
  assert sorted(documented_functions(source)) == [
      "async def fetch():\n    'Fetches.'\n",
      "def size(self, unit='cm'):\n    \"\"\"The box's size.\n\n    In `unit`.\n    \"\"\"\n"]
  assert documented_functions("def broken(:\n") == []


def test_copy_rule_baseline_against_extending_the_text_by_its_period():
  def brute_force(records, depth):
    hits, counts = np.zeros(depth), np.zeros(depth)
    for record in records:
      tokens = record["prompt_ids"] + record["response_ids"]
      for a in range(len(record["prompt_ids"]), len(tokens) - 1):
        earlier = [j for j in range(a) if tokens[j] == tokens[a]]
        guess = list(tokens[:a + 1])
        for _ in range(depth):  # the text goes on repeating itself with the found period
          guess.append(guess[len(guess) - (a - earlier[-1])] if earlier else -1)
        for k in range(1, min(depth, len(tokens) - 1 - a) + 1):
          counts[k - 1] += 1
          hits[k - 1] += guess[a + k] == tokens[a + k]
    return hits / counts

  rng = np.random.default_rng(0)
  records = [{"prompt_ids": rng.integers(0, 4, 5).tolist(),
              "response_ids": rng.integers(0, 4, 30).tolist()} for _ in range(6)]
  got = copy_rule_agreement_by_depth(records, depth=7)
  np.testing.assert_allclose(got, brute_force(records, 7), atol=1e-12)
  assert 0 < got.min() and got.max() < 1

  periodic = [{"prompt_ids": [9, 1, 2, 3], "response_ids": [1, 2, 3] * 6}]
  np.testing.assert_array_equal(copy_rule_agreement_by_depth(periodic, depth=5), np.ones(5))


def test_head_agreement_split_by_where_the_copy_rule_is_right():
  # tokens 5 1 2 | 1 3 1 2 4: response anchors 1 3 1 2, each guessing what followed its latest
  # earlier occurrence: 2, none, 3, 1; the truth is 3 1 2 4, so the rule is never right.
  first = {"prompt_ids": [5, 1, 2], "response_ids": [1, 3, 1, 2, 4]}
  np.testing.assert_array_equal(copy_rule_next_tokens(first), [2, -1, 3, 1])
  # tokens 7 8 | 7 8 7: anchors 7 8 guess 8 7, both right.
  second = {"prompt_ids": [7, 8], "response_ids": [7, 8, 7]}
  np.testing.assert_array_equal(copy_rule_next_tokens(second), [8, 7])
  head = [np.asarray([3, 0, 0, 0]), np.asarray([8, 0])]
  split = agreement_split_by_copy_rule([first, second], head)
  assert split == {"copy_rule_right_share": 2 / 6, "where_copy_rule_right": 1 / 2,
                   "where_copy_rule_wrong": 1 / 4}


def test_shipped_target_loads_in_ours_and_transformers_and_decodes_alike():
  from transformers import AutoTokenizer, Qwen3ForCausalLM
  directory = embedded.default_target()
  tokenizer = AutoTokenizer.from_pretrained(directory)
  assert tokenizer.convert_tokens_to_ids("<|mask|>") == 1 and tokenizer.eos_token_id == 0
  assert len(tokenizer) == 8192
  config, params = jetflow_jax.load_qwen3(directory)
  assert config.num_hidden_layers >= 6 and config.vocab_size == 8192
  count = sum(x.size for x in jax.tree.leaves(params))
  assert 8e6 <= count <= 15e6

  prompt = tokenizer.encode("def fibonacci(n):\n", add_special_tokens=False)
  ours = generate(params, config, [prompt], 16, stop_tokens=()).tokens[0]
  model = Qwen3ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
  with torch.no_grad():
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    logits = model(torch.tensor([prompt])).logits.numpy()
  assert ours == theirs
  np.testing.assert_allclose(jetflow_jax.qwen3_forward(params, config, [prompt]), logits,
                             atol=1e-3, rtol=0)



def test_shipped_heads_decode_exactly_like_ar():
  from transformers import AutoTokenizer
  from jetflow_jax.head_checkpoint import load_head
  from jetflow_jax.decoding import speculative_generate
  directory = embedded.default_target()
  config, params = jetflow_jax.load_qwen3(directory)
  prompt = AutoTokenizer.from_pretrained(directory).encode("import os\n\n\ndef walk(path):\n",
                                                            add_special_tokens=False)
  ar = speculative_generate(params, config, None, None, [prompt], 40, method="ar").tokens
  for kind, method in (("jetflow", "jetflow"), ("dflash", "ddtree"), ("dflash", "dflash")):
    head_config, head_params = load_head(embedded.default_head(kind))
    assert head_config.causal == (kind == "jetflow") and head_config.mask_token_id == 1
    out = speculative_generate(params, config, head_params, head_config, [prompt], 40,
                               method=method, budget=16)
    assert out.tokens == ar, method
    assert out.tau > 1.0, method  # a trained head gets some drafts accepted


def test_decode_with_only_a_prompt_streams_jetflow_on_the_embedded_pair():
  done = run_cli("decode.py", "--prompt", "def fibonacci(n):", "--max-new-tokens", "24")
  assert done.returncode == 0, done.stderr
  assert done.stdout.strip()
  summary = done.stderr.strip().splitlines()[-1]
  assert summary.startswith("[jetflow: 24 tokens") and "tau " in summary
  assert "x over AR, identical to AR]" in summary
