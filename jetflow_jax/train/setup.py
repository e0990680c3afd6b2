"""From an ml_collections config to the objects training needs: target, head config, data store."""

from __future__ import annotations

import functools
import math
import os
import shlex

import jax
import ml_collections

from jetflow_jax import cli, distributed, embedded, hf_params
from jetflow_jax.checkpoint import is_converted, load_qwen3
from jetflow_jax.config import Qwen3Config
from jetflow_jax.config_files import head_config, target_config
from jetflow_jax.errors import ConfigError, InputError
from jetflow_jax.head import init_head_params, with_draft_vocab
from jetflow_jax.head_acceptance import ACCEPTANCE_FILE
from jetflow_jax.head_checkpoint import abstract_head_params, load_head
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.model import abstract_params, init_params
from jetflow_jax.train import measure_acceptance
from jetflow_jax.train.data import read_jsonl
from jetflow_jax.train.draft_vocab import most_frequent, response_token_counts
from jetflow_jax.train.regenerate import (BACKENDS, make_generator, regenerate,
                                          tokenizer_if_needed)
from jetflow_jax.train.store import (TokenStore, convert_jsonl, converted_from, is_store,
                                     num_shards)

STORE_SUBDIR = "store"  # the workdir's token store (regenerated or converted)
DECODE_PROMPT = "def fibonacci(n):"  # what the printed decode.py command asks


def say(line: str) -> None:
  """A progress line, from process 0 only (the others would repeat it)."""
  if distributed.is_main_process():
    print(line, flush=True)


def how_to_decode(config: ml_collections.ConfigDict, workdir: str) -> str:
  """Where the trained head is, and the decode.py command that drafts with it."""
  head = os.path.join(workdir, "hf_head")
  checkpoint = config.target.checkpoint
  if not checkpoint:
    return (f"head: {head}, for the random target of target.random (not saved, so decode.py "
            "cannot load it; configs/embedded.py:quick trains a head you can decode with)")
  target = ("" if os.path.abspath(os.path.expanduser(checkpoint)) == embedded.TARGET_DIR
            else f" --checkpoint {shlex.quote(checkpoint)}")
  prior = (f"measured on {config.eval.prompts}, in {os.path.join(workdir, ACCEPTANCE_FILE)}"
           if config.eval.prompts else
           f"python -m jetflow_jax.train.measure_acceptance{target} --head "
           f"{shlex.quote(workdir)} --prompts HELD_OUT.jsonl")
  return (f"head: {head}\ndecode with it: python decode.py{target} --head "
          f"{shlex.quote(workdir)} --prompt {shlex.quote(DECODE_PROMPT)}\n"
          f"its prior for --budget auto, on prompts it did not train on: {prior}")


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


def store_draft_vocab(head_params, head: HeadConfig, store: TokenStore, target: Qwen3Config,
                      target_params) -> dict:
  """The head's params over the `head.draft_vocab_size` tokens the store's responses use most,
  with the target's LM-head rows for them (`train/draft_vocab.py`)."""
  counts = response_token_counts(store, target.vocab_size)
  ids = most_frequent(counts, head.draft_vocab_size)
  covered = counts[ids].sum() / max(counts.sum(), 1)
  say(f"draft vocabulary: the {len(ids)} of {target.vocab_size} target tokens the store's "
      f"responses use most ({100 * covered:.2f}% of their {counts.sum()} tokens)")
  # Jitted: the target's LM head may be split over this job's processes.
  add = jax.jit(with_draft_vocab, static_argnums=2)
  return add(head_params, target_params, target, ids)


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
          f"{f'draft vocabulary {head.draft_vocab_size}, ' if head.draft_vocab_size else ''}"
          f"{count(abstract_head_params(head)) / 1e9:.3f}B params")


