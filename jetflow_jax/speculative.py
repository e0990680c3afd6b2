"""Speculative tree decoding: one jitted draft-build-verify-accept-commit round, and its loops.

Each round, with nothing going to the host:
1. the drafter proposes per-depth log-probs after each row's anchor (its last committed token);
2. a tree of `budget` nodes is built from them (`tree.build_tree`, or the DFlash chain);
3. one target forward over the nodes reads the committed KV cache and the tree under the
   ancestor mask (node position = committed length - 1 + depth; the root is the anchor);
4. the target's choice at every node decides the accepted branch and the bonus token;
5. only the accepted rows are committed: their K/V go to contiguous cache slots after the
   committed prefix, their taps to the drafter, their tokens to the sequence.

Invariants, per row: `lengths_b` tokens are committed; the target cache holds the K/V of
all but the last (the anchor) and so does the drafter's context. Writes of a round cover
`depth + 1` slots after the committed prefix; slots past what is committed are junk that
later rounds overwrite, so every buffer keeps `depth + 1` spare slots.

A round is `draft_and_verify` (1-3), the target's choice at every node, and `commit_choices`
(4-5): `speculative_round` draws with one sampler and key for the batch, the continuous-batching
engine (`jetflow_jax.engine`) with each slot's own settings and key. With `NoDrafter` and
`TreeShape("root")` a round is one AR step.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Literal, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jetflow_jax.accept import accept
from jetflow_jax.config import Qwen3Config
from jetflow_jax.distributed import to_host
from jetflow_jax.drafters import Drafter, HeadDrafter, NoDrafter
from jetflow_jax.errors import InputError
from jetflow_jax.generate import (PREFILL_CHUNK, default_cache_size, generate, is_stop,
                                  new_tokens, pad_prompts, placed, placed_rows, prefill_forward,
                                  run_loop, steps_until_done, stop_tokens_for)
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.mesh import DecodeMesh
from jetflow_jax.model import KVCache, forward, lm_logits, write_rows
from jetflow_jax.sampling import Greedy, Sampler
from jetflow_jax.tree import DraftTree, build_tree, chain_tree, root_tree, validate_tree_args


@dataclasses.dataclass(frozen=True)
class TreeShape:
  """How a round turns draft log-probs into a tree: the DFlash chain or the exact top-N tree."""

  kind: Literal["root", "chain", "top_n"]  # root: the anchor alone, a round is one AR step
  budget: int = 0  # nodes, root included (top_n only)
  top_k: int = 0  # candidate children per depth (top_n only)

  def __call__(self, depth_logprobs_bdv) -> DraftTree:
    if self.kind == "root":
      return root_tree(depth_logprobs_bdv)
    if self.kind == "chain":
      return chain_tree(depth_logprobs_bdv)
    return build_tree(depth_logprobs_bdv, self.budget, self.top_k)


@flax.struct.dataclass
class SpecState:
  """Everything a round reads and writes (see the module docstring for the invariants)."""

  tokens_bs: jax.Array  # committed tokens (prompt included), junk past lengths_b
  lengths_b: jax.Array
  max_lengths_b: jax.Array  # a row stops once it holds this many tokens
  done_b: jax.Array
  cache: KVCache  # target K/V
  drafter_state: Any
  rng: jax.Array  # one key for the batch (an engine's state: one per row, see `engine`)
  num_forwards: jax.Array  # target forward passes so far, prefill included (scalar)
  rounds_b: jax.Array  # rounds each row took part in
  committed_br: jax.Array  # tokens committed by row b in its round r (bonus included)

  @property
  def capacity(self) -> int:
    """Committed tokens a row may hold at most: every live round commits one or more, so
    `committed_br` has one column per possible round."""
    return self.committed_br.shape[1]


def _take_rows(x_bn, index_bm):
  """x[b, index[b, m]] for arrays with any trailing axes."""
  index = index_bm.reshape(index_bm.shape + (1,) * (x_bn.ndim - 2))
  return jnp.take_along_axis(x_bn, index, axis=1)


def _commit_count(state: SpecState, emitted_bd, accepted_depth_b, stop_tokens):
  """Tokens each row commits this round: up to the bonus, the first stop token, or a limit."""
  depth_d = jnp.arange(emitted_bd.shape[1], dtype=jnp.int32)
  stop_bd = is_stop(emitted_bd, stop_tokens) & (depth_d[None, :] <= accepted_depth_b[:, None])
  first_stop_b = jnp.where(jnp.any(stop_bd, axis=-1), jnp.argmax(stop_bd, axis=-1),
                           emitted_bd.shape[1])
  room_b = jnp.minimum(state.max_lengths_b, state.capacity) - state.lengths_b
  count_b = jnp.minimum(jnp.minimum(accepted_depth_b + 1, first_stop_b + 1), room_b)
  count_b = jnp.where(state.done_b, 0, count_b)
  hit_stop_b = first_stop_b < count_b
  return count_b, hit_stop_b


@flax.struct.dataclass
class Verified:
  """A round's tree after the target's forward over it (steps 1-3 of the module docstring)."""

  tree: DraftTree  # the root's token is each row's anchor
  logits_bnv: jax.Array  # the target's float32 logits at every node
  kv: KVCache  # the nodes' own K/V, `[B, N, K, H]` per layer, not yet committed
  taps_bnld: jax.Array | None  # the nodes' taps for the drafter (None without tap layers)


def draft_and_verify(target_params, drafter_params, state: SpecState, *, config: Qwen3Config,
                     drafter: Drafter, tree_shape: TreeShape, impl: str = "xla",
                     mesh: DecodeMesh | None = None) -> Verified:
  """Drafts after each row's anchor, builds the tree, and runs the target over it."""
  batch = state.lengths_b.shape[0]
  context_len_b = state.lengths_b - 1
  anchor_b = state.tokens_bs[jnp.arange(batch), context_len_b]

  with jax.named_scope("draft"):
    logprobs_bdv = drafter.draft(drafter_params, target_params, config, state.drafter_state,
                                 anchor_b, context_len_b)
  with jax.named_scope("build_tree"):
    tree = tree_shape(logprobs_bdv)
    tree = tree.replace(tokens=tree.tokens.at[:, 0].set(anchor_b))
  with jax.named_scope("verify"):
    hidden_bnd, tree_kv, taps_bnld = forward(
        target_params, config, tree.tokens, positions_bt=context_len_b[:, None] + tree.depths,
        cache=state.cache, cache_index_b=context_len_b, tree_mask_btt=tree.ancestor_mask,
        tap_layers=drafter.tap_layers, impl=impl, mesh=None if mesh is None else mesh.mesh)
    logits_bnv = lm_logits(target_params, config, hidden_bnd)
  return Verified(tree=tree, logits_bnv=logits_bnv, kv=tree_kv, taps_bnld=taps_bnld)


