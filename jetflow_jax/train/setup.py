"""From an ml_collections config to the objects training needs: target, head config, data."""

from __future__ import annotations

import math
import os

import jax
import ml_collections

from jetflow_jax import cli, hf_params
from jetflow_jax.checkpoint import is_converted, load_qwen3
from jetflow_jax.config import Qwen3Config, load_config
from jetflow_jax.errors import ConfigError
from jetflow_jax.head import init_head_params
from jetflow_jax.head_checkpoint import abstract_head_params, load_head
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.model import abstract_params, init_params
from jetflow_jax.sampling import make_sampler
from jetflow_jax.train.data import load_regenerated, read_jsonl
from jetflow_jax.train.regenerate import (BACKENDS, jax_generator, regenerate, tokenizer_if_needed,
                                          torch_generator)


def target_config(config: ml_collections.ConfigDict) -> Qwen3Config:
  """The target's architecture, from its config.json (no weights read) or the random spec."""
  if config.target.checkpoint:
    return load_config(os.path.expanduser(config.target.checkpoint))
  if config.target.random_init:
    return Qwen3Config(**config.target.random.to_dict())
  raise ConfigError("set target.checkpoint to a Qwen3 checkpoint directory "
                    "(or target.random_init=True for a random test target)")


def load_target(config: ml_collections.ConfigDict) -> tuple[Qwen3Config, dict]:
  dtype = cli.parse_dtype(config.target.dtype)
  if config.target.checkpoint:
    return load_qwen3(config.target.checkpoint, dtype)
  model_config = target_config(config)
  params = init_params(model_config, jax.random.key(config.target.random_seed), dtype)
  # A freshly initialised LM predicts a near-uniform next token over its whole vocabulary;
  # trained LMs are peaked. Sharpening the LM head makes the random target behave like one,
  # so a head trained on it has something to learn.
  head = "embed_tokens" if model_config.tie_word_embeddings else "lm_head"
  leaf = "embedding" if model_config.tie_word_embeddings else "kernel"
  params[head][leaf] = params[head][leaf] * config.target.random_sharpness
  return model_config, params


def head_config(config: ml_collections.ConfigDict, target: Qwen3Config) -> HeadConfig:
  """The head described by `config.head`, checked against `target`."""
  h = config.head
  overrides = {name: h[name] for name in ("hidden_size", "intermediate_size") if h[name] > 0}
  head = HeadConfig.for_target(target, num_layers=h.num_layers,
                               target_layer_ids=tuple(h.target_layer_ids) or None,
                               block_size=h.block_size, mask_token_id=h.mask_token_id,
                               causal=h.causal, **overrides)
  head.validate_for(target)
  return head


def initial_head_params(config: ml_collections.ConfigDict, head: HeadConfig) -> dict:
  """Random params, or those of `train.init_head` (an exported head or a workdir) to fine-tune."""
  if not config.train.init_head:
    return init_head_params(head, jax.random.key(config.train.seed))
  init_config, params = load_head(config.train.init_head)
  if init_config != head:
    raise ConfigError(f"train.init_head={config.train.init_head} is a different head "
                      f"({init_config}) from the one this config trains ({head})")
  return params


def validate(config: ml_collections.ConfigDict) -> str:
  """Checks config, target config.json and (if present) weight shapes without loading weights."""
  target = target_config(config)
  head = head_config(config, target)
  checkpoint = os.path.expanduser(config.target.checkpoint)
  weights = "random target"
  if checkpoint and not is_converted(checkpoint):
    if any(n.endswith(".safetensors") for n in os.listdir(checkpoint)):
      files = hf_params.SafetensorsDir(checkpoint)
      hf_params.check_shapes(files, hf_params.qwen3_tensors(target), abstract_params(target),
                             checkpoint)
      weights = "safetensors shapes match config.json"
    else:
      weights = "config.json only (no weights to check)"
  count = lambda tree: sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
  return (f"target: {target.num_hidden_layers} layers, hidden {target.hidden_size}, vocab "
          f"{target.vocab_size}{', MoE' if target.is_moe else ''} "
          f"({count(abstract_params(target)) / 1e9:.2f}B params; {weights})\n"
          f"head: {head.num_layers} layers, taps {list(head.target_layer_ids)}, block "
          f"{head.block_size}, mask id {head.mask_token_id}, "
          f"{'causal (JetFlow)' if head.causal else 'bidirectional (DFlash)'}, "
          f"{count(abstract_head_params(head)) / 1e9:.3f}B params")


def training_records(config: ml_collections.ConfigDict, workdir: str, target: Qwen3Config,
                     target_params) -> list[dict]:
  """Regenerated training records; runs (or resumes) regeneration when prompts are given."""
  d = config.data
  regenerated = d.regenerated or os.path.join(workdir, "regenerated.jsonl")
  if d.prompts:
    records = list(read_jsonl(d.prompts))
    tokenizer = tokenizer_if_needed(records, d.tokenizer or config.target.checkpoint)
    if d.regenerate_backend not in BACKENDS:
      raise ConfigError(f"data.regenerate_backend must be one of {BACKENDS} "
                        f"(got {d.regenerate_backend!r})")
    if d.regenerate_backend == "torch":
      generate_batch = torch_generator(config.target.checkpoint, d.max_new_tokens,
                                       d.regenerate_temperature)
    else:
      generate_batch = jax_generator(target_params, target, d.max_new_tokens,
                                     make_sampler(d.regenerate_temperature))
    regenerate(records, regenerated, generate_batch, tokenizer=tokenizer,
               batch_size=d.regenerate_batch_size, max_prompt_len=d.seq_len - 2,
               seed=d.regenerate_seed)
  elif not os.path.isfile(regenerated):
    raise ConfigError("set data.prompts (a JSONL of prompts to regenerate) or data.regenerated "
                      "(an existing regenerated JSONL)")
  return load_regenerated(regenerated, d.seq_len)
