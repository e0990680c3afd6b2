"""The convert CLI round-trips params; decode.py prints what `generate` produces."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetflow_jax
from conftest import run_cli
from jetflow_jax.decoding import generate
from jetflow_jax.text import encode_prompt, load_tokenizer





def test_convert_then_load_gives_the_same_params(make_checkpoint, tmp_path):
  directory, _ = make_checkpoint(moe=True)
  out = str(tmp_path / "converted")
  done = run_cli("-m", "jetflow_jax.convert", "--hf", directory, "--out", out, "--dtype", "float32")
  assert done.returncode == 0, done.stderr
  config_hf, params_hf = jetflow_jax.load_qwen3(directory)
  config_conv, params_conv = jetflow_jax.load_qwen3(out)
  assert config_conv == config_hf
  jax.tree.map(np.testing.assert_array_equal, params_conv, params_hf)
  _, params_bf16 = jetflow_jax.load_qwen3(out, dtype=jnp.bfloat16)
  assert {x.dtype for x in jax.tree.leaves(params_bf16)} == {jnp.dtype(jnp.bfloat16)}

  again = run_cli("-m", "jetflow_jax.convert", "--hf", directory, "--out", out)
  assert again.returncode == 2 and "already holds converted params" in again.stderr


def test_decode_json_with_prompt_ids(make_checkpoint):
  directory, _ = make_checkpoint()
  done = run_cli("decode.py", "--checkpoint", directory, "--prompt-ids", "1,2,3,4",
                 "--max-new-tokens", "10", "--json", "--dtype", "float32")
  assert done.returncode == 0, done.stderr
  out = json.loads(done.stdout)
  config, params = jetflow_jax.load_qwen3(directory)
  assert out["token_ids"] == generate(params, config, [[1, 2, 3, 4]], 10).tokens[0]
  assert out["num_target_forwards"] == 10
  assert out["wall_s"] > 0 and out["tokens_per_s"] > 0


def test_decode_streams_chat_text(make_checkpoint):
  directory, _ = make_checkpoint(vocab_size=151936, tokenizer=True)
  done = run_cli("decode.py", "--checkpoint", directory, "--prompt", "Hello there",
                 "--chat", "--max-new-tokens", "12", "--temperature", "0.8", "--seed", "3")
  assert done.returncode == 0, done.stderr
  tokenizer = load_tokenizer(directory)
  ids = encode_prompt(tokenizer, "Hello there", chat=True)
  assert tokenizer.decode(ids).startswith("<|im_start|>user\nHello there<|im_end|>")
  assert done.stdout.strip()  # streamed text
  assert "12 tokens, 12 target forwards" in done.stderr


@pytest.mark.parametrize("args,message", [
    (["--prompt-ids", ",".join(["5"] * 40), "--cache-size", "32"], "does not fit a KV cache"),
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt-ids", "1,99999"], "out of range"),
    (["--prompt", "hi"], "no tokenizer files"),
    (["--prompt-ids", "1", "--top-p", "2"], "top_p"),
    (["--prompt-ids", "1", "--dtype", "float8"], "--dtype"),
])
def test_decode_bad_input_is_one_clear_line(make_checkpoint, args, message):
  directory, _ = make_checkpoint()
  done = run_cli("decode.py", "--checkpoint", directory, *args, "--temperature", "1.0")
  assert done.returncode == 2
  assert message in done.stderr
  assert "Traceback" not in done.stderr


def test_decode_missing_checkpoint_is_one_clear_line(tmp_path):
  done = run_cli("decode.py", "--checkpoint", str(tmp_path / "gone"), "--prompt-ids", "1")
  assert done.returncode == 2 and "not found" in done.stderr and "Traceback" not in done.stderr
