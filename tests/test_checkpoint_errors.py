"""Bad checkpoints give one clear error that names the problem."""

import json
import os

import pytest

import jetflow_jax
from jetflow_jax.errors import CheckpointError, ConfigError


def edit_config(directory, **changes):
  path = os.path.join(directory, "config.json")
  with open(path) as f:
    raw = json.load(f)
  raw.update(changes)
  with open(path, "w") as f:
    json.dump(raw, f)


def test_missing_directory(tmp_path):
  with pytest.raises(CheckpointError, match="not found"):
    jetflow_jax.load_qwen3(str(tmp_path / "nope"))


def test_missing_config_json(tmp_path):
  with pytest.raises(CheckpointError, match="no config.json"):
    jetflow_jax.load_qwen3(str(tmp_path))


def test_unsupported_model_type(make_checkpoint):
  directory, _ = make_checkpoint()
  edit_config(directory, model_type="llama")
  with pytest.raises(ConfigError, match="model_type 'llama' is not supported"):
    jetflow_jax.load_qwen3(directory)


def test_no_weights(make_checkpoint):
  directory, _ = make_checkpoint()
  os.remove(os.path.join(directory, "model.safetensors"))
  with pytest.raises(CheckpointError, match="no \\*.safetensors"):
    jetflow_jax.load_qwen3(directory)


def test_missing_shard_is_named(make_checkpoint):
  directory, _ = make_checkpoint(max_shard_size="40KB")
  shard = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))[1]
  os.remove(os.path.join(directory, shard))
  with pytest.raises(CheckpointError, match=f"missing: {shard}"):
    jetflow_jax.load_qwen3(directory)


def test_truncated_file_is_named(make_checkpoint):
  directory, _ = make_checkpoint()
  path = os.path.join(directory, "model.safetensors")
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) - 1000)
  with pytest.raises(CheckpointError, match="model.safetensors is truncated"):
    jetflow_jax.load_qwen3(directory)


def test_every_shape_mismatch_is_listed(make_checkpoint):
  directory, _ = make_checkpoint()
  edit_config(directory, intermediate_size=128)
  with pytest.raises(CheckpointError) as error:
    jetflow_jax.load_qwen3(directory)
  message = str(error.value)
  assert "9 tensor(s) with shapes that disagree" in message  # 3 layers x gate/up/down
  assert "model.layers.2.mlp.down_proj.weight: checkpoint has [64, 96], config implies [64, 128]" \
      in message


def test_missing_tensor_is_listed(make_checkpoint):
  directory, _ = make_checkpoint(tie_word_embeddings=True)
  edit_config(directory, tie_word_embeddings=False)
  with pytest.raises(CheckpointError, match="1 tensor\\(s\\) missing: lm_head.weight"):
    jetflow_jax.load_qwen3(directory)
