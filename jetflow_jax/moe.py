"""The Qwen3-MoE feed-forward block: a softmax router picks each row's top-k experts, and
SwiGLU experts run as grouped matmuls, one device's or expert-parallel over a decode mesh.

Param names follow the HF checkpoint's (`mlp.gate` the router, `mlp.experts.*` the experts
stacked `[E, ...]`), as in `model.py`, which uses this block for its MoE layers.
"""

from __future__ import annotations

from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jetflow_jax import mesh as decode_mesh, partitioning
from jetflow_jax.config import Qwen3Config

ExpertsImpl = Literal["ragged", "blocked"]


class MoE(nn.Module):
  """Softmax router, top-k experts, SwiGLU experts evaluated with grouped matmuls.

  `experts` picks how the grouped matmuls run (both exact):
  - `ragged`: the pairs of all rows sorted by expert, one `lax.ragged_dot` per
    projection (a native grouped matmul on GPU and TPU; XLA on CPU expands it
    densely over every expert);
  - `blocked`: each row routes its own pairs (rows sharded over devices stay local)
    into fixed-size blocks of one expert each, and a loop over the blocks runs plain
    batched matmuls. Memory is the pairs themselves on every backend.
  With a decode `mesh` (axes data, tp, ep), the experts run blocked on each shard:
  every device computes its own experts (and MLP columns) for the pairs routed to them
  and the partial sums meet in one all-reduce, so no expert's weights ever move.
  """

  config: Qwen3Config
  dtype: Any = jnp.float32
  experts: ExpertsImpl = "ragged"
  mesh: Mesh | None = None

  @nn.compact
  def __call__(self, x_btd):
    c = self.config
    num_experts, top_k = c.num_experts, c.num_experts_per_tok
    d, f = c.hidden_size, c.moe_intermediate_size
    experts = _Experts(num_experts, d, f, self.dtype, name="experts")
    router_logits = nn.Dense(num_experts, use_bias=False, dtype=self.dtype, name="gate")(x_btd)
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights_btk, experts_btk = jax.lax.top_k(probs, top_k)
    if c.norm_topk_prob:
      weights_btk = weights_btk / weights_btk.sum(axis=-1, keepdims=True)
    weights_btk = weights_btk.astype(self.dtype)
    if self.mesh is not None:
      return _expert_parallel(self.mesh, experts.weights(), x_btd, experts_btk, weights_btk)
    if self.experts == "blocked":
      return _blocked_experts(experts.weights(), x_btd, experts_btk, weights_btk, num_experts)
    if self.experts != "ragged":
      raise ValueError(f"unknown experts implementation {self.experts!r}: ragged | blocked")

    x_md = x_btd.reshape(-1, d)
    experts_p, weights_p = experts_btk.reshape(-1), weights_btk.reshape(-1)
    # Sort the (token, expert) pairs by expert so each expert sees one contiguous group.
    order = jnp.argsort(experts_p, stable=True)
    token_of_pair = order // top_k
    group_sizes = jnp.bincount(experts_p, length=num_experts).astype(jnp.int32)
    y_pair_d = experts(x_md[token_of_pair], group_sizes) * weights_p[order][:, None]
    y_md = jnp.zeros_like(x_md).at[token_of_pair].add(y_pair_d.astype(x_md.dtype))
    return y_md.reshape(x_btd.shape)


EXPERT_BLOCK = 64  # pairs per block: padding costs at most EXPERT_BLOCK - 1 rows per expert


