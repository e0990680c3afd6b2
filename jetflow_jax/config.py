"""Qwen3 / Qwen3-MoE model config, read from a HF `config.json`."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jetflow_jax.errors import CheckpointError, ConfigError

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
  """Architecture hyper-parameters. Frozen and hashable, so it is a static jit argument.

  The fields are those of a HF Qwen3 / Qwen3-MoE `config.json` (`from_hf_dict`, `load_config`).

  Attributes:
    vocab_size: V, rows of the embedding and the LM head.
    hidden_size: D, the model width.
    intermediate_size: F, the dense MLP width (0 where every layer is MoE).
    num_hidden_layers: decoder layers.
    num_attention_heads: N, query heads.
    num_key_value_heads: K, key/value heads (GQA); N must be a multiple of K.
    head_dim: H, the width of one head (even, for RoPE).
    rms_norm_eps: the epsilon of every RMSNorm.
    rope_theta: the RoPE base.
    tie_word_embeddings: the LM head is the embedding.
    max_position_embeddings: the context window decoding checks prompts against.
    num_experts: E, experts per MoE layer; 0 for a dense model.
    num_experts_per_tok: experts each token is routed to.
    moe_intermediate_size: one expert's MLP width.
    norm_topk_prob: renormalise the chosen experts' router probabilities.
    decoder_sparse_step: every this-many-th layer is MoE (as transformers counts).
    mlp_only_layers: layers that stay dense in an MoE model.
    eos_token_ids: the default stop tokens (`config.json` and `generation_config.json` merged).

  Raises:
    ConfigError: heads that do not divide, an odd `head_dim`, or a top-k outside the experts.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1e6
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 40960
  # Mixture of experts; num_experts == 0 means a dense model.
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = False
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  eos_token_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if self.num_attention_heads % self.num_key_value_heads:
      raise ConfigError(
          f"num_attention_heads={self.num_attention_heads} is not a multiple of "
          f"num_key_value_heads={self.num_key_value_heads}")
    if self.head_dim % 2:
      raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
    if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
      raise ConfigError(
          f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts="
          f"{self.num_experts}]")

  @property
  def is_moe(self) -> bool:
    """Whether the model has experts."""
    return self.num_experts > 0

  def is_moe_layer(self, layer: int) -> bool:
    """Which layers route through experts (same rule as transformers' Qwen3-MoE)."""
    return (self.is_moe and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0)

  @classmethod
  def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "Qwen3Config":
    """Builds a config from the fields of a HF Qwen3 / Qwen3-MoE `config.json`.

    Args:
      raw: the parsed `config.json`.
      source: where it came from, for error messages.

    Returns:
      The config. Both spellings of the RoPE base are read (`rope_parameters.rope_theta`,
      transformers 5.x, and a top-level `rope_theta`).

    Raises:
      ConfigError: another model type, a required field missing, or a feature no Qwen3 release
        uses (attention bias, sliding window, RoPE scaling).
    """
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ConfigError(
          f"{source}: model_type {model_type!r} is not supported; expected one of "
          f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    for flag in ("attention_bias", "use_sliding_window"):
      if raw.get(flag):
        raise ConfigError(f"{source}: {flag}=true is not supported (no Qwen3 release uses it)")

    def need(key):
      if key not in raw:
        raise ConfigError(f"{source}: required field {key!r} is missing")
      return raw[key]

    # transformers >= 5 writes the RoPE base under rope_parameters; older files at the top level.
    rope_parameters = raw.get("rope_parameters") or {}
    rope_type = rope_parameters.get("rope_type", (raw.get("rope_scaling") or {}).get("rope_type"))
    if rope_type not in (None, "default"):
      raise ConfigError(f"{source}: rope_type {rope_type!r} is not supported (only 'default')")
    rope_theta = rope_parameters.get("rope_theta", raw.get("rope_theta", 1e6))
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    is_moe = model_type == "qwen3_moe"
    # transformers 5 writes `num_local_experts`; the released Qwen3-MoE files say `num_experts`.
    num_experts = raw.get("num_experts", raw.get("num_local_experts", 0)) if is_moe else 0
    heads = need("num_attention_heads")
    return cls(
        vocab_size=need("vocab_size"),
        hidden_size=need("hidden_size"),
        intermediate_size=raw.get("intermediate_size", 0),
        num_hidden_layers=need("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or need("hidden_size") // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=raw.get("max_position_embeddings", 40960),
        num_experts=num_experts,
        num_experts_per_tok=raw.get("num_experts_per_tok", 0) if is_moe else 0,
        moe_intermediate_size=raw.get("moe_intermediate_size", 0) if is_moe else 0,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)) if is_moe else False,
        decoder_sparse_step=raw.get("decoder_sparse_step", 1) or 1,
        mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
        eos_token_ids=eos_ids,
    )


def read_config_json(directory: str) -> dict[str, Any]:
  """The parsed `config.json` of a checkpoint directory, with errors that name the path."""
  if not os.path.isdir(directory):
    raise CheckpointError(f"checkpoint directory not found: {directory}")
  path = os.path.join(directory, "config.json")
  if not os.path.isfile(path):
    raise CheckpointError(f"{directory} has no config.json; is it a HF checkpoint directory?")
  try:
    with open(path) as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def load_config(directory: str) -> Qwen3Config:
  """The model config of a checkpoint directory; stop tokens merged from generation_config.json.

  Raises:
    CheckpointError: no such directory, no `config.json`, or one that is not JSON.
    ConfigError: a config this port does not support.
  """
  config = Qwen3Config.from_hf_dict(read_config_json(directory),
                                    source=os.path.join(directory, "config.json"))
  generation_path = os.path.join(directory, "generation_config.json")
  if os.path.isfile(generation_path):
    with open(generation_path) as f:
      eos = json.load(f).get("eos_token_id")
    extra = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    merged = tuple(dict.fromkeys(config.eos_token_ids + extra))
    config = dataclasses.replace(config, eos_token_ids=merged)
  return config
