"""Head checkpoints, reference layout and speculators format: export, import, round trip, config
checks, draft vocabularies."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from safetensors import safe_open

from conftest import run_cli
from jetflow_jax import embedded
from jetflow_jax.config import Qwen3Config
from jetflow_jax.errors import CheckpointError, ConfigError
from jetflow_jax.head import init_head_params
from jetflow_jax.head_checkpoint import (export_head, head_format, load_head, save_hf_head,
                                         save_speculators_head)
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.speculators_format import Verifier

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


# --- vLLM speculators' format and draft vocabularies -------------------------------------------

VERIFIER = Verifier("Qwen/Qwen3-toy", ("Qwen3ForCausalLM",), 8)
IDS = (0, 3, 4, 9, 20, 31, 50, 77, 90, 94)  # a draft vocabulary of 10 of the 96 tokens


def draft_vocab_head(causal=True):
  head = HeadConfig.for_target(TARGET, num_layers=2, block_size=8, mask_token_id=95,
                               causal=causal, draft_vocab_size=len(IDS))
  params = init_head_params(head, jax.random.key(2))
  params["draft_vocab"] = {"target_ids": jnp.asarray(IDS, jnp.int32)}
  return head, params


@pytest.mark.parametrize("causal,draft_vocab", [(True, False), (False, True)])
def test_speculators_round_trip_is_exact(tmp_path, causal, draft_vocab):
  if draft_vocab:
    head, params = draft_vocab_head(causal)
  else:
    head = HeadConfig.for_target(TARGET, num_layers=2, block_size=8, mask_token_id=95,
                                 causal=causal)
    params = init_head_params(head, jax.random.key(1))
  save_speculators_head(params, head, str(tmp_path), VERIFIER, dtype=jnp.float32)
  assert head_format(str(tmp_path)) == "speculators"
  loaded_config, loaded = load_head(str(tmp_path))
  assert loaded_config == head
  jax.tree.map(np.testing.assert_array_equal, loaded, params)
  # ... and back to the reference layout (ours extended with the draft vocabulary), exactly.
  export_head(str(tmp_path), "reference", str(tmp_path / "reference"), dtype=jnp.float32)
  again_config, again = load_head(str(tmp_path / "reference"))
  assert again_config == head and head_format(str(tmp_path / "reference")) == "reference"
  jax.tree.map(np.testing.assert_array_equal, again, params)


# The fields speculators' config classes declare (speculators 0.9.0 `DFlashSpeculatorConfig`,
# main's `JetSpecSpeculatorConfig`, their `SpeculatorModelConfig` base), then those we add.
BASE_FIELDS = {"speculators_model_type", "speculators_version", "speculators_config",
               "architectures", "transformer_layer_config", "draft_vocab_size", "block_size",
               "target_hidden_size", "aux_hidden_state_layer_ids"}
TYPE_FIELDS = {"dflash": {"mask_token_id", "sliding_window_non_causal", "sample_from_anchor"},
               "jetspec": {"kd_temperature"}}
OURS = {"mask_token_id", "num_target_layers", "tie_word_embeddings", "dtype"}


@pytest.mark.parametrize("causal,kind", [(False, "dflash"), (True, "jetspec")])
def test_speculators_export_has_the_types_fields_and_weight_names(tmp_path, causal, kind):
  head, params = draft_vocab_head(causal)
  save_speculators_head(params, head, str(tmp_path), VERIFIER)
  raw = json.loads((tmp_path / "config.json").read_text())
  assert set(raw) == BASE_FIELDS | TYPE_FIELDS[kind] | OURS
  assert raw["speculators_model_type"] == raw["speculators_config"]["algorithm"] == kind
  assert raw["architectures"] == [{"dflash": "DFlashDraftModel",
                                   "jetspec": "JetSpecDraftModel"}[kind]]
  assert raw["speculators_config"]["verifier"] == {"name_or_path": "Qwen/Qwen3-toy",
                                                   "architectures": ["Qwen3ForCausalLM"]}
  assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 7
  assert raw["aux_hidden_state_layer_ids"] == [2, 6]  # HF hidden_states numbering: taps + 1
  assert raw["draft_vocab_size"] == 10 and raw["transformer_layer_config"]["vocab_size"] == 96
  with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
    keys = set(f.keys())
    d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert f.get_slice("lm_head.weight").get_shape() == [10, 64]
  # The DFlash decoder layer's names (both types' layers), the head's own modules, the buffers.
  per_layer = {"input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
               "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
               "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
  assert keys == ({f"layers.{i}.{n}.weight" for i in range(2) for n in per_layer}
                  | {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t",
                     "t2d"})
  assert d2t.dtype == np.int64 and t2d.dtype == bool and t2d.sum() == 10
  np.testing.assert_array_equal(np.arange(10) + d2t, IDS)  # draft id + d2t = target id
  np.testing.assert_array_equal(np.flatnonzero(t2d), IDS)


def test_a_causal_head_as_the_dflash_type_keeps_its_mask(tmp_path):
  """What vLLM serves today: the dflash type, its layers marked `is_causal` (vLLM's DFlash layers
  read it); it loads back causal. A bidirectional head is never the jetspec type."""
  head, params = draft_vocab_head(causal=True)
  save_speculators_head(params, head, str(tmp_path), VERIFIER, kind="dflash")
  raw = json.loads((tmp_path / "config.json").read_text())
  assert raw["speculators_model_type"] == "dflash"
  assert raw["transformer_layer_config"]["is_causal"] is True
  assert load_head(str(tmp_path))[0] == head
  with pytest.raises(ConfigError, match="not jetspec"):
    save_speculators_head(params, dataclasses.replace(head, causal=False), str(tmp_path / "b"),
                          VERIFIER, kind="jetspec")


def speculators_dir(tmp_path, **changes):
  head = HeadConfig.for_target(TARGET, num_layers=1, block_size=4, mask_token_id=95)
  save_speculators_head(init_head_params(head, jax.random.key(0)), head, str(tmp_path), VERIFIER)
  raw = json.loads((tmp_path / "config.json").read_text())
  for key, value in changes.items():
    if value is None:
      raw.pop(key)
    else:
      raw[key] = value
  (tmp_path / "config.json").write_text(json.dumps(raw))
  return str(tmp_path)


@pytest.mark.parametrize("changes,problem", [
    (dict(mask_token_id=None), "actual tokens as inputs"),
    (dict(aux_hidden_state_layer_ids=[0, 3]), "embedding output"),
    (dict(speculators_model_type="eagle3"), "not a head jetflow_jax drafts"),
    (dict(sample_from_anchor=True), "after the anchor"),
    (dict(draft_vocab_size=200), "exceeds the target's vocabulary")])
def test_speculators_heads_we_cannot_draft_with_are_refused(tmp_path, changes, problem):
  with pytest.raises(ConfigError, match=problem):
    load_head(speculators_dir(tmp_path, **changes))


def test_a_speculators_head_of_unknown_depth_still_loads(tmp_path):
  """A third-party export names a verifier whose config is not here: the head's target depth is
  unknown (0), and only the taps' range is checked against a target."""
  path = speculators_dir(tmp_path, num_target_layers=None)
  config, _ = load_head(path)
  assert config.num_target_layers == 0
  config.validate_for(TARGET)
  with pytest.raises(ConfigError, match="records the target's layer count"):
    save_hf_head(init_head_params(config, jax.random.key(0)), config, str(tmp_path / "ref"))