def commit_choices(drafter_params, state: SpecState, verified: Verified, choices_bn, *,
                   drafter: Drafter, stop_tokens) -> SpecState:
  """Accepts the path the target's choices `[B, N]` agree with and commits it (steps 4-5).

  `stop_tokens`: a tuple for every row, or `[B, K]` ids per row (see `generate.is_stop`).
  """
  rows = jnp.arange(state.lengths_b.shape[0])
  context_len_b = state.lengths_b - 1
  with jax.named_scope("accept"):
    path_bd, accepted_depth_b, emitted_bd = accept(verified.tree, choices_bn, drafter.depth)
    count_b, hit_stop_b = _commit_count(state, emitted_bd, accepted_depth_b, stop_tokens)

  with jax.named_scope("commit"):
    # The path's nodes 0..depth hold the tokens at positions context_len .. context_len + depth.
    # Ties the cache writes to the choices (never negative), hence after every layer's read of
    # the cache. A root-only tree (AR) keeps the root whatever the choices: untied, XLA wrote
    # first and copied each cache buffer twice a round to keep the reads intact (CPU: 1.6x).
    tree_kv = jax.tree.map(lambda x_bnkh: jnp.where(choices_bn[:, :, None, None] >= 0, x_bnkh, 0),
                           verified.kv)
    cache = KVCache(k=tuple(write_rows(c, _take_rows(t, path_bd), context_len_b)
                            for c, t in zip(state.cache.k, tree_kv.k)),
                    v=tuple(write_rows(c, _take_rows(t, path_bd), context_len_b)
                            for c, t in zip(state.cache.v, tree_kv.v)))
    taps_bnld = verified.taps_bnld
    path_taps = None if taps_bnld is None else _take_rows(taps_bnld, path_bd)
    drafter_state = drafter.commit(drafter_params, state.drafter_state, path_taps, context_len_b)
    tokens_bs = write_rows(state.tokens_bs, emitted_bd, state.lengths_b)
    lengths_b = state.lengths_b + count_b
    live_b = ~state.done_b
    # A finished row writes its 0 into the column after its last round, which is never read.
    committed_br = state.committed_br.at[rows, state.rounds_b].set(count_b)
    done_b = (state.done_b | hit_stop_b | (lengths_b >= state.max_lengths_b)
              | (lengths_b >= state.capacity))
  return state.replace(tokens_bs=tokens_bs, lengths_b=lengths_b, done_b=done_b, cache=cache,
                       drafter_state=drafter_state, num_forwards=state.num_forwards + 1,
                       rounds_b=state.rounds_b + live_b.astype(jnp.int32),
                       committed_br=committed_br)


