"""The embedded default: a small Qwen3 target and two draft heads, trained here on CPU.

They ship inside the package (bfloat16), so `decode.py` and the benchmark run out of
the box. `scripts/build_embedded.sh` rebuilds all three from the CPython standard library.
"""

from __future__ import annotations

import os

from jetflow_jax.errors import CheckpointError

CHECKPOINTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints")
TARGET_DIR = os.path.join(CHECKPOINTS_DIR, "target")
HEAD_DIRS = {"jetflow": os.path.join(CHECKPOINTS_DIR, "head_jetflow"),
             "dflash": os.path.join(CHECKPOINTS_DIR, "head_dflash")}


def default_target() -> str:
  """The embedded target's directory (`load_qwen3` takes it).

  Raises:
    CheckpointError: the target is not built (`scripts/build_embedded.sh` builds it).
  """
  if not os.path.isfile(os.path.join(TARGET_DIR, "config.json")):
    raise CheckpointError("no --checkpoint given and the embedded default target is not built "
                          f"(expected {TARGET_DIR}; scripts/build_embedded.sh builds it)")
  return TARGET_DIR


def default_head(kind: str) -> str | None:
  """The embedded `jetflow` (causal) or `dflash` (bidirectional) head's directory (`load_head`
  takes it), or None if it is not built."""
  path = HEAD_DIRS[kind]
  return path if os.path.isfile(os.path.join(path, "config.json")) else None
