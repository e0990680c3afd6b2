"""One decoding round for every row: draft, build the tree, verify, choose, commit.

With nothing going to the host:
1. the drafter proposes per-depth log-probs after each row's anchor (its last committed token);
2. a tree is built from them (`TreeShape`: the anchor alone, the DFlash chain, or the exact
   top-N tree of `tree.build_tree`);
3. one target forward over the nodes reads the committed KV cache and the tree under the
   ancestor mask (node position = committed length - 1 + depth; the root is the anchor);
4. each row's sampler picks the target's token at every node with the row's own key, and the
   branch the choices agree with is accepted, plus the bonus token;
5. only the accepted rows are committed: their K/V go to contiguous cache slots after the
   committed prefix, their taps to the drafter, their tokens to the sequence.

AR is the round whose tree is the root alone (`TreeShape("root")` with `NoDrafter`): one
target forward, one token. Finished rows compute and commit nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import flax.struct
import jax
import jax.numpy as jnp

from jetflow_jax.accept import accept
from jetflow_jax.config import Qwen3Config
from jetflow_jax.decoding.budget import draft_expected_tau
from jetflow_jax.decoding.state import DecodeState, is_stop, scores, stop_code
from jetflow_jax.drafters import Drafter, draft_vocab_size, target_ids
from jetflow_jax.mesh import DecodeMesh
from jetflow_jax.model import KVCache, forward, lm_logits, write_rows
from jetflow_jax.tree import (DraftTree, build_tree, build_tree_accum, chain_tree, root_tree,
                              validate_tree_args)


@dataclasses.dataclass(frozen=True)
class TreeShape:
  """How a round turns draft log-probs into a tree: the DFlash chain, the exact top-N tree, or
  the reference's best-first `accum_logp` tree (`tree.build_tree_accum`).

  Frozen and hashable: static in the compiled round. Calling it on `[B, D, V]` log-probs
  returns the `DraftTree`.

  Attributes:
    kind: `root` (the anchor alone: with `NoDrafter`, one AR step), `chain` (the top-1 token
      of every depth), `top_n` (`tree.build_tree`) or `accum` (`tree.build_tree_accum`).
    budget: nodes, root included (`top_n` and `accum`).
    top_k: candidate children per depth (`top_n` and `accum`).
  """

  kind: Literal["root", "chain", "top_n", "accum"]  # root: the anchor alone, one AR step
  budget: int = 0  # nodes, root included (top_n and accum)
  top_k: int = 0  # candidate children per depth (top_n and accum)

  def __call__(self, depth_logprobs_bdv) -> DraftTree:
    if self.kind == "root":
      return root_tree(depth_logprobs_bdv)
    if self.kind == "chain":
      return chain_tree(depth_logprobs_bdv)
    if self.kind == "accum":
      return build_tree_accum(depth_logprobs_bdv, self.budget, self.top_k)
    return build_tree(depth_logprobs_bdv, self.budget, self.top_k)

  def validate(self, drafter: Drafter, config: Qwen3Config) -> None:
    """Refuses a budget or top-k the drafter's depth and the vocabulary cannot give.

    Raises:
      InputError: the budget or top-k does not fit.
    """
    if self.kind in ("top_n", "accum"):
      validate_tree_args(drafter.depth, draft_vocab_size(drafter, config), self.budget,
                         self.top_k)


@dataclasses.dataclass(frozen=True)
class RoundSpec:
  """Everything static about a round (hashable: one compiled variant per value).

  `decode_prompts` and the engine build it; a caller of `decode_round` does too.

  Attributes:
    config: the target's config.
    drafter: the `Drafter`.
    tree_shape: the `TreeShape`.
    impl: the attention path (`xla`, `pallas`, `pallas_tpu`).
    sampled: False promises every row is greedy: no draw is made.
    filtered: False promises no row filters by top-k / top-p: no sort is made.
    logprobs: True: committed tokens get the target's log-probabilities.
    ladder: budgets whose expected committed tokens a drafting round predicts
      (`budget.expected_tau`, into `DecodeState.predicted_bl`); () for none.
    mesh: the `DecodeMesh` the round runs over, or None.
    taps: False: the round computes and keeps no taps for the drafter (an AR round after
      which nothing drafts again in the request).
  """

  config: Qwen3Config
  drafter: Drafter
  tree_shape: TreeShape
  impl: str = "xla"
  sampled: bool = True  # False promises every row is greedy: no draw is made
  filtered: bool = True  # False promises no row filters by top-k / top-p: no sort is made
  logprobs: bool = False  # True: committed tokens get the target's log-probabilities
  # Budgets whose expected committed tokens a drafting round predicts (`budget.expected_tau`,
  # into `DecodeState.predicted_bl`), for the loop that picks each round's budget; () for none.
  ladder: tuple[int, ...] = ()
  mesh: DecodeMesh | None = None
  # False: the round computes and keeps no taps for the drafter (an AR round after which nothing
  # will draft again in the request: the loop choosing budgets finishes a request with it).
  taps: bool = True


@flax.struct.dataclass
class Verified:
  """A round's tree after the target's forward over it (steps 1-3 of the module docstring)."""

  tree: DraftTree  # the root's token is each row's anchor
  logits_bnv: jax.Array  # the target's float32 logits at every node
  kv: KVCache  # the nodes' own K/V, `[B, N, K, H]` per layer, not yet committed; or, after a
  # root-only round through XLA, the whole cache with the root's K/V already in place
  taps_bnld: jax.Array | None  # the nodes' taps for the drafter (None without tap layers)
  predicted_bl: jax.Array | None  # with `RoundSpec.ladder`, the draft's expected tokens


def _take_rows(x_bn, index_bm):
  """x[b, index[b, m]] for arrays with any trailing axes."""
  index = index_bm.reshape(index_bm.shape + (1,) * (x_bn.ndim - 2))
  return jnp.take_along_axis(x_bn, index, axis=1)


def draft_and_verify(target_params, drafter_params, state: DecodeState,
                     spec: RoundSpec) -> Verified:
  """Drafts after each row's anchor, builds the tree, and runs the target over it."""
  batch = state.lengths_b.shape[0]
  context_len_b = state.lengths_b - 1
  anchor_b = state.tokens_bs[jnp.arange(batch), context_len_b]

  shape = spec.tree_shape
  with jax.named_scope("draft"):
    if shape.kind == "root":  # AR: nothing is drafted (a drafter's state still takes the taps)
      logprobs_bdv = jnp.zeros((batch, 0, spec.config.vocab_size), jnp.float32)
    else:
      logprobs_bdv = spec.drafter.draft(drafter_params, target_params, spec.config,
                                        state.drafter_state, anchor_b, context_len_b)
  predicted_bl = None
  if spec.ladder and shape.kind != "root":
    with jax.named_scope("predict"):
      predicted_bl = draft_expected_tau(logprobs_bdv, spec.ladder, shape.top_k, shape.kind)
  with jax.named_scope("build_tree"):
    tree = shape(logprobs_bdv)  # over the drafter's vocabulary; the target sees its own ids
    tokens_bn = target_ids(spec.drafter, drafter_params, tree.tokens)
    tree = tree.replace(tokens=tokens_bn.at[:, 0].set(anchor_b))
  with jax.named_scope("verify"):
    # A root-only round through XLA writes the anchor's K/V straight into the cache (its one
    # node is always committed): on CPU the tree path's read-only cache, separate new rows and
    # commit cost 10-15% of an AR round. The kernels keep the tree path (they only read caches).
    in_place = shape.kind == "root" and spec.impl == "xla"
    hidden_bnd, tree_kv, taps_bnld = forward(
        target_params, spec.config, tree.tokens,
        positions_bt=context_len_b[:, None] + tree.depths, cache=state.cache,
        cache_index_b=context_len_b, tree_mask_btt=None if in_place else tree.ancestor_mask,
        tap_layers=spec.drafter.tap_layers if spec.taps else (), impl=spec.impl,
        mesh=None if spec.mesh is None else spec.mesh.mesh)
    logits_bnv = lm_logits(target_params, spec.config, hidden_bnd)
  return Verified(tree=tree, logits_bnv=logits_bnv, kv=tree_kv, taps_bnld=taps_bnld,
                  predicted_bl=predicted_bl)