def expert_blocks(experts_p: jax.Array, num_experts: int, block: int = EXPERT_BLOCK):
  """(padded row of each pair `[P]`, expert of each block `[NB]`) for one row's pairs.

  Pairs are laid out by expert, each expert's run padded to whole blocks, so every
  block belongs to one expert. NB is the most blocks any routing can need.
  """
  num_pairs = experts_p.shape[0]
  num_blocks = (num_pairs + num_experts * (block - 1)) // block
  sizes_e = jnp.bincount(experts_p, length=num_experts)
  blocks_e = -(-sizes_e // block)
  block_ends_e = jnp.cumsum(blocks_e)
  order_p = jnp.argsort(experts_p, stable=True)
  sorted_experts_p = experts_p[order_p]
  rank_in_group_p = jnp.arange(num_pairs) - (jnp.cumsum(sizes_e) - sizes_e)[sorted_experts_p]
  sorted_rows_p = (block_ends_e - blocks_e)[sorted_experts_p] * block + rank_in_group_p
  rows_p = jnp.zeros_like(sorted_rows_p).at[order_p].set(sorted_rows_p)
  # Blocks past the last expert's run hold only zero rows; any expert will do for them.
  block_experts = jnp.searchsorted(block_ends_e, jnp.arange(num_blocks), side="right")
  return rows_p, jnp.minimum(block_experts, num_experts - 1)


def _blocked_experts(weights, x_btd, experts_btk, weights_btk, num_experts: int,
                     skipped_expert: int | None = None):
  """Expert outputs summed per token; `weights` is (gate [E, D, F], up [E, D, F], down [E, F, D]).

  A loop over blocks gathers each block's token rows, runs its expert and adds the weighted
  outputs back into the tokens, so nothing wider than one block of every row is ever held
  (no `[B, NB * C, D]` buffers). Pairs routed to `skipped_expert` (an id past the weights:
  another shard's experts) get blocks of their own that are never computed.
  """
  batch, length, _ = x_btd.shape
  top_k = experts_btk.shape[-1]
  num_pairs = length * top_k
  rows_bp, block_experts_bn = jax.vmap(
      lambda e: expert_blocks(e.reshape(-1), num_experts, EXPERT_BLOCK))(experts_btk)
  num_blocks = block_experts_bn.shape[1]
  # Which pair sits in each padded slot; `num_pairs` marks padding (token 0, weight 0).
  pair_of_slot_bs = jax.vmap(
      lambda rows: jnp.full((num_blocks * EXPERT_BLOCK,), num_pairs, jnp.int32)
      .at[rows].set(jnp.arange(num_pairs, dtype=jnp.int32)))(rows_bp)
  token_of_pair = jnp.append(jnp.arange(num_pairs, dtype=jnp.int32) // top_k, 0)
  weight_of_pair_bp = jnp.concatenate(
      [weights_btk.reshape(batch, -1), jnp.zeros((batch, 1), weights_btk.dtype)], axis=1)
  batch_rows = jnp.arange(batch)[:, None]

  def add_block(n, out_btd):
    pairs_bc = jax.lax.dynamic_slice_in_dim(pair_of_slot_bs, n * EXPERT_BLOCK, EXPERT_BLOCK,
                                            axis=1)
    tokens_bc = token_of_pair[pairs_bc]
    experts_b = block_experts_bn[:, n]
    run = lambda: _expert_mlp(weights, x_btd[batch_rows, tokens_bc], experts_b)
    if skipped_expert is None:
      y_bcd = run()
    else:  # a block runs when any row's block belongs to this shard
      y_bcd = jax.lax.cond(jnp.all(experts_b == skipped_expert),
                           lambda: jnp.zeros(tokens_bc.shape + x_btd.shape[-1:], x_btd.dtype),
                           run)
    weighted_bcd = y_bcd * jnp.take_along_axis(weight_of_pair_bp, pairs_bc, axis=1)[..., None]
    return out_btd.at[batch_rows, tokens_bc].add(weighted_bcd.astype(out_btd.dtype))

  # Zeros made from x, not a broadcast: XLA hoists a constant broadcast out of every enclosing
  # loop (prefill chunks, decode rounds), one per layer, all live at once.
  return jax.lax.fori_loop(0, num_blocks, add_block, x_btd * 0)


def _expert_mlp(weights, x_bcd, experts_b):
  """SwiGLU of C rows per batch row through that row's expert (ids past the weights clamp:
  their rows carry weight zero)."""
  gate_bdf, up_bdf, down_bfd = (w[jnp.minimum(experts_b, w.shape[0] - 1)].astype(x_bcd.dtype)
                                for w in weights)
  hidden_bcf = (nn.silu(jnp.einsum("bcd,bdf->bcf", x_bcd, gate_bdf))
                * jnp.einsum("bcd,bdf->bcf", x_bcd, up_bdf))
  return jnp.einsum("bcf,bfd->bcd", hidden_bcf, down_bfd)


def _expert_parallel(mesh: Mesh, weights, x_btd, experts_btk, weights_btk):
  """The MoE block with experts split over `ep` and their MLP width over `tp` (see `MoE`)."""
  num_experts = weights[0].shape[0]
  local_experts = num_experts // mesh.shape["ep"]
  # Each shard holds its experts' weights where the decode mesh placed them; rows split over
  # data-parallel copies, and a batch they cannot split (an engine's one-request prefill) runs
  # whole on every copy.
  weight_specs = tuple(
      partitioning.spec(partitioning.param_axes(("experts", name), w.ndim), decode_mesh.RULES,
                        mesh, w.shape)
      for name, w in zip(("gate_proj", "up_proj", "down_proj"), weights))
  rows = partitioning.spec(partitioning.ROWS_AXES, decode_mesh.RULES, mesh, x_btd.shape[:1])

  def local(gate_edf, up_edf, down_efd, x_btd, experts_btk, weights_btk):
    local_btk = experts_btk - jax.lax.axis_index("ep") * local_experts
    owned_btk = (local_btk >= 0) & (local_btk < local_experts)
    # Pairs of other shards' experts: a sentinel expert whose blocks are skipped, weight zero.
    local_btk = jnp.where(owned_btk, local_btk, local_experts)
    weights_btk = jnp.where(owned_btk, weights_btk, 0).astype(weights_btk.dtype)
    y_btd = _blocked_experts((gate_edf, up_edf, down_efd), x_btd, local_btk, weights_btk,
                             local_experts + 1, skipped_expert=local_experts)
    return jax.lax.psum(y_btd, ("ep", "tp"))

  return jax.shard_map(local, mesh=mesh, in_specs=(*weight_specs, rows, rows, rows),
                       out_specs=rows, check_vma=False)(*weights, x_btd, experts_btk,
                                                        weights_btk)


class _Experts(nn.Module):
  num_experts: int
  hidden_size: int
  intermediate_size: int
  dtype: Any

  def setup(self):
    e, d, f = self.num_experts, self.hidden_size, self.intermediate_size
    init = nn.initializers.lecun_normal(batch_axis=(0,))
    self.gate_proj = self.param("gate_proj", init, (e, d, f))
    self.up_proj = self.param("up_proj", init, (e, d, f))
    self.down_proj = self.param("down_proj", init, (e, f, d))

  def weights(self):
    return self.gate_proj, self.up_proj, self.down_proj

  def __call__(self, x_md, group_sizes_e):
    """Expert outputs `[M, D]` for rows sorted by expert, `group_sizes_e` rows each."""
    x_md = x_md.astype(self.dtype)
    grouped = lambda lhs, rhs: jax.lax.ragged_dot(lhs, rhs.astype(self.dtype), group_sizes_e)
    hidden_mf = nn.silu(grouped(x_md, self.gate_proj)) * grouped(x_md, self.up_proj)
    return grouped(hidden_mf, self.down_proj)
