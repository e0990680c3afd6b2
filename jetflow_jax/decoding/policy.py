"""Method policy: what each method runs (drafter, tree shape, which kind of head), in one place
for `decode.py`, the server, the bench and regeneration."""

from __future__ import annotations

from typing import Callable

from jetflow_jax.config import Qwen3Config
from jetflow_jax.decoding.round import TreeShape
from jetflow_jax.drafters import Drafter, HeadDrafter, NoDrafter
from jetflow_jax.errors import InputError
from jetflow_jax.head import head_dtype
from jetflow_jax.head_config import HeadConfig

#: The decoding methods: plain decoding, the DFlash chain, DDTree and JetFlow.
METHODS = ("ar", "dflash", "ddtree", "jetflow")
#: The methods that draft (every one but `ar`).
SPECULATIVE = METHODS[1:]
ATTENTION = ("xla", "pallas", "pallas_tpu")
DEFAULT_BUDGET = 64
DEFAULT_TOP_K = 7


def check_method(method: str) -> None:
  if method not in METHODS:
    raise InputError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def head_kind(method: str) -> str | None:
  """The head a method is made for: `jetflow` (causal), `dflash` (bidirectional), None for ar."""
  check_method(method)
  return {"ar": None, "jetflow": "jetflow"}.get(method, "dflash")


def tree_shape_for(method: str, budget: int = DEFAULT_BUDGET,
                   top_k: int = DEFAULT_TOP_K) -> TreeShape:
  """The tree shape `method` verifies.

  ar: the root alone; dflash: the chain of per-depth top-1 tokens; ddtree and jetflow: the
  exact top-`budget` tree over per-depth top-`top_k` candidates.

  Raises:
    InputError: an unknown method.
  """
  check_method(method)
  if method == "ar":
    return TreeShape("root")
  if method == "dflash":
    return TreeShape("chain")
  return TreeShape("top_n", budget, top_k)


def drafter_for(method: str, target_config: Qwen3Config, head_params,
                head_config: HeadConfig | None, attention: str = "xla",
                warn: Callable[[str], None] = print) -> Drafter:
  """The drafter `method` runs with (`NoDrafter` for ar, else a `HeadDrafter`).

  Naming `jetflow` with a bidirectional head, or `dflash`/`ddtree` with a causal one, calls
  `warn` once (an ablation).

  Args:
    method: `ar`, `dflash`, `ddtree` or `jetflow`.
    target_config: the target's config.
    head_params: the head's params (their dtype is the drafter's).
    head_config: the head's config.
    attention: `xla`, `pallas` or `pallas_tpu`.
    warn: how the ablation warning is given.

  Returns:
    The drafter.

  Raises:
    InputError: an unknown method or attention, or a speculative method without a head.
    ConfigError: a head that does not fit the target.
  """
  check_method(method)
  if attention not in ATTENTION:
    raise InputError(f"attention must be {', '.join(ATTENTION)} (got {attention!r})")
  if method == "ar":
    return NoDrafter()
  if head_config is None or head_params is None:
    raise InputError(f"method {method!r} needs a draft head (--head); use --method ar without one")
  head_config.validate_for(target_config)
  if head_config.causal != (head_kind(method) == "jetflow"):
    kind = "causal (JetFlow)" if head_config.causal else "bidirectional (DFlash)"
    warn(f"warning: method {method} with a {kind} head: running it as an ablation")
  return HeadDrafter(head_config, head_dtype(head_params), attention)
