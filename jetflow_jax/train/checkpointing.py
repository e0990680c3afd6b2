"""Training checkpoints: head params, optimizer state, step and the grain iterator, with orbax.

A workdir holds `head_config.json` (reference layout) and `checkpoints/<step>/`
with items `params`, `opt_state` and `data`. orbax writes each step to a
temporary directory and renames it when complete, so a run killed mid-save
leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os

import grain
import orbax.checkpoint as ocp

from jetflow_jax.errors import CheckpointError

HEAD_CONFIG_FILE = "head_config.json"
CHECKPOINT_SUBDIR = "checkpoints"


def checkpoint_manager(workdir: str, save_every: int, keep: int) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(save_interval_steps=save_every, max_to_keep=keep,
                                         create=True)
  return ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), CHECKPOINT_SUBDIR),
                               options=options)


def save(manager: ocp.CheckpointManager, step: int, head_params, opt_state, data_iterator,
         force: bool = False) -> bool:
  """Saves when `step` is due (or `force`); returns whether a save started."""
  return manager.save(step, args=ocp.args.Composite(
      params=ocp.args.StandardSave(head_params), opt_state=ocp.args.StandardSave(opt_state),
      data=grain.checkpoint.CheckpointSave(data_iterator)), force=force)


def restore(manager: ocp.CheckpointManager, abstract_params, abstract_opt_state, data_iterator):
  """(step, params, opt_state) of the latest checkpoint, the iterator set to its position.

  Returns None when there is no checkpoint yet.
  """
  step = manager.latest_step()
  if step is None:
    return None
  restored = manager.restore(step, args=ocp.args.Composite(
      params=ocp.args.StandardRestore(abstract_params),
      opt_state=ocp.args.StandardRestore(abstract_opt_state),
      data=grain.checkpoint.CheckpointRestore(data_iterator)))
  return step, restored["params"], restored["opt_state"]


def restore_head_params(workdir: str, abstract_params):
  """Head params of the latest checkpoint in a training workdir."""
  directory = os.path.join(os.path.abspath(workdir), CHECKPOINT_SUBDIR)
  with ocp.CheckpointManager(directory) as manager:
    step = manager.latest_step()
    if step is None:
      raise CheckpointError(f"{workdir} has no training checkpoint yet")
    restored = manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_params)))
  return restored["params"]
