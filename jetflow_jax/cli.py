"""Shared bits of the command-line entry points."""

from __future__ import annotations

import sys
import traceback
from typing import Callable

import jax.numpy as jnp

from jetflow_jax.errors import InputError, JetflowError

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def parse_dtype(name: str):
  """A --dtype value; `auto` is bfloat16 on accelerators and float32 on CPU (where XLA upcasts
  bfloat16 matmuls and every host round trip pays the conversion again)."""
  if name == "auto":
    import jax
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
  if name not in DTYPES:
    raise InputError(f"--dtype must be auto or one of {', '.join(DTYPES)} (got {name!r})")
  return DTYPES[name]


def run(main: Callable[[], None]) -> None:
  """Runs `main`, printing library errors as one line instead of a traceback.

  In a multi-process job a failing process exits at once rather than waiting for its peers
  at shutdown; they see it gone within the heartbeat timeout and abort too.
  """
  from jetflow_jax import distributed
  try:
    main()
  except JetflowError as e:
    print(f"error: {e}", file=sys.stderr)
    distributed.exit_now(2, wait_for_peers=True)
  except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    distributed.exit_now(130)
  except Exception as e:
    if not distributed.is_initialized():
      raise
    traceback.print_exc()
    import jax
    print(f"error: process {jax.process_index()} of {jax.process_count()} stopped on "
          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. In a multi-process "
          "job this usually means another process died; restart every process with the same "
          "command to resume from the last checkpoint", file=sys.stderr)
    distributed.exit_now(1)
