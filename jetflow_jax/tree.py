"""Draft token trees: the `budget` most likely nodes of the draft head's per-depth top-k tree.

Each round the draft head gives log-probs for depths 1..D. Every node at depth d - 1 gets the
same K children, the top-K tokens of depth d, and a node scores the sum of the log-probs on its
path (the root scores 0). `build_tree` keeps the best N = `budget` nodes, root included:

  1. beam_d = the best min(N - 1, K^d) of beam_{d-1} x K children (beam_0 is the root);
  2. the kept nodes are the root plus the best N - 1 over all beams;
  3. they are emitted by (depth, beam rank), so every parent comes before its children.

"Best" is one total order: score descending, then depth ascending, then (within a depth) the
parent's beam rank, then the child's top-k rank. It is exact, ties included:
  * a parent precedes its child: log-probs are <= 0 so the child never scores higher, and on an
    equal score the shallower parent wins; so every prefix of the order is ancestor-closed.
  * beam_d is the exact top of depth d: if parent p missed beam_{d-1}, each of the N - 1 nodes
    ahead of p has a k-th child scoring >= p's k-th child (the same log-prob is added and float
    rounding is monotone) and winning an equal score through its parent's rank.
  * the global top N - 1 restricted to depth d is a top of depth d, so the merge misses nothing.

`build_tree_accum` is the reference JetFlow's builder (`accum_logp`): a best-first heap that
gives every node it expands all K children, so its N nodes are not the best N (width is spent
on siblings). It is here to run the paper's comparison as the paper ran it.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jetflow_jax.errors import InputError

MAX_NODES = 2**31 - 1  # node indices are int32, so larger counts saturate here


@flax.struct.dataclass
class DraftTree:
  """N nodes per row; node 0 is the root and every parent index is below its children's.

  A pytree (`flax.struct.dataclass`), so trees pass through `jit`.

  Attributes:
    tokens: `[B, N]` int32; the root's is 0 (the caller fills in the anchor token).
    parents: `[B, N]` int32; -1 for the root.
    depths: `[B, N]` int32; the root has depth 0.
    ancestor_mask: `[B, N, N]` bool; row i is True at i and at every ancestor of i (the
      attention mask of tree verification).
    scores: `[B, N]` float32 path log-prob; the root scores 0.
  """

  tokens: jax.Array  # [B, N] int32; the root's is 0 (the caller fills in the anchor token)
  parents: jax.Array  # [B, N] int32; -1 for the root
  depths: jax.Array  # [B, N] int32; the root has depth 0
  ancestor_mask: jax.Array  # [B, N, N] bool; row i is True at i and at every ancestor of i
  scores: jax.Array  # [B, N] float32 path log-prob; the root scores 0


def max_tree_nodes(depth: int, top_k: int) -> int:
  """1 + K + K^2 + ... + K^D nodes, saturating at MAX_NODES."""
  total, level = 1, 1
  for _ in range(depth):
    level = min(level * top_k, MAX_NODES)
    total = min(total + level, MAX_NODES)
  return total


def validate_tree_args(depth: int, vocab: int, budget: int, top_k: int) -> None:
  """Raises InputError unless a depth-`depth` top-`top_k` tree over `vocab` holds `budget` nodes."""
  if budget < 2:
    raise InputError(f"tree budget must be >= 2 nodes (the root and one draft token), got {budget}")
  if top_k < 1:
    raise InputError(f"tree top_k must be >= 1 (got {top_k})")
  if top_k > vocab:
    raise InputError(f"tree top_k {top_k} exceeds the vocabulary of {vocab} tokens")
  capacity = max_tree_nodes(depth, top_k)
  if budget > capacity:
    raise InputError(f"tree budget {budget} exceeds the {capacity} nodes a depth-{depth} tree "
                     f"with top-k {top_k} holds")


def _as_logprobs(depth_logprobs) -> jax.Array:
  logprobs_bdv = jnp.asarray(depth_logprobs, jnp.float32)
  if logprobs_bdv.ndim != 3:
    raise InputError(
        f"depth_logprobs must be [batch, depth, vocab], got shape {logprobs_bdv.shape}")
  return logprobs_bdv


def _ancestor_mask(parents_bn: jax.Array, max_depth: int) -> jax.Array:
  """Row i True at i and its ancestors, by pointer doubling: log2(depth) gathers, not depth."""
  batch, n = parents_bn.shape
  gather = jax.vmap(lambda rows, index: rows[index])
  jump_bn = jnp.where(parents_bn < 0, jnp.arange(n), parents_bn)  # the root points at itself
  mask_bnn = jnp.broadcast_to(jnp.eye(n, dtype=bool), (batch, n, n))
  # Invariant: rows cover ancestors up to distance 2^t - 1 and jump is the 2^t-th (or the root).
  for _ in range(max_depth.bit_length()):
    mask_bnn = mask_bnn | gather(mask_bnn, jump_bn)
    jump_bn = gather(jump_bn, jump_bn)
  return mask_bnn


def build_tree(depth_logprobs, budget: int, top_k: int) -> DraftTree:
  """The `budget` best nodes (root included) of the tree with each depth's top-`top_k` tokens.

  Every node at depth d - 1 gets the same children, the top-`top_k` tokens of depth d; a node
  scores the sum of the log-probs on its path. The kept set is exact, ties included (the module
  docstring gives the order), and closed under ancestors. Jittable with `budget` and `top_k`
  static; a `top_k` above `budget - 1` changes nothing and is capped there.

  Args:
    depth_logprobs: `[B, D, V]` per-depth log-probs, normalised per depth (scores add them
      along paths, so raw logits would give another tree).
    budget: N, the nodes kept, root included (>= 2).
    top_k: K, the candidate children of every node.

  Returns:
    A `DraftTree` of N nodes per row, emitted by (depth, rank): every parent before its
    children.

  Raises:
    InputError: `depth_logprobs` not 3-D, `budget` < 2 or more than the tree holds, or
      `top_k` outside [1, V].
  """
  logprobs_bdv = _as_logprobs(depth_logprobs)
  batch, depth, vocab = logprobs_bdv.shape
  validate_tree_args(depth, vocab, budget, top_k)
  # A node's N-th best child comes after its parent and N - 1 siblings in the order, so it is
  # never among the best N: a wider top-k would only cost time.
  top_k = min(top_k, budget - 1)

  # Beams of every depth, concatenated (root first), each best first; `parents` index this list.
  scores = [jnp.zeros((batch, 1), jnp.float32)]
  tokens = [jnp.zeros((batch, 1), jnp.int32)]
  parents = [jnp.zeros((batch, 1), jnp.int32)]
  depths = [np.zeros(1, np.int32)]
  offset = 0  # of the previous depth's beam in the concatenation
  for d in range(depth):
    # The only pass over V. One top_k per depth, not one over [B, D, V] sliced afterwards: XLA
    # CPU turns a top_k whose output is sliced into a full sort of the vocabulary.
    best_bk, best_tokens_bk = jax.lax.top_k(logprobs_bdv[:, d], top_k)
    prev_bw = scores[-1]
    # Candidate c is child c % K of parent c // K, so lax.top_k's lower-index-first tie-break
    # orders equal scores by (parent rank, child rank), as the module docstring's order says.
    cand_bc = (prev_bw[:, :, None] + best_bk[:, None, :]).reshape(batch, -1)
    beam_bw, cand_bw = jax.lax.top_k(cand_bc, min(budget - 1, cand_bc.shape[1]))
    scores.append(beam_bw)
    tokens.append(jnp.take_along_axis(best_tokens_bk, cand_bw % top_k, axis=1))
    parents.append(offset + cand_bw // top_k)
    depths.append(np.full(beam_bw.shape[1], d + 1, np.int32))
    offset += prev_bw.shape[1]
  scores_bt, tokens_bt, parents_bt = (jnp.concatenate(x, axis=1) for x in (scores, tokens, parents))
  depth_t = jnp.asarray(np.concatenate(depths))

  # The concatenation is depth-major then beam rank, so top_k's lower-index-first tie-break is the
  # depth-ascending order; the root is forced in first. Sorting the kept indices then emits nodes
  # by (depth, rank), which puts every parent before its children.
  keep_bn = jnp.sort(jax.lax.top_k(scores_bt.at[:, 0].set(jnp.inf), budget)[1], axis=1)
  rows_b1 = jnp.arange(batch)[:, None]
  # A kept parent's output index is the number of kept nodes before it in the concatenation.
  before_bnn = keep_bn[:, None, :] < parents_bt[rows_b1, keep_bn][:, :, None]
  parents_bn = jnp.sum(before_bnn, axis=-1, dtype=jnp.int32).at[:, 0].set(-1)
  ancestor_bnn = _ancestor_mask(parents_bn, min(depth, budget - 1))  # no deeper path fits
  return DraftTree(tokens=tokens_bt[rows_b1, keep_bn], parents=parents_bn,
                   depths=depth_t[keep_bn], ancestor_mask=ancestor_bnn,
                   scores=scores_bt[rows_b1, keep_bn])


def chain_tree(depth_logprobs) -> DraftTree:
  """DFlash's chain: the top-1 token of every depth, node i at depth i under node i - 1.

  Args:
    depth_logprobs: `[B, D, V]` per-depth log-probs.

  Returns:
    A `DraftTree` of D + 1 nodes per row (the root and one node per depth).

  Raises:
    InputError: `depth_logprobs` not 3-D.
  """
  logprobs_bdv = _as_logprobs(depth_logprobs)
  batch, depth, vocab = logprobs_bdv.shape
  validate_tree_args(depth, vocab, depth + 1, 1)
  best_bd1, tokens_bd1 = jax.lax.top_k(logprobs_bdv, 1)  # ties pick the lowest id, like build_tree
  n = depth + 1

  def rows(x):
    return jnp.broadcast_to(x, (batch,) + x.shape)

  zeros_b1 = jnp.zeros((batch, 1), jnp.int32)
  return DraftTree(tokens=jnp.concatenate([zeros_b1, tokens_bd1[..., 0]], axis=1),
                   parents=rows(jnp.arange(-1, depth, dtype=jnp.int32)),
                   depths=rows(jnp.arange(n, dtype=jnp.int32)),
                   ancestor_mask=rows(jnp.tril(jnp.ones((n, n), bool))),
                   scores=jnp.concatenate([zeros_b1.astype(jnp.float32),
                                           jnp.cumsum(best_bd1[..., 0], axis=1)], axis=1))


def root_tree(depth_logprobs) -> DraftTree:
  """The root alone, one node per row (drafts of any depth ignored): a round is one AR step."""
  batch = jnp.shape(depth_logprobs)[0]
  zeros_b1 = jnp.zeros((batch, 1), jnp.int32)
  return DraftTree(tokens=zeros_b1, parents=zeros_b1 - 1, depths=zeros_b1,
                   ancestor_mask=jnp.ones((batch, 1, 1), bool),
                   scores=zeros_b1.astype(jnp.float32))


def build_tree_accum(depth_logprobs, budget: int, top_k: int) -> DraftTree:
  """The reference's `accum_logp` tree: best-first expansion, each expanded node adds K children.

  The reference keeps a heap keyed by (-path log-prob, insertion counter). It pops the best
  node and, unless it sits at depth D, appends all top-`top_k` tokens of the next depth as its
  children (top-k order, lower token id first on equal log-probs), until `budget` nodes exist;
  the last expansion may be cut short. Nodes come out in insertion order, as the reference
  emits them, so parents precede children and a smaller budget's tree is a prefix of this one.

  Fixed-shape form. Node u pops before v iff u's score is higher or, on equal scores, u's
  parent popped before v's (the counter), siblings by top-k rank; the root pops first. Within
  one depth that is `build_tree`'s beam order, so the m = ceil((N - 1) / K) expanded nodes lie
  in beams of width m. Across depths it is the lexicographic order of (score, parent's score,
  grandparent's score, ..., +inf at the root), a shallower equal-score chain ending first; one
  sort over the beams of depths 0..D-1 gives the expansion order. Log-probs must be <= 0.
  """
  logprobs_bdv = _as_logprobs(depth_logprobs)
  batch, depth, vocab = logprobs_bdv.shape
  validate_tree_args(depth, vocab, budget, top_k)
  top_k = min(top_k, budget - 1)  # the root's expansion already fills the budget
  expansions = -(-(budget - 1) // top_k)

  best_bdk, best_tokens_bdk = [], []
  for d in range(depth):  # one top_k per depth: see build_tree
    best_bk, tokens_bk = jax.lax.top_k(logprobs_bdv[:, d], top_k)
    best_bdk.append(best_bk)
    best_tokens_bdk.append(tokens_bk)
  best_bdk, best_tokens_bdk = jnp.stack(best_bdk, 1), jnp.stack(best_tokens_bdk, 1)

  # Beams of the expandable depths 0..D-1, concatenated; chains hold the scores of the node and
  # its ancestors (position j: j levels up), +inf from the root's position on.
  scores = [jnp.zeros((batch, 1), jnp.float32)]
  chains = [jnp.full((batch, 1, depth), jnp.inf, jnp.float32)]
  parents = [jnp.zeros((batch, 1), jnp.int32)]
  ranks = [jnp.zeros((batch, 1), jnp.int32)]
  depths = [np.zeros(1, np.int32)]
  offset = 0
  for d in range(depth - 1):
    prev_bw = scores[-1]
    cand_bc = (prev_bw[:, :, None] + best_bdk[:, d, None, :]).reshape(batch, -1)
    beam_bw, cand_bw = jax.lax.top_k(cand_bc, min(expansions, cand_bc.shape[1]))
    parent_bw = cand_bw // top_k
    parent_chain_bwd = jnp.take_along_axis(chains[-1], parent_bw[:, :, None], axis=1)
    chains.append(jnp.concatenate([beam_bw[:, :, None], parent_chain_bwd[:, :, :-1]], axis=2))
    scores.append(beam_bw)
    parents.append(offset + parent_bw)
    ranks.append(cand_bw % top_k)
    depths.append(np.full(beam_bw.shape[1], d + 1, np.int32))
    offset += prev_bw.shape[1]
  score_be, parent_be, rank_be = (jnp.concatenate(x, axis=1) for x in (scores, parents, ranks))
  chain_bed = jnp.concatenate(chains, axis=1)
  depth_e = jnp.asarray(np.concatenate(depths))
  num_beam = depth_e.shape[0]

  # Expansion order: chains descending (lax.sort treats -0.0 and 0.0 as equal, like the heap's
  # comparison), then the concatenation index, which within a depth is the beam order.
  index_be = jnp.broadcast_to(jnp.arange(num_beam, dtype=jnp.int32), (batch, num_beam))
  keys = tuple(-chain_bed[:, :, j] for j in range(depth)) + (index_be,)
  order_be = jax.lax.sort(keys, dimension=1, num_keys=len(keys))[-1]
  expanded_bm = order_be[:, :expansions]
  rows_b1 = jnp.arange(batch)[:, None]
  pop_be = jnp.zeros((batch, num_beam), jnp.int32).at[rows_b1, expanded_bm].set(
      jnp.arange(expansions, dtype=jnp.int32))

  # Expansion j's children are nodes 1 + j K + r; its node sits under expansion pop[parent].
  node_depth_bm = depth_e[expanded_bm]
  slot_bm = 1 + pop_be[rows_b1, parent_be[rows_b1, expanded_bm]] * top_k + rank_be[
      rows_b1, expanded_bm]
  slot_bm = jnp.where(node_depth_bm == 0, 0, slot_bm)
  child_lp_bmk = best_bdk[rows_b1, node_depth_bm]
  child_tokens_bmk = best_tokens_bdk[rows_b1, node_depth_bm]
  child_scores_bmk = score_be[rows_b1, expanded_bm][:, :, None] + child_lp_bmk

  def nodes(root, children_bmk):
    flat = children_bmk.reshape(batch, -1)[:, :budget - 1]
    return jnp.concatenate([jnp.full((batch, 1), root, flat.dtype), flat], axis=1)

  parents_bn = nodes(-1, jnp.broadcast_to(slot_bm[:, :, None], child_lp_bmk.shape))
  return DraftTree(
      tokens=nodes(0, child_tokens_bmk), parents=parents_bn,
      depths=nodes(0, jnp.broadcast_to(node_depth_bm[:, :, None] + 1, child_lp_bmk.shape)),
      ancestor_mask=_ancestor_mask(parents_bn, min(depth, budget - 1)),
      scores=nodes(0.0, child_scores_bmk))