def speculative_round(target_params, drafter_params, state: SpecState, *, config: Qwen3Config,
                      drafter: Drafter, tree_shape: TreeShape, sampler: Sampler,
                      stop_tokens: tuple[int, ...], impl: str = "xla",
                      mesh: DecodeMesh | None = None) -> SpecState:
  """One whole round for every row (finished rows compute and commit nothing)."""
  verified = draft_and_verify(target_params, drafter_params, state, config=config,
                              drafter=drafter, tree_shape=tree_shape, impl=impl, mesh=mesh)
  with jax.named_scope("accept"):
    rng, draw = jax.random.split(state.rng)
    choices_bn = sampler(draw, verified.logits_bnv)  # argmax, or one independent draw per node
  return commit_choices(drafter_params, state.replace(rng=rng), verified, choices_bn,
                        drafter=drafter, stop_tokens=stop_tokens)


def prefill_rows(target_params, drafter_params, prompt_bt, prompt_lengths_b, cache_size: int, *,
                 config: Qwen3Config, drafter: Drafter, mesh: DecodeMesh | None = None,
                 chunk: int = PREFILL_CHUNK):
  """The padded prompts through the target into caches of `cache_size` slots.

  Returns (target cache, logits at each row's last prompt token `[B, V]`, drafter state).
  """
  cache, last_bd, drafter_state = prefill_forward(
      target_params, config, prompt_bt, prompt_lengths_b, cache_size, mesh=mesh,
      tap_layers=drafter.tap_layers, chunk=chunk,
      init_taps=lambda taps: drafter.init_state(drafter_params, target_params, taps, cache_size),
      commit_taps=lambda state, taps, start_b: drafter.commit(drafter_params, state, taps,
                                                              start_b))
  return cache, lm_logits(target_params, config, last_bd), drafter_state


@functools.partial(jax.jit, static_argnames=("config", "drafter", "sampler", "stop_tokens",
                                             "capacity", "mesh", "chunk"))
def prefill(target_params, drafter_params, prompt_bt, prompt_lengths_b, max_new_tokens, rng, *,
            config: Qwen3Config, drafter: Drafter, sampler: Sampler,
            stop_tokens: tuple[int, ...], capacity: int,
            mesh: DecodeMesh | None = None, chunk: int = PREFILL_CHUNK) -> SpecState:
  """Target forward over the padded prompts; the first token; the drafter's initial state."""
  batch, prompt_len = prompt_bt.shape
  slots = capacity + drafter.depth + 1
  cache, logits_bv, drafter_state = prefill_rows(
      target_params, drafter_params, prompt_bt, prompt_lengths_b, slots, config=config,
      drafter=drafter, mesh=mesh, chunk=chunk)
  rng, draw = jax.random.split(rng)
  first_b = sampler(draw, logits_bv)
  tokens_bs = jnp.zeros((batch, slots), jnp.int32).at[:, :prompt_len].set(prompt_bt)
  tokens_bs = tokens_bs.at[jnp.arange(batch), prompt_lengths_b].set(first_b)
  lengths_b = prompt_lengths_b + 1
  max_lengths_b = prompt_lengths_b + max_new_tokens
  done_b = is_stop(first_b, stop_tokens) | (lengths_b >= max_lengths_b) | (lengths_b >= capacity)
  return SpecState(
      tokens_bs=tokens_bs, lengths_b=lengths_b, max_lengths_b=max_lengths_b, done_b=done_b,
      cache=cache, drafter_state=drafter_state,
      rng=rng, num_forwards=jnp.ones((), jnp.int32), rounds_b=jnp.zeros((batch,), jnp.int32),
      committed_br=jnp.zeros((batch, capacity), jnp.int32))


