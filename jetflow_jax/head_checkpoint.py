"""Head checkpoints: the reference's HF layout and vLLM speculators' format (import and export),
and our training workdirs.

A training workdir holds `head_config.json` (the reference layout) and orbax checkpoints
under `checkpoints/<step>/`; decoding reads the head params of the latest one, training
writes them (`train/checkpointing.py`). Both HF-style formats keep the same weight names
(`head_tensors`); `load_head` tells the three apart by what the directory holds.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jetflow_jax import embedded, hf_params, hub, partitioning, speculators_format
from jetflow_jax.config import Qwen3Config, read_config_json
from jetflow_jax.errors import CheckpointError, ConfigError
from jetflow_jax.head import DRAFT_VOCAB, init_head_params
from jetflow_jax.head_acceptance import load_acceptance
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.hf_params import Tensor
from jetflow_jax.speculators_format import Verifier

HEAD_CONFIG_FILE = "head_config.json"  # a training workdir's head, in the reference layout
CHECKPOINT_SUBDIR = "checkpoints"  # a training workdir's orbax checkpoints, one per step
WEIGHTS_FILE = "model.safetensors"
# Tensors a checkpoint may hold that are the target's (speculators' loader takes them from the
# verifier): ignored.
VERIFIER_OWNED = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")


def head_tensors(config: HeadConfig) -> Iterator[Tensor]:
  """Every float tensor of a head checkpoint (the reference's names; speculators' too)."""
  yield Tensor("fc.weight", ("fc", "kernel"), in_dims=1)
  yield Tensor("hidden_norm.weight", ("hidden_norm", "scale"))
  layers = config.layer_config()
  for i in range(config.num_layers):
    yield from hf_params.decoder_layer_tensors(layers, i, f"layers.{i}.", (f"layers_{i}",))
  yield Tensor("norm.weight", ("norm", "scale"))
  if config.draft_vocab_size:
    yield Tensor("lm_head.weight", ("lm_head", "kernel"), in_dims=1)


def abstract_head_params(config: HeadConfig, dtype=jnp.float32):
  return jax.eval_shape(lambda: init_head_params(config, jax.random.key(0), dtype))


def vocab_buffers(head_params, config: HeadConfig) -> dict[str, np.ndarray]:
  """A draft vocabulary as speculators stores it: `d2t` (int64 `[K]`: draft id + d2t = target
  id) and `t2d` (bool `[V]`: which target tokens the draft vocabulary holds)."""
  ids = np.asarray(head_params[DRAFT_VOCAB]["target_ids"], np.int64)
  t2d = np.zeros(config.vocab_size, bool)
  t2d[ids] = True
  return {"d2t": ids - np.arange(len(ids)), "t2d": t2d}


def read_vocab_buffers(files: hf_params.SafetensorsDir, config: HeadConfig) -> jax.Array:
  """The target id of each draft token, `[K]` int32, checked against `t2d` when present."""
  k, where = config.draft_vocab_size, files.directory
  if "d2t" not in files:
    raise CheckpointError(f"{where} has draft_vocab_size {k} but no d2t tensor")
  d2t = files.get_slice("d2t", (slice(None),))
  ids = np.arange(len(d2t)) + d2t.astype(np.int64)
  problems = []
  if d2t.shape != (k,):
    problems.append(f"d2t has shape {list(d2t.shape)}, not [{k}]")
  elif ids.min() < 0 or ids.max() >= config.vocab_size or len(set(ids.tolist())) != k:
    problems.append(f"d2t maps draft ids to target ids that are not {k} distinct ids in "
                    f"[0, {config.vocab_size})")
  elif "t2d" in files:
    t2d = files.get_slice("t2d", (slice(None),)).astype(bool)
    if t2d.shape != (config.vocab_size,) or t2d.sum() != k or not t2d[ids].all():
      problems.append("t2d does not mark exactly the target ids d2t maps to")
  if problems:
    raise CheckpointError(f"{where}: " + "; ".join(problems))
  return jnp.asarray(ids, jnp.int32)


def cast(tree, dtype):
  """Float leaves in `dtype`; integer ones (a draft vocabulary's ids) as they are."""
  return jax.tree.map(
      lambda x: jnp.asarray(x, dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def write_weights(head_params, config: HeadConfig, directory: str, dtype) -> None:
  """`model.safetensors` of a head, its floats in `dtype`."""
  extra = vocab_buffers(head_params, config) if config.draft_vocab_size else None
  hf_params.save_tensors(cast(head_params, dtype), head_tensors(config),
                         os.path.join(directory, WEIGHTS_FILE), extra=extra)


def read_weights(directory: str, config: HeadConfig, dtype, allowed_extra=()) -> dict:
  """A head's params from `directory`; tensors neither the head nor `allowed_extra` names are
  an error (a checkpoint of another layout)."""
  tensors = list(head_tensors(config))
  files = hf_params.SafetensorsDir(directory)
  known = {t.hf_key for t in tensors} | set(allowed_extra)
  if config.draft_vocab_size:
    known |= {"d2t", "t2d"}
  unexpected = sorted(set(files.weight_map) - known)
  if unexpected:
    raise CheckpointError(f"{directory} holds tensors a draft head of its config.json does not "
                          f"have: {', '.join(unexpected[:hf_params.MAX_LISTED])}")
  params = hf_params.load_tensors(directory, tensors, abstract_head_params(config, dtype), dtype)
  if config.draft_vocab_size:
    params[DRAFT_VOCAB] = {"target_ids": read_vocab_buffers(files, config)}
  return params


def save_hf_head(head_params, config: HeadConfig, out_dir: str, dtype=jnp.bfloat16) -> None:
  """Writes `config.json` + `model.safetensors` in the reference layout.

  The reference's decode code (`DFlashDraftModel`) and `load_head` read the result.

  Args:
    head_params: the head's params.
    config: its config.
    out_dir: the directory to write (created if missing).
    dtype: the dtype of the saved tensors.

  A draft vocabulary, which the reference does not have, is written as `draft_vocab_size`,
  `lm_head.weight`, `d2t` and `t2d`.

  Raises:
    ConfigError: the head does not know its target's layer count (name the target:
      `export_head --verifier`).
  """
  if not config.num_target_layers:
    raise ConfigError("the reference layout records the target's layer count, which this head "
                      "does not know: name the target (export_head --verifier)")
  os.makedirs(out_dir, exist_ok=True)
  write_weights(head_params, config, out_dir, dtype)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump({**config.to_hf_dict(), "torch_dtype": jnp.dtype(dtype).name}, f, indent=2)
  if config.acceptance is not None:
    config.acceptance.save(out_dir)


def save_speculators_head(head_params, config: HeadConfig, out_dir: str, verifier: Verifier,
                          dtype=jnp.bfloat16, kind: str | None = None) -> None:
  """Writes `config.json` + `model.safetensors` in vLLM speculators' format.

  `load_head` and speculators' own `from_pretrained` read the result.

  Args:
    head_params: the head's params.
    config: its config.
    out_dir: the directory to write (created if missing).
    verifier: the target it drafts for (`speculators_format.read_verifier`), named in
      `speculators_config`.
    dtype: the dtype of the saved tensors.
    kind: `dflash` or `jetspec`; by default `dflash` for a bidirectional head, `jetspec` for a
      causal one.

  Raises:
    ConfigError: an unknown `kind`, or one the head cannot be (a bidirectional head as
      `jetspec`).
  """
  raw = speculators_format.to_speculators_dict(config, verifier, jnp.dtype(dtype).name, kind)
  os.makedirs(out_dir, exist_ok=True)
  write_weights(head_params, config, out_dir, dtype)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(raw, f, indent=2)
  if config.acceptance is not None:
    config.acceptance.save(out_dir)


def workdir_head_config(workdir: str) -> HeadConfig | None:
  """The head a training workdir was made for, or None for a new workdir."""
  path = os.path.join(workdir, HEAD_CONFIG_FILE)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return HeadConfig.from_hf_dict(json.load(f), path)


def restore_head_params(workdir: str, abstract_params):
  """Head params of the latest checkpoint in a training workdir, on this process's first device
  (whatever mesh and process count wrote them)."""
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  directory = os.path.join(os.path.abspath(workdir), CHECKPOINT_SUBDIR)
  with ocp.CheckpointManager(directory) as manager:
    step = manager.latest_step()
    if step is None:
      raise CheckpointError(f"{workdir} has no training checkpoint yet")
    restored = manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(partitioning.abstract(abstract_params, device))))
  return restored["params"]


def head_format(path: str) -> str:
  """`workdir`, `speculators` or `reference`: what kind of head the directory `path` holds."""
  if workdir_head_config(path) is not None:
    return "workdir"
  raw = read_config_json(path)
  return "speculators" if speculators_format.is_speculators_config(raw) else "reference"


def load_head(path: str, dtype=jnp.float32) -> tuple[HeadConfig, dict]:
  """Loads a draft head as (HeadConfig, params).

  Args:
    path: a reference-layout HF directory (JetSpec / DFlash heads, or ours exported with
      `save_hf_head`), a speculators `dflash` / `jetspec` directory (Red Hat's, or ours from
      `save_speculators_head`), a training workdir of `train.py` (its latest checkpoint), or a
      Hugging Face repo id (`JetSpec/jetspec-qwen3-8b[@rev]`).
    dtype: every param is cast to it.

  Returns:
    `(head_config, head_params)`.

  Raises:
    CheckpointError: a missing directory, file or tensor, a shape that disagrees with the
      config, or a workdir with no checkpoint yet.
    ConfigError: a `config.json` that is not a draft head's.
  """
  path = os.path.abspath(os.path.expanduser(hub.resolve(path)))
  if (config := workdir_head_config(path)) is not None:
    params = cast(restore_head_params(path, abstract_head_params(config, jnp.float32)), dtype)
  else:
    raw = read_config_json(path)
    source = os.path.join(path, "config.json")
    if speculators_format.is_speculators_config(raw):
      config = speculators_format.from_speculators_dict(raw, source)
    else:
      config = HeadConfig.from_hf_dict(raw, source)
    # A full-vocabulary lm_head is the target's own: speculators' loader ignores it too.
    extra = VERIFIER_OWNED + (() if config.draft_vocab_size else ("lm_head.weight",))
    params = read_weights(path, config, dtype, extra)
  return dataclasses.replace(config, acceptance=load_acceptance(path)), params


FORMATS = ("speculators", "reference")


def default_verifier(head_path: str, raw: dict | None) -> str | None:
  """The verifier a head names itself (speculators format), or the embedded target for an
  embedded head; None when only the user knows it."""
  if raw is not None and speculators_format.is_speculators_config(raw):
    verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
    return verifier.get("name_or_path")
  embedded_heads = {os.path.realpath(p) for p in embedded.HEAD_DIRS.values()}
  return embedded.TARGET_DIR if os.path.realpath(head_path) in embedded_heads else None


def export_head(head: str, fmt: str, out_dir: str, verifier: str | None = None,
                dtype=jnp.bfloat16, kind: str | None = None) -> tuple[HeadConfig, Verifier | None]:
  """Writes a head in another format: what `python -m jetflow_jax.export_head` runs.

  The verifier defaults to the one the head names (speculators format) or the embedded target
  (embedded heads); the speculators format needs one. When its config.json is at hand (a
  local directory, or the Hugging Face cache) the head is checked against it.

  Args:
    head: anything `load_head` reads.
    fmt: `speculators` or `reference`.
    out_dir: the directory to write: new, or holding an earlier export only.
    verifier: a hub id or a local directory of the target.
    dtype: the dtype of the saved tensors.
    kind: the speculators type (`dflash`, `jetspec`); by default from the head's mask.

  Returns:
    `(head_config, verifier)`: the head's config and the verifier named (None if none was).

  Raises:
    ConfigError: an unknown format, `out_dir` holding something else or being the head's own
      directory, a speculators export without a verifier, or a verifier the head does not fit.
    CheckpointError: the head cannot be read.
  """
  if fmt not in FORMATS:
    raise ConfigError(f"--format must be one of {', '.join(FORMATS)} (got {fmt!r})")
  if kind is not None and fmt != "speculators":
    raise ConfigError("--speculators-type applies to --format speculators only")
  source = os.path.abspath(os.path.expanduser(hub.resolve(head)))
  out = os.path.abspath(os.path.expanduser(out_dir))
  if out == source:
    raise ConfigError(f"--out {out_dir} is the head's own directory")
  if os.path.isfile(out) or (os.path.isdir(out)
                             and set(os.listdir(out)) - {"config.json", WEIGHTS_FILE}):
    raise ConfigError(f"--out {out_dir} exists and holds something other than an exported head")
  raw = None if head_format(source) == "workdir" else read_config_json(source)
  config, params = load_head(source, jnp.float32)
  name = verifier or default_verifier(source, raw)
  target = None
  if name is not None:
    target = speculators_format.read_verifier(name)
    if target.was_read:
      if not config.num_target_layers:
        config = dataclasses.replace(config, num_target_layers=target.num_hidden_layers)
      check_verifier(config, name)
  if fmt == "reference":
    save_hf_head(params, config, out, dtype)
    return config, target
  if target is None:
    raise ConfigError("the speculators format names the verifier the head drafts for: pass "
                      "--verifier (a hub id such as Qwen/Qwen3-8B, or a local directory)")
  save_speculators_head(params, config, out, target, dtype, kind)
  return config, target


def check_verifier(config: HeadConfig, name: str) -> None:
  """Refuses a verifier (whose config.json is at hand) the head does not fit."""
  raw = speculators_format.verifier_config_json(name)
  if raw is not None:
    config.validate_for(Qwen3Config.from_hf_dict(raw, f"--verifier {name}"))
