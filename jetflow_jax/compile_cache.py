"""JAX's persistent compilation cache, on by default: a second start of the same shapes loads
its programs from disk instead of compiling them again.

$JETFLOW_COMPILATION_CACHE names the directory (default: ~/.cache/jetflow_jax/xla, under
$XDG_CACHE_HOME if set); set to the empty string, it turns the cache off.
"""

from __future__ import annotations

import os

import jax

ENV = "JETFLOW_COMPILATION_CACHE"


def default_directory() -> str:
  """Where the cache lives unless $JETFLOW_COMPILATION_CACHE says otherwise."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "jetflow_jax", "xla")


def directory() -> str | None:
  """$JETFLOW_COMPILATION_CACHE, or the default; None where it is set to the empty string."""
  path = os.environ.get(ENV, default_directory())
  return os.path.expanduser(path) if path else None


def enable(path: str | None = None) -> str | None:
  """Turns the cache on at `path` (default: `directory()`), for every later compile in this
  process; returns the directory, or None where the cache stays off."""
  path = path or directory()
  if path is None:
    return None
  jax.config.update("jax_compilation_cache_dir", path)
  # JAX's defaults keep only programs that took a second or more: every one counts here (a
  # server compiles dozens of variants, most of them in well under a second on a GPU).
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path