def check_data(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Refuses data settings that name nothing, or a place no store should be written, before
  anything is loaded or created.

  `data.prompts` regenerates into `data.store` (default WORKDIR/store): absent, empty or a
  store already (a regeneration resumes). `data.regenerated` names an existing store, or a
  regenerated JSONL converted into WORKDIR/store. `eval.prompts`, where set, is a file other
  than `data.prompts`.
  """
  d = config.data
  workdir = os.path.abspath(os.path.expanduser(workdir))
  if os.path.isfile(workdir):
    raise ConfigError(f"--workdir {workdir} is a file")
  workdir_store = os.path.join(workdir, STORE_SUBDIR)
  if d.prompts and d.regenerated:
    raise ConfigError("data.prompts and data.regenerated are both set: data.prompts regenerates "
                      "a new store (written to data.store, default WORKDIR/store), "
                      "data.regenerated trains on one that exists; set one of them")
  if d.store and not d.prompts:
    raise ConfigError(f"data.store={d.store} names where to regenerate data.prompts, which is "
                      "not set; to train on an existing store set data.regenerated to it")
  if d.prompts:
    prompts = os.path.expanduser(d.prompts)
    if not os.path.isfile(prompts):
      raise ConfigError(f"data.prompts not found: {prompts} (a JSONL of prompts)")
    if d.regenerate_backend not in BACKENDS:
      raise ConfigError(f"data.regenerate_backend must be one of {BACKENDS} "
                        f"(got {d.regenerate_backend!r})")
    if d.store:
      store = os.path.abspath(os.path.expanduser(d.store))
      if not os.path.isdir(os.path.dirname(store)):
        raise ConfigError(f"data.store={store}: its parent directory does not exist")
      _check_writable_store(store, "data.store")
    else:
      _check_writable_store(workdir_store, "the workdir's store")
  elif d.regenerated:
    path = os.path.abspath(os.path.expanduser(d.regenerated))
    if not os.path.exists(path):
      raise ConfigError(f"data.regenerated not found: {path} (it names an existing token store "
                        "or regenerated JSONL; to regenerate one, set data.prompts, and "
                        "data.store for where to write it)")
    if os.path.isdir(path) and not is_store(path):
      raise ConfigError(f"data.regenerated={path} is a directory but not a token store (it has "
                        "no store.json)")
    if os.path.isfile(path):
      _check_writable_store(workdir_store, "the workdir's store")  # the JSONL's conversion
  elif not is_store(workdir_store):
    raise ConfigError("set data.prompts (a JSONL of prompts to regenerate) or data.regenerated "
                      "(a token store, or a regenerated JSONL to convert into one)")
  _check_eval(config)


def _check_eval(config: ml_collections.ConfigDict) -> None:
  e = config.eval
  if not e.prompts:
    return
  prompts = os.path.abspath(os.path.expanduser(e.prompts))
  if not os.path.isfile(prompts):
    raise ConfigError(f"eval.prompts not found: {prompts} (a JSONL of held-out prompts)")
  if config.data.prompts and prompts == os.path.abspath(os.path.expanduser(config.data.prompts)):
    raise ConfigError("eval.prompts is data.prompts: the head's acceptance on the prompts it "
                      "trained on would overstate it; give prompts it does not train on")
  if e.count < 1 or e.max_new_tokens < 1:
    raise ConfigError(f"eval.count and eval.max_new_tokens must be positive (got {e.count}, "
                      f"{e.max_new_tokens})")
  if jax.process_count() > 1:
    raise ConfigError("eval.prompts is measured in one process; for a multi-process run leave it "
                      "empty and run python -m jetflow_jax.train.measure_acceptance after")


def eval_prompts(config: ml_collections.ConfigDict) -> list[list[int]] | None:
  """The token ids of `eval.prompts` (None where it is not set), checked and read before
  anything loads."""
  _check_eval(config)
  if not config.eval.prompts:
    return None
  return measure_acceptance.held_out_prompts(os.path.expanduser(config.eval.prompts),
                                             config.eval.count,
                                             config.data.tokenizer or config.target.checkpoint)


def _check_writable_store(path: str, what: str) -> None:
  """A store may be written at `path`: nothing there, an empty directory, or a store."""
  if os.path.isfile(path):
    raise ConfigError(f"{what} {path} is a file, not a token store directory")
  if os.path.isdir(path) and os.listdir(path) and not is_store(path):
    raise ConfigError(f"{what} {path} is a directory that is neither empty nor a token store; "
                      "refusing to write a store into it")


def training_store(config: ml_collections.ConfigDict, workdir: str) -> TokenStore:
  """The token store to train on: regenerated from `data.prompts` into `data.store` (each
  process its own shard, resumably), `data.regenerated` itself, or that JSONL converted once
  into the workdir. `check_data` first: nothing is written for a setting it refuses."""
  check_data(config, workdir)
  d = config.data
  workdir_store = os.path.join(os.path.abspath(os.path.expanduser(workdir)), STORE_SUBDIR)
  if d.prompts:
    store_dir = os.path.abspath(os.path.expanduser(d.store)) if d.store else workdir_store
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
    return TokenStore(workdir_store)
  path = os.path.abspath(os.path.expanduser(d.regenerated))
  if os.path.isdir(path):
    return TokenStore(path)
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
  records = list(read_jsonl(d.prompts))
  tokenizer = tokenizer_if_needed(records, d.tokenizer or config.target.checkpoint)

  def generator():  # only when something is left to regenerate
    say(f"regenerate: loading the target, then compiling its decode loop "
        f"({d.regenerate_backend} backend)")
    return make_generator(
        d.regenerate_backend, lambda shardings: load_target(config, shardings),
        checkpoint=config.target.checkpoint, width=d.regenerate_batch_size,
        temperature=d.regenerate_temperature, mesh_axes=d.regenerate_mesh, tokenizer=tokenizer)

  say(f"regenerate: the target's answers to the {len(records)} prompts of {d.prompts}, into "
      f"{store_dir} (resumable)")
  regenerate(records, store_dir, generator, tokenizer=tokenizer, max_new_tokens=d.max_new_tokens,
             max_prompt_len=d.seq_len - 2, seed=d.regenerate_seed, shard=jax.process_index(),
             num_shards=jax.process_count())