def choose(state: DecodeState, logits_bnv, spec: RoundSpec):
  """The target's token at every node `[B, N]`: each row's sampler with a key of its own.

  A row's committed length is new every round, so folding it into the row's request key gives
  a fresh draw each round that depends on nothing else in the batch.
  """
  keys_b = jax.vmap(jax.random.fold_in)(state.keys_b, state.lengths_b)
  return state.sampling(keys_b, logits_bnv, sampled=spec.sampled, filtered=spec.filtered)


def _commit_count(state: DecodeState, emitted_bd, accepted_depth_b):
  """Tokens each row commits this round: up to the bonus, the first stop token, or a limit."""
  depth_d = jnp.arange(emitted_bd.shape[1], dtype=jnp.int32)
  stop_bd = (is_stop(emitted_bd, state.stop_tokens_bk)
             & (depth_d[None, :] <= accepted_depth_b[:, None]))
  first_stop_b = jnp.where(jnp.any(stop_bd, axis=-1), jnp.argmax(stop_bd, axis=-1),
                           emitted_bd.shape[1])
  room_b = jnp.minimum(state.max_lengths_b, state.capacity) - state.lengths_b
  count_b = jnp.minimum(jnp.minimum(accepted_depth_b + 1, first_stop_b + 1), room_b)
  count_b = jnp.where(state.done_b, 0, count_b)
  hit_stop_b = first_stop_b < count_b
  return count_b, hit_stop_b


