"""Training checkpoints: head params, optimizer state and step, with orbax.

A workdir holds `head_config.json` (reference layout) and `checkpoints/<step>/`
with items `params` and `opt_state`. The data position is the step itself (batch s
is row block s of the workdir's packing plan), so any process count restores it.
Every process writes its own shards; orbax writes each step to a temporary directory
and renames it when complete, so a run killed mid-save leaves the previous checkpoint
intact. Decoding reads a workdir's head through `head_checkpoint.load_head`.
"""

from __future__ import annotations

import os

import orbax.checkpoint as ocp

from jetflow_jax.head_checkpoint import CHECKPOINT_SUBDIR


def checkpoint_manager(workdir: str, save_every: int, keep: int) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(save_interval_steps=save_every, max_to_keep=keep,
                                         create=True)
  return ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), CHECKPOINT_SUBDIR),
                               options=options)


def save(manager: ocp.CheckpointManager, step: int, head_params, opt_state,
         force: bool = False) -> bool:
  """Saves when `step` is due (or `force`); returns whether a save started."""
  return manager.save(step, args=ocp.args.Composite(
      params=ocp.args.StandardSave(head_params), opt_state=ocp.args.StandardSave(opt_state)),
      force=force)


def restore(manager: ocp.CheckpointManager, abstract_params, abstract_opt_state):
  """(step, params, opt_state) of the latest checkpoint, placed as the abstract trees say.

  Returns None when there is no checkpoint yet.
  """
  step = manager.latest_step()
  if step is None:
    return None
  restored = manager.restore(step, args=ocp.args.Composite(
      params=ocp.args.StandardRestore(abstract_params),
      opt_state=ocp.args.StandardRestore(abstract_opt_state)))
  return step, restored["params"], restored["opt_state"]
