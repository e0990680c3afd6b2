"""train.py end to end: the tiny config, kill-and-resume exactness,
fine-tuning from a head, config validation."""

import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import jetflow_jax
from conftest import CLI_ENV, ROOT, run_cli
from jetflow_jax.config_files import head_config, load_config_file, target_config
from jetflow_jax.errors import ConfigError
from jetflow_jax.decoding import generate
from jetflow_jax.head import init_head_params, lm_head_columns
from jetflow_jax.head_acceptance import load_acceptance, measure_acceptance
from jetflow_jax.head_checkpoint import load_head, save_hf_head
from jetflow_jax.train import setup
from jetflow_jax.train.draft_vocab import most_frequent, response_token_counts
from jetflow_jax.train.store import ShardWriter, TokenStore

# A small-vocabulary random target and pre-tokenized prompts: fast enough to run three times.
FAST = ["--config.target.random.vocab_size=128", "--config.target.random.num_hidden_layers=4",
        "--config.head.mask_token_id=127", "--config.head.target_layer_ids=(0,2)",
        "--config.data.seq_len=48", "--config.data.max_new_tokens=24",
        "--config.train.batch_size=4", "--config.train.num_steps=30",
        "--config.train.checkpoint_every=10", "--config.train.log_every=5"]


def train_args(workdir, *extra):
  return ["train.py", "--config=configs/tiny.py", f"--workdir={workdir}", *extra]


@pytest.fixture
def prompt_ids_file(tmp_path):
  rng = np.random.default_rng(0)
  path = tmp_path / "prompts.jsonl"
  with open(path, "w") as f:
    for i in range(40):
      f.write(json.dumps({"id": i, "prompt_ids": rng.integers(0, 127, 6).tolist()}) + "\n")
  return str(path)


def test_tiny_config_runs_end_to_end(tmp_path, prompt_ids_file):
  """With a draft vocabulary of 2,048 tokens: the K most frequent response tokens of the store,
  the target's LM-head rows for them, kept through training; the head decodes losslessly. With
  eval.prompts, the run ends by measuring the head's acceptance on them, as
  `measure_acceptance` reads it on the target's continuations."""
  workdir = tmp_path / "tiny"
  done = run_cli(*train_args(workdir, "--config.train.num_steps=6",
                             "--config.head.draft_vocab_size=2048",
                             f"--config.eval.prompts={prompt_ids_file}", "--config.eval.count=3",
                             "--config.eval.max_new_tokens=16"))
  assert done.returncode == 0, done.stderr[-3000:]
  assert "done: step 6" in done.stdout and "draft vocabulary: the 2048 of 151936" in done.stdout
  lines = [json.loads(l) for l in open(workdir / "metrics.jsonl")]
  assert lines[-1]["step"] == 6 and len(lines[-1]["agreement_k"]) == 7
  config, params = load_head(str(workdir))
  exported_config, exported = load_head(str(workdir / "hf_head"))
  assert exported_config == config and config.causal and config.block_size == 8
  assert config.draft_vocab_size == 2048
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-3), exported,
               params)  # the export is bfloat16

  store = TokenStore(str(workdir / "store"))
  ids = most_frequent(response_token_counts(store, 151936), 2048)
  np.testing.assert_array_equal(params["draft_vocab"]["target_ids"], ids)
  target_config, target_params = setup.load_target(load_config_file("configs/tiny.py"))
  np.testing.assert_array_equal(params["lm_head"]["kernel"],
                                lm_head_columns(target_params, target_config, ids))
  prompts = [store.tokens(r)[:store.prompt_lengths[r]].tolist() for r in range(2)]
  result = jetflow_jax.speculative_generate(target_params, target_config, params, config,
                                            prompts, 16, budget=8, top_k=3, stop_tokens=())
  assert result.tokens == generate(target_params, target_config, prompts, 16,
                                   stop_tokens=()).tokens

  held_out = [json.loads(line)["prompt_ids"] for line in open(prompt_ids_file)][:3]
  expected = measure_acceptance(params, config, target_params, target_config,
                                list(zip(held_out, generate(target_params, target_config,
                                                            held_out, 16).tokens)))
  for head_dir in (workdir, workdir / "hf_head"):
    kept = load_acceptance(str(head_dir))
    assert kept.anchors == expected.anchors == 3 * 32
    np.testing.assert_allclose(kept.tau_n, expected.tau_n, atol=1e-4)
    np.testing.assert_allclose(kept.predicted_n, expected.predicted_n, atol=1e-4)
  assert f"held out ({prompt_ids_file}): {expected.summary()}" in done.stdout


