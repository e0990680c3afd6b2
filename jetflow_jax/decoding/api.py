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

  Args:
    target_params: the target's params.
    config: the target's config.
    prompts: one list of token ids per row; rows of any lengths stop independently.
    max_new_tokens: the most tokens a row generates (stop token included).
    sampler: `Greedy()` or `Sampling(temperature, top_k, top_p)`.
    seed: row b draws with `fold_in(key(seed), b)`.
    cache_size: KV cache slots; by default a power of two that fits the longest prompt plus
      `max_new_tokens`.
    stop_tokens: the tokens that end a row; by default the config's EOS ids.
    on_tokens: with it, the host regains control every `stream_every` steps and is given the
      tokens generated so far, per row (for streaming); otherwise one jitted loop runs to the
      end. Both give the same tokens.
    stream_every: steps between calls of `on_tokens`, at first.
    mesh: a `DecodeMesh`: the rows split over its `data` axis (the number of prompts must be
      a multiple of its size) and the target over `tp` / `ep`; `target_params` must already be
      placed as `mesh.param_shardings` says.
    warmup: run the programs once before the clock starts (`Generation.warmup_s`).

  Returns:
    A `Generation`: each row's tokens and how they were made.

  Raises:
    InputError: an empty prompt, a prompt that does not fit the cache, `max_new_tokens` < 1,
      or prompts that do not split over the mesh.
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
  The head's mask flag comes from its config: naming `jetflow` with a bidirectional head,
  or `dflash`/`ddtree` with a causal one, calls `warn` once and runs (an ablation). Greedy
  output equals plain greedy decoding token for token, and sampled output follows the
  target's distribution exactly.

  Args:
    target_params: the target's params.
    target_config: the target's config.
    head_params: the draft head's params (None for `ar`).
    head_config: its config (None for `ar`).
    prompts: one list of token ids per row; rows of any lengths stop independently.
    max_new_tokens: the most tokens a row generates (stop token included).
    method: `ar`, `dflash`, `ddtree` or `jetflow`.
    budget: tree nodes a round verifies, root included (`ddtree`, `jetflow`); `"auto"` chooses
      each round's budget on a ladder up to `max_budget` (`decoding.auto`).
    top_k: candidate children per depth.
    max_budget: the top of the ladder with `budget="auto"`.
    sampler: `Greedy()` or `Sampling(temperature, top_k, top_p)`.
    seed: row b draws with `fold_in(key(seed), b)`.
    attention: `xla`, `pallas` (Triton on GPU, interpreted on CPU) or `pallas_tpu`.
    cache_size: KV cache slots; by default a power of two that fits the longest prompt plus
      `max_new_tokens`.
    stop_tokens: the tokens that end a row; by default the config's EOS ids.
    on_tokens: called with the tokens so far, per row, as they come (streaming).
    warn: how the ablation warning is given.
    mesh: a `DecodeMesh`; `target_params` must sit where `mesh.param_shardings` says
      (`load_qwen3(path, shardings=mesh.param_shardings)` loads them there).
    warmup: run every program once before the clock starts (`Generation.warmup_s`); always on
      with auto.

  Returns:
    A `Generation`: each row's tokens, the tokens each round committed, and timings.

  Raises:
    InputError: an unknown method or attention, a speculative method without a head, a
      budget or top-k the tree cannot hold, an empty prompt, a prompt that does not fit the
      cache, or prompts that do not split over the mesh.
    ConfigError: a head that does not fit the target (every mismatch listed).
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