@functools.partial(jax.jit, static_argnames=("config", "drafter", "tree_shape", "sampler",
                                             "stop_tokens", "impl", "mesh"),
                   donate_argnames=("state",))
def decode(target_params, drafter_params, state: SpecState, max_rounds, *, config: Qwen3Config,
           drafter: Drafter, tree_shape: TreeShape, sampler: Sampler,
           stop_tokens: tuple[int, ...], impl: str, mesh: DecodeMesh | None = None) -> SpecState:
  """Up to `max_rounds` rounds (traced) in one `lax.while_loop`, until every row is done."""
  round_fn = functools.partial(speculative_round, target_params, drafter_params, config=config,
                               drafter=drafter, tree_shape=tree_shape, sampler=sampler,
                               stop_tokens=stop_tokens, impl=impl, mesh=mesh)
  return steps_until_done(round_fn, state, max_rounds)


METHODS = ("ar", "dflash", "ddtree", "jetflow")


@dataclasses.dataclass
class SpeculativeGeneration:
  """Generated token ids per prompt (stop token included) and how they were made."""

  tokens: list[list[int]]
  committed_per_round: list[list[int]]  # per row: tokens each round committed (bonus included)
  stop_reasons: list[str]  # per row: "stop_token", "max_new_tokens" or "cache_full"
  num_target_forwards: int  # prefill included
  compile_s: float
  wall_s: float  # prefill + decoding, compilation excluded

  @property
  def num_tokens(self) -> int:
    return sum(len(t) for t in self.tokens)

  @property
  def tau(self) -> float:
    """Tokens committed per verifying target forward, bonus included, over all rows."""
    rounds = sum(len(r) for r in self.committed_per_round)
    return sum(map(sum, self.committed_per_round)) / rounds if rounds else 0.0

  def row_tau(self, row: int) -> float:
    rounds = self.committed_per_round[row]
    return sum(rounds) / len(rounds) if rounds else 0.0


def tree_shape_for(method: str, budget: int, top_k: int) -> TreeShape:
  if method == "ar":  # with `drafters.NoDrafter`
    return TreeShape("root")
  if method == "dflash":
    return TreeShape("chain")
  if method in ("ddtree", "jetflow"):
    return TreeShape("top_n", budget, top_k)
  raise InputError(f"unknown speculative method {method!r}; choose from {', '.join(METHODS)}")


def stop_reason(tokens: list[int], max_new_tokens: int, stop_tokens: Sequence[int]) -> str:
  if tokens and tokens[-1] in stop_tokens:
    return "stop_token"
  return "max_new_tokens" if len(tokens) >= max_new_tokens else "cache_full"


def _shapes(tree, keep_sharding: bool = False):
  """Abstract values of `tree`; with `keep_sharding`, placed where its arrays are."""
  sharding = lambda x: getattr(x, "sharding", None) if keep_sharding else None
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x),
                                                     sharding=sharding(x)), tree)


_COMPILED: dict = {}


