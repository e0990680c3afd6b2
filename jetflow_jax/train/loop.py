"""`train_and_evaluate(config, workdir)`: the head's training loop.

Resumable at any moment: the step's randomness derives from the step number, the
grain iterator position is checkpointed with the params, and a run restarted with
the same command continues from the latest checkpoint to the same parameters.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import get_args

import jax
import jax.numpy as jnp
import ml_collections
import tqdm

from jetflow_jax import cli
from jetflow_jax.errors import ConfigError, JetflowError
from jetflow_jax.head import RematPolicy
from jetflow_jax.head_checkpoint import save_hf_head, workdir_head_config
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.kernels.train_attention import TrainAttentionImpl
from jetflow_jax.model import ExpertsImpl
from jetflow_jax.train import checkpointing, setup
from jetflow_jax.train.data import ROW_ARRAYS, make_dataset
from jetflow_jax.train.losses import LOSSES
from jetflow_jax.train.metrics import MetricsWriter
from jetflow_jax.train.sharding import (batch_sharding, check_batch, make_mesh, param_sharding)
from jetflow_jax.train.step import (LossConfig, TrainState, make_loss_fn, make_optimizer,
                                    make_train_step)


class TrainingError(JetflowError):
  """Training cannot go on (a non-finite loss); the last checkpoint is left intact."""


def _check_head_config(workdir: str, head: HeadConfig) -> None:
  """Writes the head config into a new workdir; refuses a workdir made for another head."""
  existing = workdir_head_config(workdir)
  if existing is None:
    with open(os.path.join(workdir, checkpointing.HEAD_CONFIG_FILE), "w") as f:
      json.dump(head.to_hf_dict(), f, indent=2)
  elif existing != head:
    raise ConfigError(f"{workdir} holds a run of a different head ({existing}); "
                      f"this config asks for {head}. Use a new --workdir.")


def loss_config(config: ml_collections.ConfigDict) -> LossConfig:
  t = config.train
  if t.loss not in LOSSES:
    raise ConfigError(f"train.loss={t.loss!r} is not one of {', '.join(LOSSES)}")
  if t.loss_chunk_anchors < 0:
    raise ConfigError(f"train.loss_chunk_anchors={t.loss_chunk_anchors} must be >= 0")
  for key, allowed in (("head_attention", get_args(TrainAttentionImpl)),
                       ("remat", get_args(RematPolicy)),
                       ("target_experts", get_args(ExpertsImpl))):
    if t[key] not in allowed:
      raise ConfigError(f"train.{key}={t[key]!r} is not one of {', '.join(allowed)}")
  return LossConfig(kind=t.loss, temperature=t.temperature, depth_gamma=t.depth_gamma,
                    num_anchors=t.num_anchors, chunk_anchors=t.loss_chunk_anchors,
                    head_dtype=cli.parse_dtype(config.head.dtype),
                    head_attention=t.head_attention, remat=t.remat,
                    target_experts=t.target_experts)


def build_train_step(config: ml_collections.ConfigDict, head: HeadConfig, target,
                     total_steps: int):
  """(optimizer, schedule, jitted train step with the state donated) as `config` describes."""
  t = config.train
  optimizer, schedule = make_optimizer(t.lr, t.b1, t.b2, t.weight_decay, t.grad_clip,
                                       total_steps, t.warmup_frac, t.final_lr_frac)
  loss_fn = make_loss_fn(head, target, loss_config(config))
  train_step = jax.jit(make_train_step(loss_fn, optimizer, schedule, t.seed),
                       donate_argnames=("state",))
  return optimizer, schedule, train_step


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains the draft head described by `config`; returns the last logged metrics."""
  workdir = os.path.abspath(os.path.expanduser(workdir))
  os.makedirs(workdir, exist_ok=True)
  t = config.train
  loss_config(config)  # a bad loss setting fails here, before any weights load
  # Everything checkable from config files is checked before the target's weights load.
  head = setup.head_config(config, setup.target_config(config))
  head_params = setup.initial_head_params(config, head)
  _check_head_config(workdir, head)
  mesh = make_mesh(config.mesh.data, config.mesh.fsdp)
  check_batch(mesh, t.batch_size)
  target, target_params = setup.load_target(config)
  records = setup.training_records(config, workdir, target, target_params)
  iterator, num_batches = make_dataset(records, config.data.seq_len, t.batch_size,
                                       config.data.shuffle_seed, t.epochs, config.data.pack)
  total_steps = min(num_batches, t.num_steps) if t.num_steps > 0 else num_batches
  manager = checkpointing.checkpoint_manager(workdir, t.checkpoint_every, t.keep_checkpoints)
  latest_step = manager.latest_step() or 0
  if latest_step > total_steps:
    # A later stage already ran here (a staged script re-run from the top): nothing to train, and
    # the exported head of that later stage stays as it is.
    manager.close()
    return {"step": latest_step, "past_total_steps": total_steps}
  optimizer, schedule, train_step = build_train_step(config, head, target, total_steps)

  target_params = jax.device_put(target_params, param_sharding(mesh, target_params))
  state = TrainState(step=jnp.zeros((), jnp.int32), head_params=head_params,
                     opt_state=optimizer.init(head_params))
  # Every leaf placed on the mesh up front (scalars replicated), so the step compiles once.
  state = jax.device_put(state, param_sharding(mesh, state))
  abstract = lambda tree: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
  restored = checkpointing.restore(manager, abstract(state.head_params),
                                   abstract(state.opt_state), iterator)
  start = 0
  if restored is not None:
    start, head_params, opt_state = restored
    state = TrainState(step=jax.device_put(jnp.asarray(start, jnp.int32), state.step.sharding),
                       head_params=head_params, opt_state=opt_state)

  rows = batch_sharding(mesh)
  writer = MetricsWriter(workdir, resume_step=start)
  last = {}
  pending = None  # metrics of the previous step, fetched one step late so the device never idles

  def log(step, metrics, seconds):
    nonlocal last
    metrics = jax.device_get(metrics)
    if not math.isfinite(float(metrics["loss"])):
      raise TrainingError(f"loss is {metrics['loss']} at step {step}; stopping. The latest "
                          f"checkpoint ({manager.latest_step()}) is intact.")
    last = writer.write(step, metrics, seconds)
    bar.set_postfix(writer.summary(last), refresh=False)

  def save(step, metrics, force=False):
    if force or manager.should_save(step):
      if not math.isfinite(float(metrics["loss"])):  # never checkpoint a diverged state
        raise TrainingError(f"loss is {float(metrics['loss'])} at step {step}; not saving it. "
                            f"The latest checkpoint ({manager.latest_step()}) is intact.")
      checkpointing.save(manager, step, state.head_params, state.opt_state, iterator, force=force)

  bar = tqdm.tqdm(total=total_steps, initial=start, desc="train", unit="step")
  step, metrics, tick, logged_step = start, None, time.perf_counter(), start
  try:
    while step < total_steps:
      batch = next(iterator)
      arrays = [jax.device_put(batch[name], rows) for name in ROW_ARRAYS if name in batch]
      state, metrics = train_step(state, target_params, *arrays)
      step += 1
      if pending is not None:
        log(*pending)
        pending = None
      if step % t.log_every == 0 or step == total_steps:
        now = time.perf_counter()
        pending = (step, metrics, (now - tick) / (step - logged_step))
        tick, logged_step = now, step
      save(step, metrics)
      bar.update(1)
    if pending is not None:
      log(*pending)
  except KeyboardInterrupt:
    if metrics is not None and step > (manager.latest_step() or 0):
      save(step, metrics, force=True)
      manager.wait_until_finished()
      print(f"\ninterrupted: saved step {step}; rerun the same command to resume", flush=True)
    raise
  finally:
    bar.close()
    writer.close()
  if step > (manager.latest_step() or 0):
    save(step, metrics, force=True)
  manager.wait_until_finished()
  manager.close()
  save_hf_head(state.head_params, head, os.path.join(workdir, "hf_head"))
  return {"step": step, **last}
