"""A run's config file (`configs/NAME.py`, ml_collections) read as the models it describes: the
target's architecture and the draft head's config, without reading any weights.

Training builds on these (`train/setup.py`); `decode.py --memory_report` sizes decoding from
the same files.
"""

from __future__ import annotations

import importlib.util
import os

import ml_collections

from jetflow_jax.config import Qwen3Config, load_config
from jetflow_jax.errors import ConfigError, InputError
from jetflow_jax.head_config import HeadConfig


def load_config_file(spec: str) -> ml_collections.ConfigDict:
  """`path.py[:arg]` -> its `get_config(arg)` (`get_config()` without a colon, as
  ml_collections calls it); a file that fails to load is a ConfigError naming its error."""
  path, colon, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise InputError(f"--config file not found: {path}")
  try:
    module_spec = importlib.util.spec_from_file_location("jetflow_config_file", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(*([arg] if colon else []))
  except Exception as e:  # whatever the file raises: it is the user's code
    raise ConfigError(f"--config {spec} failed to load: {type(e).__name__}: {e}") from None


def target_config(config: ml_collections.ConfigDict) -> Qwen3Config:
  """The target's architecture, from its config.json (no weights read) or the random spec."""
  if config.target.checkpoint:
    return load_config(os.path.expanduser(config.target.checkpoint))
  if config.target.random_init:
    return Qwen3Config(**config.target.random.to_dict())
  raise ConfigError("set target.checkpoint to a Qwen3 checkpoint directory "
                    "(or target.random_init=True for a random test target)")


def target_shape(config: ml_collections.ConfigDict) -> tuple[Qwen3Config, str]:
  """The target's architecture and where it came from, the published `target.shape` included
  (a memory report needs no checkpoint at hand)."""
  if config.target.checkpoint or config.target.random_init:
    source = "config.json" if config.target.checkpoint else "target.random"
    return target_config(config), source
  shape = config.target.get("shape")
  if shape:
    return Qwen3Config(**shape.to_dict()), "target.shape"
  raise ConfigError("the memory report needs the target's shape: set target.checkpoint (only "
                    "its config.json is read), target.shape, or target.random_init=True")


def head_config(config: ml_collections.ConfigDict, target: Qwen3Config) -> HeadConfig:
  """The head described by `config.head`, checked against `target`."""
  h = config.head
  overrides = {name: h[name] for name in ("hidden_size", "intermediate_size") if h[name] > 0}
  head = HeadConfig.for_target(target, num_layers=h.num_layers,
                               target_layer_ids=tuple(h.target_layer_ids) or None,
                               block_size=h.block_size, mask_token_id=h.mask_token_id,
                               causal=h.causal, draft_vocab_size=h.get("draft_vocab_size", 0),
                               **overrides)
  head.validate_for(target)
  return head
