"""vLLM speculators' head format: the `config.json` of its `dflash` and `jetspec` types.

`speculators_model_type` names the type: `dflash` (speculators 0.9.0's
`DFlashSpeculatorConfig`, loaded by its `DFlashDraftModel` and by vLLM's `dflash` method) for
a bidirectional head, `jetspec` (speculators' main branch: `JetSpecSpeculatorConfig`,
`JetSpecDraftModel`) for a causal one. `speculators_config` names the verifier. The weights
keep the reference layout's names (`head_checkpoint.head_tensors`); a draft vocabulary adds
`lm_head.weight` and the `d2t` / `t2d` buffers.

Where speculators' conventions differ from ours:
- it numbers the target's hidden states as HF's `hidden_states` list (0 is the embedding
  output, i + 1 the output of decoder layer i), so `aux_hidden_state_layer_ids` are our taps
  plus one (vLLM's dflash loader subtracts the one again);
- its jetspec type is trained with the block's actual tokens as inputs, each row predicting
  the next token; our causal heads draft from `[anchor, MASK x (block - 1)]` as the reference
  JetSpec does. Our jetspec exports say so by carrying `mask_token_id` (the config classes
  keep fields they do not declare), and a jetspec head without one is refused on import:
  drafting it from MASK rows would run it on inputs it never saw.
Fields of ours that neither type declares ride along the same way: `num_target_layers`, and
`transformer_layer_config.is_causal` (vLLM's DFlash layers read it: a causal head written as
the dflash type, which vLLM serves, keeps its causal in-block attention there).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jetflow_jax import hub
from jetflow_jax.config import Qwen3Config
from jetflow_jax.errors import ConfigError
from jetflow_jax.head_config import HeadConfig

SPECULATORS_VERSION = "0.9.0"  # the release whose config classes these files are checked with
TYPES = {False: "dflash", True: "jetspec"}  # by `HeadConfig.causal`
MODEL_CLASSES = {"dflash": "DFlashDraftModel", "jetspec": "JetSpecDraftModel"}
DEFAULT_ARCHITECTURES = ["Qwen3ForCausalLM"]  # written when the verifier's config is not at hand


@dataclasses.dataclass(frozen=True)
class Verifier:
  """The target a speculators head names: where to load it, and what its config says (None
  for what could not be read here)."""

  name_or_path: str
  architectures: tuple[str, ...] = tuple(DEFAULT_ARCHITECTURES)
  num_hidden_layers: int | None = None

  @property
  def was_read(self) -> bool:
    return self.num_hidden_layers is not None


def is_speculators_config(raw: dict[str, Any]) -> bool:
  return "speculators_model_type" in raw


def verifier_config_json(name_or_path: str) -> dict[str, Any] | None:
  """The verifier's `config.json` (its language model's, for a multimodal one): a local
  directory, or a hub id already in the Hugging Face cache (nothing is downloaded); None
  when neither holds it."""
  path = os.path.join(os.path.expanduser(name_or_path), "config.json")
  if hub.is_hub_id(name_or_path):
    from huggingface_hub import try_to_load_from_cache
    repo_id, _, revision = name_or_path.partition("@")
    cached = try_to_load_from_cache(repo_id, "config.json", revision=revision or None)
    path = cached if isinstance(cached, str) else ""
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    raw = json.load(f)
  return raw.get("text_config", raw)


def read_verifier(name_or_path: str) -> Verifier:
  """The verifier's architectures and depth from its config.json, where it is at hand."""
  raw = verifier_config_json(name_or_path)
  if raw is None:
    return Verifier(name_or_path)
  return Verifier(name_or_path, tuple(raw.get("architectures") or DEFAULT_ARCHITECTURES),
                  raw.get("num_hidden_layers"))


def layer_config_dict(config: HeadConfig) -> dict[str, Any]:
  """`transformer_layer_config`: the head's decoder layers as a Qwen3 config over the target's
  vocabulary (what speculators' `Qwen3Config` validates)."""
  return {
      "model_type": "qwen3", "hidden_act": "silu", "attention_bias": False,
      "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
      "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_attention_heads,
      "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
      "rms_norm_eps": config.rms_norm_eps,
      "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default"},
      "layer_types": ["full_attention"] * config.num_layers, "tie_word_embeddings": False,
      "vocab_size": config.vocab_size,
      # vLLM's DFlash layers attend causally inside the block when their config says so.
      "is_causal": config.causal,
  }


