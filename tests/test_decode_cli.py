"""decode.py with a draft head: methods, statistics, AR comparison, and clear errors."""

import json

import jax
import jax.numpy as jnp
import pytest

import jetflow_jax
from conftest import run_cli
from jetflow_jax.decoding import generate
from jetflow_jax.head import init_head_params
from jetflow_jax.head_checkpoint import save_hf_head
from jetflow_jax.head_config import HeadConfig


@pytest.fixture
def target_and_head(make_checkpoint, tmp_path):
  directory, _ = make_checkpoint(num_hidden_layers=4, max_position_embeddings=64)
  config, _ = jetflow_jax.load_qwen3(directory)
  head = HeadConfig.for_target(config, num_layers=1, block_size=5, mask_token_id=95,
                               target_layer_ids=(0, 2))
  head_dir = str(tmp_path / "head")
  save_hf_head(init_head_params(head, jax.random.key(0)), head, head_dir, dtype=jnp.float32)
  return directory, head_dir


def test_jetflow_json_reports_statistics_and_equals_ar(target_and_head):
  directory, head_dir = target_and_head
  done = run_cli("decode.py", "--checkpoint", directory, "--head", head_dir, "--prompt-ids",
                 "1,2,3,4", "--max-new-tokens", "12", "--budget", "8", "--top-k", "3",
                 "--batch-size", "2", "--json", "--compare-ar")
  assert done.returncode == 0, done.stderr
  out = json.loads(done.stdout)
  config, params = jetflow_jax.load_qwen3(directory)
  assert out["method"] == "jetflow"
  assert out["token_ids"] == generate(params, config, [[1, 2, 3, 4]], 12).tokens[0]
  assert out["identical_to_ar"] is True and out["speedup"] > 0 and out["ar_wall_s"] > 0
  assert out["speedup"] == pytest.approx(out["ar_wall_s"] / out["compared_wall_s"], rel=0.01)
  assert len(out["rows"]) == 2 and out["rows"][0]["token_ids"] == out["rows"][1]["token_ids"]
  assert sum(out["accepted_lengths"]) == len(out["token_ids"]) - 1  # the prefill gives the first
  assert out["num_target_forwards"] == len(out["accepted_lengths"]) + 1
  assert out["tau"] >= 1 and out["stop_reason"][0] in ("max_tokens", "stop_token")


def test_streamed_text_and_a_full_cache_is_reported(target_and_head):
  directory, head_dir = target_and_head
  done = run_cli("decode.py", "--checkpoint", directory, "--head", head_dir, "--method", "dflash",
                 "--prompt-ids", "1,2,3", "--max-new-tokens", "20", "--cache-size", "8")
  assert done.returncode == 0, done.stderr
  assert done.stdout.strip()
  assert "warning: method dflash with a causal (JetFlow) head" in done.stderr
  assert "stopped after 5 of 20 tokens: the KV cache is full" in done.stderr


@pytest.mark.parametrize("args,message", [
    (["--budget", "1"], "budget must be >= 2"),
    (["--budget", "100000"], "exceeds the"),
    (["--top-k", "0"], "top_k must be >= 1"),
    (["--top-k", "97"], "exceeds the vocabulary"),
    (["--max-new-tokens", "70"], "context window of 64"),
    (["--batch-size", "0"], "--batch-size"),
])
def test_bad_input_is_one_clear_line(target_and_head, args, message):
  directory, head_dir = target_and_head
  done = run_cli("decode.py", "--checkpoint", directory, "--head", head_dir, "--prompt-ids",
                 "1,2,3", "--max-new-tokens", "8", *args)
  assert done.returncode == 2, done.stderr
  assert message in done.stderr and "Traceback" not in done.stderr


def test_method_needing_a_head_and_the_long_context_override(target_and_head):
  directory, _ = target_and_head
  done = run_cli("decode.py", "--checkpoint", directory, "--method", "ddtree", "--prompt-ids", "1",
                 "--max-new-tokens", "8")
  assert done.returncode == 2 and "needs a draft head" in done.stderr
  done = run_cli("decode.py", "--checkpoint", directory, "--prompt-ids", "1,2", "--json",
                 "--max-new-tokens", "70", "--allow-long-context")
  assert done.returncode == 0, done.stderr
  assert json.loads(done.stdout)["num_new_tokens"] == 70