def test_killed_run_resumes_to_identical_parameters(tmp_path, prompt_ids_file):
  fast = FAST + [f"--config.data.prompts={prompt_ids_file}"]
  straight = tmp_path / "straight"
  done = run_cli(*train_args(straight, *fast))
  assert done.returncode == 0, done.stderr[-3000:]

  killed = tmp_path / "killed"
  process = subprocess.Popen([sys.executable, *train_args(killed, *fast)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=CLI_ENV)
  try:
    deadline = time.time() + 600
    while not os.path.isdir(killed / "checkpoints" / "10") and time.time() < deadline:
      time.sleep(0.05)
  finally:  # killed whatever happened above, so no run outlives the test
    process.send_signal(signal.SIGKILL)
    process.wait()
  assert os.path.isdir(killed / "checkpoints" / "10")
  assert not os.path.isdir(killed / "hf_head"), "the run was meant to die before finishing"
  resumed = run_cli(*train_args(killed, *fast))
  assert resumed.returncode == 0, resumed.stderr[-3000:]

  _, want = load_head(str(straight))
  _, got = load_head(str(killed))
  jax.tree.map(np.testing.assert_array_equal, got, want)

  # SIGTERM's save-and-exit-0 and its exact resume: test_multiprocess_training (one process
  # of the two signalled, resumed on another process count).
  steps = lambda workdir: [json.loads(line)["step"] for line in open(workdir / "metrics.jsonl")]
  assert steps(killed) == steps(straight) == [5, 10, 15, 20, 25, 30]

  # A staged script re-run from the top: the earlier, shorter stage leaves the later one alone.
  exported = (killed / "hf_head" / "model.safetensors").read_bytes()
  earlier_stage = run_cli(*train_args(killed, *fast, "--config.train.num_steps=20"))
  assert earlier_stage.returncode == 0, earlier_stage.stderr[-3000:]
  assert "nothing to do" in earlier_stage.stdout and "already at step 30" in earlier_stage.stdout
  assert (killed / "hf_head" / "model.safetensors").read_bytes() == exported
  assert steps(killed) == [5, 10, 15, 20, 25, 30]

  other_head = run_cli(*train_args(straight, *fast, "--config.head.causal=False"))
  assert other_head.returncode == 2 and "different head" in other_head.stderr
  assert "Traceback" not in other_head.stderr


QWEN3 = {  # config.json fields of the released models (no weights needed)
    "qwen3_8b": dict(model_type="qwen3", num_hidden_layers=36, hidden_size=4096,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False),
    "qwen3_4b": dict(model_type="qwen3", num_hidden_layers=36, hidden_size=2560,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True),
    "qwen3_30b_a3b": dict(model_type="qwen3_moe", num_hidden_layers=48, hidden_size=2048,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936),
    "qwen3_0_6b": dict(model_type="qwen3", num_hidden_layers=28, hidden_size=1024,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True),
}


def config_dir(tmp_path, name):
  directory = tmp_path / name
  directory.mkdir()
  fields = dict(QWEN3[name], rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960)
  (directory / "config.json").write_text(json.dumps(fields))
  return str(directory)


@pytest.mark.parametrize("name,taps,target_size,head_size", [
    ("qwen3_8b", "[1, 9, 17, 25, 33]", "8.19B", "1.049B"),  # the reference head: about 1B
    ("qwen3_4b", "[1, 9, 17, 25, 33]", "4.02B", "0.537B"),
    ("qwen3_30b_a3b", "[1, 12, 23, 34, 45]", "30.53B", "0.304B")])
def test_real_configs_validate_against_config_json(tmp_path, name, taps, target_size, head_size):
  done = run_cli("train.py", f"--config=configs/{name}.py", "--validate_only",
                 f"--config.target.checkpoint={config_dir(tmp_path, name)}")
  assert done.returncode == 0, done.stderr[-2000:]
  assert f"taps {taps}" in done.stdout and "config.json only" in done.stdout
  assert f"({target_size} params" in done.stdout and f"{head_size} params" in done.stdout


def test_head_that_does_not_fit_the_target_is_explained(tmp_path):
  done = run_cli("train.py", "--config=configs/qwen3_8b.py", "--validate_only",
                 f"--config.target.checkpoint={config_dir(tmp_path, 'qwen3_0_6b')}",
                 "--config.head.hidden_size=4096", "--config.head.mask_token_id=200000")
  assert done.returncode == 2 and "Traceback" not in done.stderr
  for problem in ("hidden_size 4096 != target hidden_size 1024", "[33] out of range [0, 26]",
                  "mask_token_id 200000 out of range"):
    assert problem in done.stderr


def test_init_head_starts_from_an_exported_head(tmp_path):
  spec = importlib.util.spec_from_file_location("tiny", os.path.join(ROOT, "configs", "tiny.py"))
  tiny = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tiny)
  head = setup.head_config(tiny.get_config(), setup.target_config(tiny.get_config()))
  start = tmp_path / "start"
  params = init_head_params(head, jax.random.key(7))
  save_hf_head(params, head, str(start))

  # A zero learning rate: the run's exported head is exactly the one it started from.
  workdir = tmp_path / "tuned"
  done = run_cli(*train_args(workdir, f"--config.train.init_head={start}",
                             "--config.train.lr=0", "--config.train.num_steps=2"))
  assert done.returncode == 0, done.stderr[-3000:]
  _, want = load_head(str(start))
  _, got = load_head(str(workdir / "hf_head"))
  jax.tree.map(np.testing.assert_array_equal, got, want)

  other = tmp_path / "other"
  save_hf_head(params, dataclasses.replace(head, causal=False), str(other))
  mismatch = run_cli(*train_args(tmp_path / "mismatch", f"--config.train.init_head={other}"))
  assert mismatch.returncode == 2 and "Traceback" not in mismatch.stderr
  assert "train.init_head" in mismatch.stderr and "different head" in mismatch.stderr


