"""From an ml_collections config to the objects training needs: target, head config, data store."""

from __future__ import annotations

import functools
import math
import os

import jax
import ml_collections

from jetflow_jax import cli, distributed, hf_params
from jetflow_jax.checkpoint import is_converted, load_qwen3
from jetflow_jax.config import Qwen3Config
from jetflow_jax.config_files import head_config, target_config
from jetflow_jax.errors import ConfigError, InputError
from jetflow_jax.head import init_head_params
from jetflow_jax.head_checkpoint import abstract_head_params, load_head
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.model import abstract_params, init_params
from jetflow_jax.train.data import read_jsonl
from jetflow_jax.train.regenerate import (BACKENDS, make_generator, regenerate,
                                          tokenizer_if_needed)
from jetflow_jax.train.store import (TokenStore, convert_jsonl, converted_from, is_store,
                                     num_shards)

STORE_SUBDIR = "store"  # the workdir's token store (regenerated or converted)


def load_target(config: ml_collections.ConfigDict, shardings=None) -> tuple[Qwen3Config, dict]:
  """The frozen target; `shardings` ((config, abstract params) -> shardings) places it as it
  loads, each process reading only the slices of its own devices."""
  dtype = cli.parse_dtype(config.target.dtype)
  if config.target.checkpoint:
    return load_qwen3(config.target.checkpoint, dtype, shardings)
  model_config = target_config(config)
  init = functools.partial(init_params.__wrapped__, model_config, dtype=dtype)
  out_shardings = (None if shardings is None
                   else shardings(model_config, abstract_params(model_config, dtype)))
  params = jax.jit(init, out_shardings=out_shardings)(jax.random.key(config.target.random_seed))
  # A freshly initialised LM predicts a near-uniform next token over its whole vocabulary;
  # trained LMs are peaked. Sharpening the LM head makes the random target behave like one,
  # so a head trained on it has something to learn.
  head = "embed_tokens" if model_config.tie_word_embeddings else "lm_head"
  leaf = "embedding" if model_config.tie_word_embeddings else "kernel"
  params[head][leaf] = params[head][leaf] * config.target.random_sharpness
  return model_config, params


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


def training_store(config: ml_collections.ConfigDict, workdir: str) -> TokenStore:
  """The token store to train on: regenerated here from `data.prompts` (each process its own
  shard, resumably), `data.regenerated` itself, or that JSONL converted once into the workdir."""
  d = config.data
  workdir_store = os.path.join(workdir, STORE_SUBDIR)
  if d.prompts:
    store_dir = os.path.expanduser(d.regenerated) if d.regenerated else workdir_store
    if os.path.isfile(store_dir) or store_dir.endswith(".jsonl"):
      raise ConfigError(f"with data.prompts, data.regenerated names the token store to regenerate "
                        f"into (a directory), not {store_dir}; leave it empty for "
                        f"{workdir_store}")
    written_by = num_shards(store_dir)
    if written_by not in (None, jax.process_count()):
      # Regenerated by another process count, whose shards this one cannot resume: read as
      # it is, every shard complete (a run resumed on fewer or more hosts).
      try:
        return TokenStore(store_dir)
      except InputError as e:
        raise InputError(f"{e}. {written_by} processes regenerated it and this job has "
                         f"{jax.process_count()}: finish it with {written_by}") from None
    regenerate_prompts(config, store_dir)
    distributed.barrier("regenerated")
    return TokenStore(store_dir)
  if not d.regenerated:
    if is_store(workdir_store):
      return TokenStore(workdir_store)
    raise ConfigError("set data.prompts (a JSONL of prompts to regenerate) or data.regenerated "
                      "(a token store, or a regenerated JSONL to convert into one)")
  path = os.path.abspath(os.path.expanduser(d.regenerated))
  if os.path.isdir(path):
    return TokenStore(path)
  if not os.path.isfile(path):
    raise InputError(f"data.regenerated not found: {path}")
  return converted_store(path, workdir_store)


def converted_store(jsonl_path: str, store_dir: str) -> TokenStore:
  """The store converted from `jsonl_path` at `store_dir`, converting it (process 0) if needed.

  Every process passes the same barrier and then makes the same checks, so a bad store
  stops them all alike.
  """
  if distributed.is_main_process() and not is_store(store_dir):
    convert_jsonl(jsonl_path, store_dir)
  distributed.barrier("converted")
  stat = os.stat(jsonl_path)
  source = converted_from(store_dir)
  if source != {"path": jsonl_path, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}:
    held = f"a conversion of {source['path']}" if source else "regenerated records"
    raise ConfigError(f"{store_dir} already holds {held}, not {jsonl_path} as it is now; "
                      "use a new --workdir (or delete that store to convert again)")
  return TokenStore(store_dir)


def regenerate_prompts(config: ml_collections.ConfigDict, store_dir: str) -> None:
  """This process's share of `data.prompts`, regenerated into its shard of `store_dir`."""
  d = config.data
  if d.regenerate_backend not in BACKENDS:
    raise ConfigError(f"data.regenerate_backend must be one of {BACKENDS} "
                      f"(got {d.regenerate_backend!r})")
  records = list(read_jsonl(d.prompts))
  tokenizer = tokenizer_if_needed(records, d.tokenizer or config.target.checkpoint)

  generator = lambda: make_generator(  # only when something is left to regenerate
      d.regenerate_backend, lambda shardings: load_target(config, shardings),
      checkpoint=config.target.checkpoint, width=d.regenerate_batch_size,
      temperature=d.regenerate_temperature, mesh_axes=d.regenerate_mesh, tokenizer=tokenizer)
  regenerate(records, store_dir, generator, tokenizer=tokenizer, max_new_tokens=d.max_new_tokens,
             max_prompt_len=d.seq_len - 2, seed=d.regenerate_seed, shard=jax.process_index(),
             num_shards=jax.process_count())