def _compiled(target_params, drafter_params, prompt_shape, statics: dict, capacity: int,
              compiler_options: tuple[tuple[str, Any], ...] = ()):
  """Ahead-of-time compiled (prefill, decode) for one set of shapes; kept for reuse.

  With `statics["mesh"]`, the params are taken where they are (the caller placed them) and
  the rows, scalars and decode state where the mesh puts them. `compiler_options` (pairs)
  go to XLA (the memory report asks for buffer dumps).
  """
  mesh = statics["mesh"]
  params = (_shapes(target_params, mesh is not None), _shapes(drafter_params, mesh is not None))
  key = (jax.tree.structure(params), tuple((x.shape, x.dtype) for x in jax.tree.leaves(params)),
         prompt_shape, tuple(statics.items()), capacity, compiler_options)
  options = dict(compiler_options) or None
  prefill_statics = {k: statics[k] for k in ("config", "drafter", "sampler", "stop_tokens",
                                             "mesh")}
  prefill_key = key[:3] + (tuple(prefill_statics.items()), capacity, compiler_options)
  int_scalar = jax.ShapeDtypeStruct((), jnp.int32)
  prompt_bt = jax.ShapeDtypeStruct(prompt_shape, jnp.int32)
  lengths_b = jax.ShapeDtypeStruct(prompt_shape[:1], jnp.int32)
  rng = jax.eval_shape(jax.random.key, 0)
  if mesh is not None:
    int_scalar, rng = placed((int_scalar, rng), mesh.replicated())
    prompt_bt, lengths_b = placed((prompt_bt, lengths_b), mesh.rows())
  if prefill_key not in _COMPILED:  # shared by every tree shape and attention impl
    compiled = prefill.lower(*params, prompt_bt, lengths_b, int_scalar, rng, capacity=capacity,
                             **prefill_statics).compile(options)
    state = compiled.out_info
    if mesh is not None:
      state = placed(state, compiled.output_shardings)
    _COMPILED[prefill_key] = (compiled, state)
  prefill_fn, state_shapes = _COMPILED[prefill_key]
  if key not in _COMPILED:
    _COMPILED[key] = decode.lower(*params, state_shapes, int_scalar, **statics).compile(options)
  return prefill_fn, _COMPILED[key]


def run_speculative(target_params, config: Qwen3Config, drafter: Drafter, drafter_params,
                    prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                    tree_shape: TreeShape, sampler: Sampler = Greedy(), seed: int = 0,
                    cache_size: int | None = None, stop_tokens: Sequence[int] | None = None,
                    impl: str = "xla",
                    on_tokens: Callable[[list[list[int]]], None] | None = None,
                    stream_every: int = 4,
                    mesh: DecodeMesh | None = None) -> SpeculativeGeneration:
  """Speculative decoding of a batch of prompts with any drafter (see `drafters.Drafter`).

  With `on_tokens`, the host regains control every `stream_every` rounds and is given
  the tokens so far (streaming); otherwise one jitted loop runs to the end. Both give
  the same tokens. With `mesh`, `target_params` must be placed as `mesh.param_shardings`
  says; the drafter's params are replicated over it here.
  """
  if max_new_tokens < 1:
    raise InputError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
  if tree_shape.kind == "top_n":
    validate_tree_args(drafter.depth, config.vocab_size, tree_shape.budget, tree_shape.top_k)
  if cache_size is None:
    cache_size = default_cache_size(config, prompts, max_new_tokens)
  stop = stop_tokens_for(config, stop_tokens)
  prompt_bt, prompt_lengths_b = pad_prompts(prompts, cache_size)
  if mesh is not None:
    if len(prompts) % mesh.size("data"):
      raise InputError(f"{len(prompts)} prompts do not split over the mesh's "
                       f"{mesh.size('data')} data-parallel rows")
    drafter_params = mesh.put(drafter_params, mesh.replicated())
  statics = dict(config=config, drafter=drafter, tree_shape=tree_shape, sampler=sampler,
                 stop_tokens=stop, impl=impl, mesh=mesh)

  start = time.perf_counter()
  prefill_fn, decode_fn = _compiled(target_params, drafter_params, prompt_bt.shape, statics,
                                    cache_size)
  compile_s = time.perf_counter() - start

  start = time.perf_counter()
  state = prefill_fn(target_params, drafter_params,
                     *placed_rows(mesh, prompt_bt, prompt_lengths_b), max_new_tokens,
                     jax.random.key(seed))
  state = run_loop(state, lambda s, rounds: decode_fn(target_params, drafter_params, s, rounds),
                   max_new_tokens, prompt_lengths_b, on_tokens, stream_every)
  tokens = new_tokens(state, prompt_lengths_b)
  wall_s = time.perf_counter() - start
  rounds, committed, num_forwards = to_host((state.rounds_b, state.committed_br,
                                             state.num_forwards))
  return SpeculativeGeneration(
      tokens=tokens, committed_per_round=[committed[b, :rounds[b]].tolist()
                                          for b in range(len(prompts))],
      stop_reasons=[stop_reason(t, max_new_tokens, stop) for t in tokens],
      num_target_forwards=int(num_forwards), compile_s=compile_s, wall_s=wall_s)


