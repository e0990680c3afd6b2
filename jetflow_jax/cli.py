"""Shared bits of the command-line entry points."""

from __future__ import annotations

import sys
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
  """Runs `main`, printing library errors as one line instead of a traceback."""
  try:
    main()
  except JetflowError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    sys.exit(130)
