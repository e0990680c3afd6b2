"""The public decoding calls: plain and speculative decoding of a batch of prompts, both thin
calls of the one device loop (`loop.decode_prompts`) over the one round."""

from __future__ import annotations

from typing import Callable, Sequence

from jetflow_jax.config import Qwen3Config
from jetflow_jax.decoding.loop import Generation, decode_prompts
from jetflow_jax.decoding.policy import (DEFAULT_BUDGET, DEFAULT_TOP_K, drafter_for,
                                         tree_shape_for)
from jetflow_jax.decoding.round import TreeShape
from jetflow_jax.drafters import NoDrafter
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.mesh import DecodeMesh
from jetflow_jax.sampling import Greedy, Sampler


def generate(target_params, config: Qwen3Config, prompts: Sequence[Sequence[int]],
             max_new_tokens: int, *, sampler: Sampler = Greedy(), seed: int = 0,
             cache_size: int | None = None, stop_tokens: Sequence[int] | None = None,
             on_tokens: Callable[[list[list[int]]], None] | None = None,
             stream_every: int = 8, mesh: DecodeMesh | None = None,
             warmup: bool = False) -> Generation:
  """Decodes a batch of prompts (lists of token ids of any lengths) plainly: one token a round.

  `cache_size` defaults to a power of two that fits the longest prompt plus
  `max_new_tokens`. `stop_tokens` defaults to the config's EOS ids. With
  `on_tokens`, the host regains control every `stream_every` steps and is given
  the tokens generated so far (for streaming); otherwise one jitted loop runs to
  the end. With `mesh` (a `DecodeMesh`), the rows split over its `data` axis (the number
  of prompts must be a multiple of its size) and the target over `tp` / `ep`;
  `target_params` must already be placed as `mesh.param_shardings` says. `warmup` runs the
  programs once before the clock starts (`Generation.warmup_s`).
  """
  return decode_prompts(target_params, config, NoDrafter(), None, prompts, max_new_tokens,
                        tree_shape=TreeShape("root"), sampler=sampler, seed=seed,
                        cache_size=cache_size, stop_tokens=stop_tokens, on_tokens=on_tokens,
                        stream_every=stream_every, mesh=mesh, warmup=warmup)


def speculative_generate(target_params, target_config: Qwen3Config, head_params,
                         head_config: HeadConfig | None, prompts: Sequence[Sequence[int]],
                         max_new_tokens: int, *, method: str = "jetflow",
                         budget: int | str = DEFAULT_BUDGET, top_k: int = DEFAULT_TOP_K,
                         max_budget: int = 256,
                         sampler: Sampler = Greedy(), seed: int = 0, attention: str = "xla",
                         cache_size: int | None = None, stop_tokens: Sequence[int] | None = None,
                         on_tokens: Callable[[list[list[int]]], None] | None = None,
                         warn: Callable[[str], None] = print,
                         mesh: DecodeMesh | None = None, warmup: bool = False) -> Generation:
  """Decodes `prompts` (lists of token ids) with `method` in `policy.METHODS`.

  `dflash` drafts the chain of per-depth top-1 tokens; `ddtree` and `jetflow` the exact
  top-`budget` tree over per-depth top-`top_k` candidates; `ar` is plain decoding (no head).
  `budget="auto"` chooses each round's budget on a ladder up to `max_budget` (`decoding.auto`).
  The head's mask flag comes from its config: naming `jetflow` with a bidirectional head,
  or `dflash`/`ddtree` with a causal one, calls `warn` once and runs (an ablation).
  With `mesh` (a `DecodeMesh`), `target_params` must sit where `mesh.param_shardings` says
  (`load_qwen3(path, shardings=mesh.param_shardings)` loads them there). `warmup` (always on
  with auto) runs every program once before the clock starts (`Generation.warmup_s`).
  """
  drafter = drafter_for(method, target_config, head_params, head_config, attention, warn)
  if method == "ar":  # a head given anyway is not passed along (nor compiled in)
    head_params = None
  auto = budget == "auto" and method in ("ddtree", "jetflow")
  fixed = max_budget if budget == "auto" else budget
  return decode_prompts(target_params, target_config, drafter, head_params, prompts,
                        max_new_tokens, tree_shape=tree_shape_for(method, fixed, top_k),
                        sampler=sampler, seed=seed, cache_size=cache_size,
                        stop_tokens=stop_tokens, impl=attention, on_tokens=on_tokens,
                        mesh=mesh, auto=auto, warmup=warmup)