def drafter_for(method: str, target_config: Qwen3Config, head_params,
                head_config: HeadConfig | None, attention: str = "xla",
                warn: Callable[[str], None] = print) -> Drafter:
  """The drafter `method` runs with (`NoDrafter` for ar); bad names and heads raise InputError.

  Naming `jetflow` with a bidirectional head, or `dflash`/`ddtree` with a causal one, calls
  `warn` once (an ablation).
  """
  if method not in METHODS:
    raise InputError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
  if attention not in ("xla", "pallas", "pallas_tpu"):
    raise InputError(f"attention must be xla, pallas or pallas_tpu (got {attention!r})")
  if method == "ar":
    return NoDrafter()
  if head_config is None or head_params is None:
    raise InputError(f"method {method!r} needs a draft head (--head); use --method ar without one")
  head_config.validate_for(target_config)
  wants_causal = method == "jetflow"
  if head_config.causal != wants_causal:
    kind = "causal (JetFlow)" if head_config.causal else "bidirectional (DFlash)"
    warn(f"warning: method {method} with a {kind} head: running it as an ablation")
  return HeadDrafter(head_config, jax.tree.leaves(head_params)[0].dtype, attention)


def speculative_generate(target_params, target_config: Qwen3Config, head_params,
                         head_config: HeadConfig | None, prompts: Sequence[Sequence[int]],
                         max_new_tokens: int, *, method: str = "jetflow", budget: int = 64,
                         top_k: int = 7, sampler: Sampler = Greedy(), seed: int = 0,
                         attention: str = "xla", cache_size: int | None = None,
                         stop_tokens: Sequence[int] | None = None,
                         on_tokens: Callable[[list[list[int]]], None] | None = None,
                         warn: Callable[[str], None] = print,
                         mesh: DecodeMesh | None = None) -> SpeculativeGeneration:
  """Decodes `prompts` (lists of token ids) with `method` in `METHODS`.

  `dflash` drafts the chain of per-depth top-1 tokens; `ddtree` and `jetflow` the exact
  top-`budget` tree over per-depth top-`top_k` candidates; `ar` is plain decoding (no head).
  The head's mask flag comes from its config: naming `jetflow` with a bidirectional head,
  or `dflash`/`ddtree` with a causal one, calls `warn` once and runs (an ablation).
  With `mesh` (a `DecodeMesh`), `target_params` must sit where `mesh.param_shardings` says
  (`load_qwen3(path, shardings=mesh.param_shardings)` loads them there).
  """
  drafter = drafter_for(method, target_config, head_params, head_config, attention, warn)
  if method == "ar":
    return _autoregressive(target_params, target_config, prompts, max_new_tokens, sampler, seed,
                           cache_size, stop_tokens, on_tokens, mesh)
  return run_speculative(target_params, target_config, drafter, head_params, prompts,
                         max_new_tokens, tree_shape=tree_shape_for(method, budget, top_k),
                         sampler=sampler, seed=seed, cache_size=cache_size,
                         stop_tokens=stop_tokens, impl=attention, on_tokens=on_tokens,
                         mesh=mesh)


def _autoregressive(target_params, config, prompts, max_new_tokens, sampler, seed, cache_size,
                    stop_tokens, on_tokens, mesh) -> SpeculativeGeneration:
  """Plain decoding (`generate.generate`) reported like a speculative run: one token a forward."""
  result = generate(target_params, config, prompts, max_new_tokens, sampler=sampler, seed=seed,
                    cache_size=cache_size, stop_tokens=stop_tokens, on_tokens=on_tokens,
                    mesh=mesh)
  stop = stop_tokens_for(config, stop_tokens)
  return SpeculativeGeneration(
      tokens=result.tokens, committed_per_round=[[1] * (len(t) - 1) for t in result.tokens],
      stop_reasons=[stop_reason(t, max_new_tokens, stop) for t in result.tokens],
      num_target_forwards=result.num_forwards, compile_s=result.compile_s, wall_s=result.wall_s)