def test_bad_data_is_named_and_nothing_is_written(tmp_path):
  def refused(workdir, data, problem):
    done = run_cli(*train_args(workdir, *FAST, "--config.data.prompts=",
                               f"--config.data.regenerated={data}"), timeout=300)
    assert done.returncode == 2 and problem in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and not os.path.exists(workdir)

  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"id": 0, "prompt_ids": [1, 2], "response_ids": [3]}\n{"prompt_ids": [1]}\n')
  refused(tmp_path / "w1", bad, "bad.jsonl:2: not a regenerated record")
  store = tmp_path / "store"
  writer = ShardWriter(str(store), 0, 2)
  writer.append([("a", 0, [1, 2], [3, 4, 5])])
  writer.finish()
  writer.close()
  refused(tmp_path / "w2", store, "shard shard-00001-of-00002 is missing")
  refused(tmp_path / "w3", tmp_path / "nowhere", "data.regenerated not found")


@pytest.mark.parametrize("config,problem", [
    ("configs/nonexistent.py", "--config file not found: configs/nonexistent.py"),
    ("{raising}", "failed to load: ZeroDivisionError: division by zero"),
    ("configs/embedded.py:nope", "configs/embedded.py takes :jetflow, :dflash or :quick (got 'nope')")])
def test_a_config_file_that_does_not_load_is_one_error_line(tmp_path, config, problem):
  raising = tmp_path / "raising.py"
  raising.write_text("def get_config():\n  return 1 / 0\n")
  done = run_cli("train.py", f"--config={config.format(raising=raising)}",
                 f"--workdir={tmp_path / 'w'}", timeout=120)
  assert done.returncode == 2 and done.stderr.startswith("error: "), done.stderr[-2000:]
  assert problem in done.stderr and len(done.stderr.strip().splitlines()) == 1
  assert not os.path.exists(tmp_path / "w")


def test_a_regenerated_path_that_does_not_exist_creates_nothing(tmp_path):
  """The issue's case: before, a typo in a store's path started a regeneration there."""
  nowhere = tmp_path / "nonexistent"
  for extra, problem in [((), "data.prompts and data.regenerated are both set"),
                        (("--config.data.prompts=",), "data.regenerated not found")]:
    done = run_cli(*train_args(tmp_path / "w", f"--config.data.regenerated={nowhere}", *extra),
                   timeout=120)
    assert done.returncode == 2 and problem in done.stderr, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1
    assert not os.path.exists(nowhere) and not os.path.exists(tmp_path / "w")


def data_config(**data):
  spec = importlib.util.spec_from_file_location("tiny", os.path.join(ROOT, "configs", "tiny.py"))
  tiny = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tiny)
  config = tiny.get_config()
  config.data.prompts = config.data.regenerated = config.data.store = ""
  config.data.update(data)
  return config