def test_a_checkpoint_with_other_tensors_or_a_broken_draft_vocab_is_refused(tmp_path):
  head, params = draft_vocab_head()
  save_hf_head(params, head, str(tmp_path), dtype=jnp.float32)
  path = str(tmp_path / "model.safetensors")
  tensors = safetensors.numpy.load_file(path)
  tensors["t2d"] = np.roll(tensors["t2d"], 1)
  safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})
  with pytest.raises(CheckpointError, match="t2d does not mark"):
    load_head(str(tmp_path))
  tensors["layers.0.self_attn.qkv_proj.weight"] = np.zeros((4, 4), np.float32)
  safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})
  with pytest.raises(CheckpointError, match="qkv_proj"):
    load_head(str(tmp_path))


def test_embedded_heads_exported_load_back_bit_for_bit(tmp_path):
  """What `decode.py --head DIR` then drafts with: the shipped (bfloat16) heads, exported as
  their speculators types naming the embedded target, load back as the same head."""
  for kind, speculators_type in (("dflash", "dflash"), ("jetflow", "jetspec")):
    out = tmp_path / kind
    export_head(embedded.HEAD_DIRS[kind], "speculators", str(out))
    raw = json.loads((out / "config.json").read_text())
    assert raw["speculators_model_type"] == speculators_type
    assert raw["speculators_config"]["verifier"]["name_or_path"] == embedded.TARGET_DIR
    want_config, want = load_head(embedded.HEAD_DIRS[kind], jnp.bfloat16)
    got_config, got = load_head(str(out), jnp.bfloat16)
    assert got_config == want_config
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_export_cli_names_what_is_missing_in_one_line(tmp_path):
  head = HeadConfig.for_target(TARGET, num_layers=1, block_size=4, mask_token_id=95)
  save_hf_head(init_head_params(head, jax.random.key(0)), head, str(tmp_path / "head"))
  done = run_cli("-m", "jetflow_jax.export_head", "--head", str(tmp_path / "head"),
                 "--format", "speculators", "--out", str(tmp_path / "out"))
  assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
  assert "pass --verifier" in done.stderr and not (tmp_path / "out").exists()