def to_speculators_dict(config: HeadConfig, verifier: Verifier, dtype: str,
                        kind: str | None = None) -> dict[str, Any]:
  """The `config.json` of `config` as speculators type `kind` (default: its own, `TYPES`),
  naming `verifier`. A causal head may also be written as the `dflash` type, its layers marked
  `is_causal` (what vLLM's DFlash drafter reads); a bidirectional one is never `jetspec`."""
  kind = kind or TYPES[config.causal]
  if kind not in MODEL_CLASSES:
    raise ConfigError(f"speculators type must be one of {', '.join(MODEL_CLASSES)} (got {kind!r})")
  if kind == "jetspec" and not config.causal:
    raise ConfigError("a bidirectional (DFlash) head is speculators' dflash type, not jetspec")
  raw = {
      "architectures": [MODEL_CLASSES[kind]],
      "speculators_model_type": kind,
      "speculators_version": SPECULATORS_VERSION,
      "speculators_config": {
          "algorithm": kind,
          "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.depth,
                                "accept_tolerance": 0.0, "verifier_accept_k": 1}],
          "default_proposal_method": "greedy",
          "verifier": {"name_or_path": verifier.name_or_path,
                       "architectures": list(verifier.architectures)},
      },
      "transformer_layer_config": layer_config_dict(config),
      "draft_vocab_size": config.output_vocab_size,
      "block_size": config.block_size,
      "target_hidden_size": None,
      "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
      "mask_token_id": config.mask_token_id,
      "num_target_layers": config.num_target_layers,
      "tie_word_embeddings": False,
      "dtype": dtype,
  }
  if kind == "dflash":
    raw.update(sliding_window_non_causal=False, sample_from_anchor=False)
  else:
    raw.update(kd_temperature=1.0)
  return raw


def from_speculators_dict(raw: dict[str, Any], source: str = "config.json") -> HeadConfig:
  """The head of a speculators `dflash` or `jetspec` config; one ConfigError lists every field
  jetflow_jax cannot draft with.

  `num_target_layers` comes from our own exports, else from the verifier's config when it is
  at hand, else 0 (unknown: checked against the target's depth only by the taps' range)."""
  kind = raw.get("speculators_model_type")
  if kind not in MODEL_CLASSES:
    raise ConfigError(f"{source}: speculators type {kind!r} is not a head jetflow_jax drafts "
                      f"with (it reads {', '.join(MODEL_CLASSES)})")
  layer_raw = raw.get("transformer_layer_config")
  if not isinstance(layer_raw, dict):
    raise ConfigError(f"{source}: transformer_layer_config is missing")
  layers = Qwen3Config.from_hf_dict({**layer_raw, "model_type": "qwen3"}, source)
  problems = []
  if any(t != "full_attention" for t in layer_raw.get("layer_types") or ()):
    problems.append(f"layer_types {layer_raw['layer_types']}: sliding-window head layers are not "
                    "supported")
  mask_token_id = raw.get("mask_token_id")
  if mask_token_id is None:
    problems.append("mask_token_id is missing" + (
        ": a jetspec head trained by speculators takes the block's actual tokens as inputs, "
        "and jetflow_jax drafts from [anchor, MASK...] blocks" if kind == "jetspec" else ""))
  if raw.get("sample_from_anchor"):
    problems.append("sample_from_anchor=true: jetflow_jax drafts the tokens after the anchor")
  if raw.get("target_hidden_size") not in (None, layers.hidden_size):
    problems.append(f"target_hidden_size {raw['target_hidden_size']} != the head's hidden size "
                    f"{layers.hidden_size} (the head uses the target's embedding)")
  aux = list(raw.get("aux_hidden_state_layer_ids") or ())
  if not aux:
    problems.append("aux_hidden_state_layer_ids is missing")
  elif min(aux) < 1:
    problems.append(f"aux_hidden_state_layer_ids {aux}: id 0 is the embedding output, which "
                    "jetflow_jax does not tap")
  block_size = int(raw.get("block_size") or 0)
  if block_size < 2:
    problems.append(f"block_size {raw.get('block_size')} must be >= 2")
  draft_vocab = int(raw.get("draft_vocab_size") or layers.vocab_size)
  if draft_vocab > layers.vocab_size:
    problems.append(f"draft_vocab_size {draft_vocab} exceeds the target's vocabulary "
                    f"{layers.vocab_size}")
  if problems:
    raise ConfigError(f"{source}: this {kind} head cannot draft here:\n  " + "\n  ".join(problems))
  num_target_layers = raw.get("num_target_layers")
  if num_target_layers is None:
    verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
    name = verifier.get("name_or_path")
    num_target_layers = (read_verifier(name).num_hidden_layers if name else None) or 0
  return HeadConfig(
      num_layers=layers.num_hidden_layers, hidden_size=layers.hidden_size,
      intermediate_size=layers.intermediate_size,
      num_attention_heads=layers.num_attention_heads,
      num_key_value_heads=layers.num_key_value_heads, head_dim=layers.head_dim,
      target_layer_ids=tuple(i - 1 for i in aux), num_target_layers=int(num_target_layers),
      vocab_size=layers.vocab_size, block_size=block_size, mask_token_id=int(mask_token_id),
      causal=kind == "jetspec" or bool(layer_raw.get("is_causal")),
      rms_norm_eps=layers.rms_norm_eps, rope_theta=layers.rope_theta,
      draft_vocab_size=0 if draft_vocab == layers.vocab_size else draft_vocab)
