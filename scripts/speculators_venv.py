"""speculators 0.9.0 in a venv of its own, for tests/test_speculators_interop.py.

  python scripts/speculators_venv.py      # creates it once (or reuses it); prints its python

A plain `pip install speculators` pulls CUDA builds of torch, and its transformers pin differs
from ours, so it gets its own venv, installed the way DESIGN.md measured: torch at the local
CPU wheel, speculators and hs-connectors without their dependencies, then what its models
import. About 2 minutes and 1.5 GB, once per machine: the venv lives outside the checkout
(~/.cache/jetflow_jax/speculators-0.9.0, or $JETFLOW_SPECULATORS_VENV) and is reused while its
stamp names these same steps. Concurrent callers wait on a lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys

STEPS = (
    ("torch==2.13.0",),
    ("--no-deps", "speculators==0.9.0", "hs-connectors==0.9.0"),
    ("transformers<=5.19", "datasets<=5.1", "openai", "pydantic-settings", "loguru",
     "safetensors", "numpy"),
)
STAMP = "jetflow-speculators.json"


class Unavailable(Exception):
  """The venv could not be made here (no index, a failed install); the message says why."""


def default_dir() -> str:
  return os.environ.get("JETFLOW_SPECULATORS_VENV") or os.path.join(
      os.path.expanduser("~"), ".cache", "jetflow_jax", "speculators-0.9.0")


def python_of(directory: str) -> str:
  return os.path.join(directory, "bin", "python")


def _ready(directory: str) -> bool:
  try:
    with open(os.path.join(directory, STAMP)) as f:
      return json.load(f) == [list(step) for step in STEPS]
  except (OSError, ValueError):
    return False


INSTALL_TIMEOUT_S = 1200  # a pip step that hangs (a dead index) must not hang `make test`


def _run(command: list[str]) -> None:
  try:
    done = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
  except subprocess.TimeoutExpired:
    raise Unavailable(f"`{' '.join(command[-3:])}` took over {INSTALL_TIMEOUT_S} s") from None
  if done.returncode:
    lines = [l for l in (done.stderr or done.stdout).splitlines() if l.strip()]
    raise Unavailable(f"`{' '.join(command[-3:])}` failed: {' | '.join(lines[-3:])}")


def ensure(directory: str | None = None) -> str:
  """The python of a ready speculators venv at `directory`, made if needed; Unavailable if it
  cannot be made."""
  directory = os.path.abspath(directory or default_dir())
  os.makedirs(os.path.dirname(directory), exist_ok=True)
  with open(directory + ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if _ready(directory):
      return python_of(directory)
    shutil.rmtree(directory, ignore_errors=True)  # a half-made one from an interrupted run
    _run([sys.executable, "-m", "venv", directory])
    for step in STEPS:
      _run([python_of(directory), "-m", "pip", "install", "--quiet", *step])
    with open(os.path.join(directory, STAMP), "w") as f:
      json.dump([list(step) for step in STEPS], f)
  return python_of(directory)


if __name__ == "__main__":
  try:
    print(ensure(sys.argv[1] if len(sys.argv) > 1 else None))
  except Unavailable as e:
    print(f"speculators venv not made: {e}", file=sys.stderr)
    sys.exit(1)