@pytest.mark.parametrize("data,problem", [
    (dict(regenerated="{tmp}/nowhere"), "data.regenerated not found"),
    (dict(regenerated="{tmp}/empty"), "is a directory but not a token store"),
    (dict(store="{tmp}/store"), "data.store={tmp}/store names where to regenerate data.prompts"),
    (dict(prompts="{tmp}/missing.jsonl"), "data.prompts not found"),
    (dict(prompts="{tmp}/prompts.jsonl", store="{tmp}/busy"),
     "data.store {tmp}/busy is a directory that is neither empty nor a token store"),
    (dict(prompts="{tmp}/prompts.jsonl", store="{tmp}/prompts.jsonl"), "is a file"),
    (dict(prompts="{tmp}/prompts.jsonl", store="{tmp}/no/store"),
     "data.store={tmp}/no/store: its parent directory does not exist"),
    (dict(prompts="{tmp}/prompts.jsonl", regenerate_backend="vllm"),
     "data.regenerate_backend must be one of"),
    (dict(), "set data.prompts (a JSONL of prompts to regenerate) or data.regenerated")])
def test_data_settings_are_checked_before_anything_is_written(tmp_path, data, problem):
  (tmp_path / "empty").mkdir()
  (tmp_path / "busy").mkdir()
  (tmp_path / "busy" / "notes.txt").write_text("not a store")
  (tmp_path / "prompts.jsonl").write_text('{"prompt_ids": [1, 2]}\n')
  before = sorted(os.listdir(tmp_path))
  config = data_config(**{k: v.format(tmp=tmp_path) for k, v in data.items()})
  with pytest.raises(ConfigError) as refused:
    setup.training_store(config, str(tmp_path / "w"))
  assert problem.format(tmp=tmp_path) in str(refused.value)
  assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("evaluation,problem", [
    (dict(prompts="{tmp}/missing.jsonl"), "eval.prompts not found: {tmp}/missing.jsonl"),
    (dict(prompts="{tmp}/prompts.jsonl"), "eval.prompts is data.prompts"),
    (dict(prompts="{tmp}/held_out.jsonl", count=0), "eval.count and eval.max_new_tokens must be "
     "positive")])
def test_eval_prompts_are_checked_before_anything_is_written(tmp_path, evaluation, problem):
  for name in ("prompts.jsonl", "held_out.jsonl"):
    (tmp_path / name).write_text('{"prompt_ids": [1, 2]}\n')
  before = sorted(os.listdir(tmp_path))
  config = data_config(prompts=str(tmp_path / "prompts.jsonl"))
  config.eval.update({k: v.format(tmp=tmp_path) if isinstance(v, str) else v
                      for k, v in evaluation.items()})
  with pytest.raises(ConfigError) as refused:
    setup.training_store(config, str(tmp_path / "w"))
  assert problem.format(tmp=tmp_path) in str(refused.value)
  assert sorted(os.listdir(tmp_path)) == before


def test_a_new_store_may_go_into_an_empty_directory_or_resume_one(tmp_path):
  (tmp_path / "prompts.jsonl").write_text('{"prompt_ids": [1, 2]}\n')
  (tmp_path / "empty").mkdir()
  writer = ShardWriter(str(tmp_path / "resumed"), 0, 1)
  writer.close()
  for store in ("empty", "resumed", "new"):
    setup.check_data(data_config(prompts=str(tmp_path / "prompts.jsonl"),
                                 store=str(tmp_path / store)), str(tmp_path / "w"))
  setup.check_data(data_config(regenerated=str(tmp_path / "resumed")), str(tmp_path / "w"))
  assert not os.path.exists(tmp_path / "new") and not os.path.exists(tmp_path / "w")


def test_training_ends_with_the_decode_command_for_its_head(tmp_path):
  """`make train`'s config is checked and fits its target; the command it ends with runs
  decode.py on the head (the embedded target is decode.py's default)."""
  quick = load_config_file("configs/embedded.py:quick")
  setup.check_data(quick, str(tmp_path / "w"))
  head_config(quick, target_config(quick)).validate_for(target_config(quick))
  assert setup.how_to_decode(quick, "runs/quick").splitlines() == [
      "head: runs/quick/hf_head",
      "decode with it: python decode.py --head runs/quick --prompt 'def fibonacci(n):'",
      "its prior for --budget auto, on prompts it did not train on: python -m "
      "jetflow_jax.train.measure_acceptance --head runs/quick --prompts HELD_OUT.jsonl"]
  quick.target.checkpoint = "/models/Qwen3 8B"
  assert "python decode.py --checkpoint '/models/Qwen3 8B' --head" in setup.how_to_decode(
      quick, "runs/quick")
  assert "decode.py cannot load it" in setup.how_to_decode(data_config(), "runs/tiny")
  quick.eval.prompts = "held_out.jsonl"
  assert setup.how_to_decode(quick, "runs/quick").endswith(
      "its prior for --budget auto, on prompts it did not train on: measured on held_out.jsonl, "
      "in runs/quick/acceptance.json")
