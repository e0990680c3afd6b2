"""`train_and_evaluate(config, workdir)`: the head's training loop, on one process or many.

Resumable at any moment: the step's randomness derives from the step number, the data
of step s is row block s of the workdir's packing plan, and a run restarted with the
same command (on any number of processes, with the same global mesh) continues from the
latest checkpoint to the same parameters. Each process feeds only its rows of every
global batch; process 0 alone writes metrics and the exported head.
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

from jetflow_jax import cli, distributed, partitioning
from jetflow_jax.errors import ConfigError, InputError, JetflowError
from jetflow_jax.head import RematPolicy, split_frozen
from jetflow_jax.head_checkpoint import HEAD_CONFIG_FILE, save_hf_head, workdir_head_config
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.kernels.train_attention import TrainAttentionImpl
from jetflow_jax.moe import ExpertsImpl
from jetflow_jax.train import checkpointing, measure_acceptance, setup
from jetflow_jax.train.data import StoreBatches, batch_iterator
from jetflow_jax.train.losses import LOSSES
from jetflow_jax.train.metrics import MetricsWriter
from jetflow_jax.train.packing import (PackingPlan, check_plan, load_plan, make_plan, plan_inputs,
                                       save_plan)
from jetflow_jax.train.sharding import (activation_layout, batch_sharding, check_batch, make_mesh,
                                        param_sharding)
from jetflow_jax.train.step import (LossConfig, TrainState, make_loss_fn, make_optimizer,
                                    make_train_step)
from jetflow_jax.train.store import TokenStore


class TrainingError(JetflowError):
  """Training cannot go on (a non-finite loss); the last checkpoint is left intact."""


def _check_head_config(workdir: str, head: HeadConfig, write: bool = True) -> None:
  """Writes the head config into a new workdir (if `write`: process 0 only); refuses a workdir
  made for another head."""
  existing = workdir_head_config(workdir)
  if existing is None:
    if write:  # whole or not at all: another process may be reading it
      path = os.path.join(workdir, HEAD_CONFIG_FILE)
      with open(path + ".tmp", "w") as f:
        json.dump(head.to_hf_dict(), f, indent=2)
      os.replace(path + ".tmp", path)
  elif existing != head:
    raise ConfigError(f"{workdir} holds a run of a different head ({existing}); "
                      f"this config asks for {head}. Use a new --workdir.")


def loss_config(config: ml_collections.ConfigDict) -> LossConfig:
  t = config.train
  if t.loss not in LOSSES:
    raise ConfigError(f"train.loss={t.loss!r} is not one of {', '.join(LOSSES)}")
  for key in ("loss_chunk_anchors", "attention_chunk_anchors"):
    if t[key] < 0:
      raise ConfigError(f"train.{key}={t[key]} must be >= 0")
  for key, allowed in (("head_attention", get_args(TrainAttentionImpl)),
                       ("remat", get_args(RematPolicy)),
                       ("target_experts", get_args(ExpertsImpl))):
    if t[key] not in allowed:
      raise ConfigError(f"train.{key}={t[key]!r} is not one of {', '.join(allowed)}")
  return LossConfig(kind=t.loss, temperature=t.temperature, depth_gamma=t.depth_gamma,
                    num_anchors=t.num_anchors, chunk_anchors=t.loss_chunk_anchors,
                    head_dtype=cli.parse_dtype(config.head.dtype),
                    head_attention=t.head_attention,
                    attention_chunk_anchors=t.attention_chunk_anchors, remat=t.remat,
                    target_experts=t.target_experts)


def build_train_step(config: ml_collections.ConfigDict, head: HeadConfig, target,
                     total_steps: int, mesh):
  """(optimizer, schedule, jitted train step with the state donated) as `config` describes,
  its activations pinned to `mesh` (see `sharding.activation_layout`)."""
  t = config.train
  optimizer, schedule = make_optimizer(t.lr, t.b1, t.b2, t.weight_decay, t.grad_clip,
                                       total_steps, t.warmup_frac, t.final_lr_frac)
  loss_fn = make_loss_fn(head, target, loss_config(config), activation_layout(mesh))
  train_step = jax.jit(make_train_step(loss_fn, optimizer, schedule, t.seed),
                       donate_argnames=("state",))
  return optimizer, schedule, train_step


def data_plan(config: ml_collections.ConfigDict, workdir: str, store: TokenStore,
              has_checkpoint: bool) -> PackingPlan:
  """The workdir's packing plan: reloaded when it fits, else made (by process 0) and saved.

  A resumed run must find the plan it started with. Process 0 alone decides and writes;
  every process then passes the same barrier and loads the same file.
  """
  d = config.data
  inputs = plan_inputs(seq_len=d.seq_len, epochs=config.train.epochs, seed=d.shuffle_seed,
                       pack=d.pack, source=store.fingerprint())
  if distributed.is_main_process():
    saved = load_plan(workdir)
    if saved is None or (saved.meta["inputs"] != inputs and not has_checkpoint):
      save_plan(make_plan(store.lengths, store.prompt_lengths, seq_len=d.seq_len,
                          epochs=config.train.epochs, seed=d.shuffle_seed, pack=d.pack,
                          source=inputs["store"]), workdir)
  distributed.barrier("packing plan")
  plan = load_plan(workdir)
  check_plan(plan, inputs, workdir)  # resuming: the data must be what it was
  return plan


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains the draft head described by `config`; returns the last logged metrics.

  Every process of a multi-process job calls this with the same arguments. A SIGTERM
  ends the run after the current step with a checkpoint (`"preempted": True`). Rerunning the
  same call resumes from the workdir's latest checkpoint to the parameters an uninterrupted
  run reaches.

  Args:
    config: a training config (`train.defaults.base_config` and a `configs/*.py` file's
      `get_config`).
    workdir: checkpoints, metrics, the packing plan, the store (by default) and at the end
      `hf_head/`, the head in the reference layout.

  Returns:
    The last logged metrics (loss, learning rate, grad norm, per-depth agreement, ...) and,
    with `eval.prompts`, the head's `HeadAcceptance` on them as "acceptance" (also written as
    `acceptance.json` into the workdir and `hf_head/`).

  Raises:
    ConfigError: a config that does not fit the target, or a workdir made for another head.
    InputError: data or a mesh the run cannot take.
    CheckpointError: a target or data path that cannot be read.
    TrainingError: a non-finite loss (the last checkpoint is left intact).
  """
  workdir = os.path.abspath(os.path.expanduser(workdir))
  main = distributed.is_main_process()
  t = config.train
  loss_config(config)  # a bad loss setting fails here, before any weights load
  # Everything checkable from config files is checked before the target's weights load.
  target = setup.target_config(config)
  head = setup.head_config(config, target)
  mesh = make_mesh(config.mesh.data, config.mesh.fsdp)
  check_batch(mesh, t.batch_size)
  head_params = setup.initial_head_params(config, head)
  _check_head_config(workdir, head, write=False)  # a workdir of another head: refused up front
  held_out = setup.eval_prompts(config)
  preemption = distributed.Preemption()  # from here on, so a SIGTERM during set-up counts too
  store = setup.training_store(config, workdir)
  if store.max_token >= target.vocab_size:
    raise InputError(f"{store.directory} holds token id {store.max_token}, outside the target's "
                     f"vocabulary of {target.vocab_size}")
  os.makedirs(workdir, exist_ok=True)
  _check_head_config(workdir, head, write=main)
  manager = checkpointing.checkpoint_manager(workdir, t.checkpoint_every, t.keep_checkpoints)
  latest_step = manager.latest_step() or 0
  plan = data_plan(config, workdir, store, has_checkpoint=latest_step > 0)
  num_batches = plan.num_steps(t.batch_size)
  if not num_batches:
    raise InputError(f"the data fill {plan.num_rows} rows, fewer than one batch of "
                     f"train.batch_size={t.batch_size}")
  total_steps = min(num_batches, t.num_steps) if t.num_steps > 0 else num_batches
  if latest_step > total_steps:
    # A later stage already ran here (a staged script re-run from the top): nothing to train, and
    # the exported head of that later stage stays as it is.
    manager.close()
    return {"step": latest_step, "past_total_steps": total_steps}
  optimizer, schedule, train_step = build_train_step(config, head, target, total_steps, mesh)

  setup.say(f"loading the target ({config.target.checkpoint or 'random, target.random'})")
  _, target_params = setup.load_target(config, lambda _, tree: param_sharding(mesh, tree))
  if head.draft_vocab_size and not t.init_head:
    head_params = setup.store_draft_vocab(head_params, head, store, target, target_params)
  state = TrainState(step=jnp.zeros((), jnp.int32), head_params=head_params,
                     opt_state=optimizer.init(split_frozen(head_params)[0]))
  # Every leaf placed on the mesh up front (scalars replicated), so the step compiles once.
  state = jax.device_put(state, param_sharding(mesh, state))
  keep = lambda tree: partitioning.abstract(tree, partitioning.KEEP)
  restored = checkpointing.restore(manager, keep(state.head_params), keep(state.opt_state))
  start = 0
  if restored is not None:
    start, head_params, opt_state = restored
    state = TrainState(step=jax.device_put(jnp.asarray(start, jnp.int32), state.step.sharding),
                       head_params=head_params, opt_state=opt_state)

  rows = batch_sharding(mesh)
  global_shape = (t.batch_size, config.data.seq_len)
  batches = StoreBatches(store, plan, config.data.seq_len, t.batch_size,
                         distributed.process_rows(rows, global_shape), config.data.pack)
  iterator = batch_iterator(batches, start)
  writer = MetricsWriter(workdir, resume_step=start) if main else None
  last = {}
  pending = None  # metrics of the previous step, fetched one step late so the device never idles

  def log(step, metrics, seconds):
    nonlocal last
    metrics = jax.device_get(metrics)
    if not math.isfinite(float(metrics["loss"])):
      raise TrainingError(f"loss is {metrics['loss']} at step {step}; stopping. The latest "
                          f"checkpoint ({manager.latest_step()}) is intact.")
    if writer is None:
      last = MetricsWriter.row(step, metrics, seconds)
    else:
      last = writer.write(step, metrics, seconds)
      bar.set_postfix(writer.summary(last), refresh=False)

  def save(step, metrics, force=False):
    if force or manager.should_save(step):
      if not math.isfinite(float(metrics["loss"])):  # never checkpoint a diverged state
        raise TrainingError(f"loss is {float(metrics['loss'])} at step {step}; not saving it. "
                            f"The latest checkpoint ({manager.latest_step()}) is intact.")
      checkpointing.save(manager, step, state.head_params, state.opt_state, force=force)

  setup.say(f"compiling the train step, then {total_steps - start} steps")
  bar = tqdm.tqdm(total=total_steps, initial=start, desc="train", unit="step", disable=not main)
  step, metrics, tick, logged_step, preempted = start, None, time.perf_counter(), start, False
  try:
    while step < total_steps:
      batch = next(iterator)
      arrays = [jax.make_array_from_process_local_data(rows, batch[name], global_shape)
                for name in batches.names]
      state, metrics = train_step(state, target_params, *arrays)
      step += 1
      if pending is not None:
        log(*pending)
        pending = None
      if step % t.log_every == 0 or step == total_steps:
        now = time.perf_counter()
        pending = (step, metrics, (now - tick) / (step - logged_step))
        tick, logged_step = now, step
      if preemption.reached(step):
        preempted = True
        break
      save(step, metrics)
      bar.update(1)
    if pending is not None:
      log(*pending)
  except KeyboardInterrupt:
    # One process's Ctrl-C cannot save alone (every process writes its shards); SIGTERM can.
    if (metrics is not None and step > (manager.latest_step() or 0)
        and not distributed.is_multiprocess()):
      save(step, metrics, force=True)
      manager.wait_until_finished()
      print(f"\ninterrupted: saved step {step}; rerun the same command to resume", flush=True)
    raise
  finally:
    bar.close()
    preemption.close()
    if writer is not None:
      writer.close()
  if step > (manager.latest_step() or 0):
    save(step, metrics, force=True)
  manager.wait_until_finished()
  manager.close()
  if preempted:
    return {"step": step, "preempted": True, **last}
  head_params = distributed.to_host(state.head_params)
  if main:
    save_hf_head(head_params, head, os.path.join(workdir, "hf_head"))
  if held_out is None:
    return {"step": step, **last}
  setup.say(f"measuring the head's acceptance on {len(held_out)} prompts of eval.prompts")
  acceptance = measure_acceptance.held_out_acceptance(head_params, head, target_params, target,
                                                      held_out, config.eval.max_new_tokens)
  measure_acceptance.save_beside_head(acceptance, workdir)
  return {"step": step, **last, "acceptance": acceptance}
