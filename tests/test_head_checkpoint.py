"""Reference-layout head checkpoints: export, import, round trip, config checks."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from jetflow_jax.config import Qwen3Config
from jetflow_jax.errors import ConfigError
from jetflow_jax.head import init_head_params
from jetflow_jax.head_checkpoint import load_head, save_hf_head
from jetflow_jax.head_config import HeadConfig

TARGET = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)


@pytest.mark.parametrize("causal", [True, False])
def test_export_import_round_trip(tmp_path, causal):
  head = HeadConfig.for_target(TARGET, num_layers=3, block_size=8, mask_token_id=95, causal=causal)
  params = init_head_params(head, jax.random.key(1))
  save_hf_head(params, head, str(tmp_path), dtype=jnp.float32)
  loaded_config, loaded = load_head(str(tmp_path))
  assert loaded_config == head
  jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_export_is_the_reference_layout(tmp_path):
  head = HeadConfig.for_target(TARGET, num_layers=2, block_size=16, mask_token_id=95)
  save_hf_head(init_head_params(head, jax.random.key(0)), head, str(tmp_path))
  raw = json.loads((tmp_path / "config.json").read_text())
  assert raw["block_size"] == 16 and raw["num_target_layers"] == 8
  assert raw["dflash_config"] == {"target_layer_ids": [1, 5], "mask_token_id": 95,
                                  "causal_head": True}
  with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
    keys = set(f.keys())
    assert f.get_slice("fc.weight").get_shape() == [64, 128]  # [out, in] like torch Linear
    assert f.get_slice("layers.1.self_attn.q_proj.weight").get_shape() == [64, 64]
    assert f.get_slice("layers.0.self_attn.o_proj.weight").get_shape() == [64, 64]
  per_layer = {"input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
               "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
               "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
  want = {f"layers.{i}.{name}.weight" for i in range(2) for name in per_layer}
  assert keys == want | {"fc.weight", "hidden_norm.weight", "norm.weight"}
  from transformers import AutoConfig  # the reference loads it as a Qwen3 config with extras
  hf = AutoConfig.from_pretrained(str(tmp_path))
  assert hf.model_type == "qwen3" and hf.block_size == 16 and hf.dflash_config["causal_head"]


def test_dflash_config_without_causal_flag_is_bidirectional_with_default_taps():
  raw = HeadConfig.for_target(TARGET, num_layers=2, mask_token_id=95).to_hf_dict()
  del raw["dflash_config"]
  head = HeadConfig.from_hf_dict(raw)
  assert not head.causal and head.target_layer_ids == (1, 5)


def test_misfit_head_lists_every_problem():
  head = HeadConfig.for_target(TARGET, num_layers=2, mask_token_id=95,
                               target_layer_ids=(1, 7, 9), hidden_size=32)
  with pytest.raises(ConfigError) as error:
    head.validate_for(TARGET)
  message = str(error.value)
  assert "hidden_size 32 != target hidden_size 64" in message
  assert "target_layer_ids [7, 9] out of range [0, 6]" in message


def test_not_a_head_config(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
  with pytest.raises(ConfigError, match="not a draft-head config"):
    load_head(str(tmp_path))