def commit_choices(drafter_params, state: DecodeState, verified: Verified, choices_bn,
                   spec: RoundSpec) -> DecodeState:
  """Accepts the path the target's choices `[B, N]` agree with and commits it (steps 4-5)."""
  drafter = spec.drafter
  rows = jnp.arange(state.lengths_b.shape[0])
  context_len_b = state.lengths_b - 1
  with jax.named_scope("accept"):
    # A root-only round commits one row, whatever the drafter's depth.
    depth = 0 if spec.tree_shape.kind == "root" else drafter.depth
    path_bd, accepted_depth_b, emitted_bd = accept(verified.tree, choices_bn, depth)
    count_b, hit_stop_b = _commit_count(state, emitted_bd, accepted_depth_b)
  if spec.logprobs:
    with jax.named_scope("logprobs"):  # the verify's own logits along the path: no new forward
      chosen_bd, top_ids_bdx, top_logprobs_bdx = scores(
          _take_rows(verified.logits_bnv, path_bd), emitted_bd, state.top)
      state = state.replace(
          logprobs_bs=write_rows(state.logprobs_bs, chosen_bd, state.lengths_b),
          top_ids_bsx=write_rows(state.top_ids_bsx, top_ids_bdx, state.lengths_b),
          top_logprobs_bsx=write_rows(state.top_logprobs_bsx, top_logprobs_bdx, state.lengths_b))

  with jax.named_scope("commit"):
    # The path's nodes 0..depth hold the tokens at positions context_len .. context_len + depth.
    # Ties the cache writes to the choices (never negative), hence after every layer's read of
    # the cache. A root-only tree (AR) keeps the root whatever the choices: untied, XLA wrote
    # first and copied each cache buffer twice a round to keep the reads intact (CPU: 1.6x).
    if spec.tree_shape.kind == "root" and spec.impl == "xla":
      cache = verified.kv  # written in place by the forward
    else:
      tree_kv = jax.tree.map(
          lambda x_bnkh: jnp.where(choices_bn[:, :, None, None] >= 0, x_bnkh, 0), verified.kv)
      cache = KVCache(k=tuple(write_rows(c, _take_rows(t, path_bd), context_len_b)
                              for c, t in zip(state.cache.k, tree_kv.k)),
                      v=tuple(write_rows(c, _take_rows(t, path_bd), context_len_b)
                              for c, t in zip(state.cache.v, tree_kv.v)))
    taps_bnld = verified.taps_bnld
    path_taps = None if taps_bnld is None else _take_rows(taps_bnld, path_bd)
    drafter_state, pending = state.drafter_state, state.pending_taps_bpld
    pending_from_b = state.pending_from_b
    if spec.taps and spec.tree_shape.kind == "root" and pending.shape[1]:
      # Kept back, one row a round, for the next drafting round to commit all at once.
      write = lambda buffer, row, at: jax.lax.dynamic_update_slice_in_dim(buffer, row, at, 0)
      pending = jax.vmap(write)(pending, path_taps.astype(pending.dtype),
                                jnp.clip(context_len_b - pending_from_b, 0,
                                         pending.shape[1] - 1))
    elif spec.taps:  # without taps nothing drafts after this round: the state stays as it is
      drafter_state = drafter.commit(drafter_params, drafter_state, path_taps, context_len_b)
    tokens_bs = write_rows(state.tokens_bs, emitted_bd, state.lengths_b)
    lengths_b = state.lengths_b + count_b
    if spec.tree_shape.kind != "root" and pending.shape[1]:
      # The drafter holds everything before the new anchor now: later AR rounds keep theirs
      # back from there (else the next flush wrote the buffer's stale rows over this commit).
      pending_from_b = lengths_b - 1
    live_b = ~state.done_b
    # A finished row writes its 0 into the column after its last round, which is never read.
    committed_br = state.committed_br.at[rows, state.rounds_b].set(count_b)
    stop_b = state.stop_b + stop_code(hit_stop_b, lengths_b, state.max_lengths_b,
                                      state.capacity, live_b)
  if verified.predicted_bl is not None:
    state = state.replace(predicted_bl=verified.predicted_bl)
  return state.replace(tokens_bs=tokens_bs, lengths_b=lengths_b, stop_b=stop_b, cache=cache,
                       drafter_state=drafter_state, pending_taps_bpld=pending,
                       pending_from_b=pending_from_b,
                       num_forwards=state.num_forwards + 1,
                       rounds_b=state.rounds_b + live_b.astype(jnp.int32),
                       committed_br=committed_br)


def flush_pending(drafter_params, state: DecodeState, drafter: Drafter) -> DecodeState:
  """Commits the taps AR rounds kept back (`DecodeState.pending_taps_bpld`) to the drafter."""
  if not state.pending_taps_bpld.shape[1]:
    return state
  drafter_state = drafter.commit(drafter_params, state.drafter_state, state.pending_taps_bpld,
                                 state.pending_from_b)
  return state.replace(drafter_state=drafter_state, pending_from_b=state.lengths_b - 1)


def decode_round(target_params, drafter_params, state: DecodeState,
                 spec: RoundSpec) -> DecodeState:
  """One whole round for every row (a drafting round after AR rounds that kept their taps back
  needs `flush_pending` first: the loop choosing budgets calls it)."""
  verified = draft_and_verify(target_params, drafter_params, state, spec)
  with jax.named_scope("accept"):
    choices_bn = choose(state, verified.logits_bnv, spec)
  return commit_choices(drafter_params, state, verified, choices_bn, spec)
