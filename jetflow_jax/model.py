"""Functional Flax (Linen) port of Qwen3 and Qwen3-MoE.

Modules hold no state: they are applied to an explicit params pytree with
`Qwen3(config).apply({"params": params}, ...)`, and the KV cache is an explicit
pytree passed in and returned. Param names follow the HF checkpoint names so the
mapping in `hf_params.py` stays a table. The MoE layers' feed-forward block is `moe.py`.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jetflow_jax.attention import AttentionImpl, apply_rope, attention, cached_attention
from jetflow_jax.config import Qwen3Config
from jetflow_jax.kernels import tree_attention
from jetflow_jax.kernels.tree_attention import causal_attention
from jetflow_jax.moe import ExpertsImpl, MoE
from jetflow_jax.partitioning import KernelLayout, Layout, kernel_layout

Dtype = Any


@flax.struct.dataclass
class KVCache:
  """Preallocated per-layer key/value buffers, each `[B, S, K, H]`. A pytree.

  Slots are plain storage: which slots a query may read is decided by the mask
  passed to each forward, and where new keys land by `cache_index`.

  Attributes:
    k: one key buffer `[B, S, K, H]` per layer.
    v: one value buffer `[B, S, K, H]` per layer.
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]

  @property
  def size(self) -> int:
    """S, the number of slots."""
    return self.k[0].shape[1]

  @classmethod
  def from_rows(cls, rows: "KVCache", size: int,
                sharding: jax.sharding.Sharding | None = None) -> "KVCache":
    """A cache of `size` slots whose first slots are `rows` (a prefill's own K/V), written in
    one pass (zeroing a buffer, then updating a slice of it, costs two or three); inside jit,
    `sharding` pins where each buffer lives."""
    pad = lambda x: jnp.pad(x, ((0, 0), (0, size - x.shape[1]), (0, 0), (0, 0)))
    k, v = tuple(map(pad, rows.k)), tuple(map(pad, rows.v))
    if sharding is not None:
      k, v = jax.lax.with_sharding_constraint((k, v), sharding)
    return cls(k=k, v=v)

  @classmethod
  def zeros(cls, config: Qwen3Config, batch: int, size: int, dtype: Dtype) -> "KVCache":
    """A zeroed cache of `size` slots for every layer of `config`."""
    shape = (batch, size, config.num_key_value_heads, config.head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_hidden_layers))
    return cls(k=zeros, v=zeros)


def write_rows(buffer_bskh: jax.Array, new_btkh: jax.Array, start_b: jax.Array) -> jax.Array:
  """Writes `new` into `buffer` at slots start[b] .. start[b] + T - 1 of each row."""
  write = lambda buf, new, start: jax.lax.dynamic_update_slice_in_dim(buf, new, start, axis=0)
  return jax.vmap(write)(buffer_bskh, new_btkh.astype(buffer_bskh.dtype), start_b)


# How the decoder layers' projections (and a head's `fc`) store their kernels (`KernelLayout`):
# "in_out": Flax's `[*inputs, *outputs]` (q_proj `[D, N, H]`, o_proj `[N, H, D]`): what
#   checkpoints load as, what training and the meshes split.
# "out_in": one matrix `[outputs, inputs]` each (q_proj `[N*H, D]`, o_proj `[D, N*H]`), HF's
#   order. The math is the same; XLA's CPU matrix-vector and few-row products read a weight at
#   the bandwidth floor only along its minor axis (20-22 GB/s against 12-17 GB/s in_out on this
#   project's CPU: docs/benchmarks/round_costs.md), so decoding on CPU converts to it
#   (`decode_kernel_layout`). One matrix, not `[N, H, D]`: XLA copies 3-axis kernels into the
#   layout its dot wants on every step.
_INPUT_AXES = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_proj": 1,
               "up_proj": 1, "down_proj": 1, "fc": 1}  # projection -> its in_out input axes


class OutInDense(nn.Module):
  """A bias-free projection from x's last `in_axes` axes to `features`, its kernel one
  `[prod(features), prod(inputs)]` matrix (the "out_in" layout)."""

  features: tuple[int, ...]
  in_axes: int = 1
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    lead, inputs = x.shape[:x.ndim - self.in_axes], x.shape[x.ndim - self.in_axes:]
    kernel = self.param("kernel", nn.initializers.lecun_normal(in_axis=-1, out_axis=-2),
                        (math.prod(self.features), math.prod(inputs)))
    y = jnp.einsum("...i,oi->...o", x.reshape(*lead, -1).astype(self.dtype),
                   kernel.astype(self.dtype))
    return y.reshape(*lead, *self.features)


def projection(layout: KernelLayout, dtype: Dtype, features: int | tuple[int, ...],
               in_axes: int = 1) -> nn.Module:
  """A bias-free projection module whose kernel is stored in `layout` (Flax's own for in_out)."""
  if layout == "out_in":
    return OutInDense((features,) if isinstance(features, int) else tuple(features), in_axes,
                      dtype)
  if in_axes == 1 and isinstance(features, int):
    return nn.Dense(features, use_bias=False, dtype=dtype)
  return nn.DenseGeneral(features, axis=tuple(range(-in_axes, 0)), use_bias=False, dtype=dtype)


def decode_kernel_layout(backend: str | None = None) -> KernelLayout:
  """The layout decoding runs fastest from on `backend` (default: JAX's): out_in on CPU (see
  `KernelLayout`); in_out elsewhere, where the matmul libraries read either at full speed and
  meshes split in_out."""
  return "out_in" if (backend or jax.default_backend()) == "cpu" else "in_out"


def with_kernel_layout(params, layout: KernelLayout):
  """`params` (a target's or a head's) with every projection kernel stored in `layout`; every
  other leaf (embedding, LM heads, norms, MoE experts and router) as it is. Consumes `params`
  when it converts: each kernel is donated to its own jitted copy, so at most one is ever held
  twice (use the returned tree)."""
  if kernel_layout(params) == layout:
    return params

  def convert(tree):
    out = {}
    for name, value in tree.items():
      if name in _INPUT_AXES and isinstance(value, dict) and "kernel" in value:
        head_dim = tree["q_norm"]["scale"].shape[0] if "q_norm" in tree else 0
        value = {**value, "kernel": _relayout(value["kernel"], layout, _INPUT_AXES[name],
                                              head_dim)}
      elif isinstance(value, dict):
        value = convert(value)
      out[name] = value
    return out
  return convert(params)


@functools.partial(jax.jit, static_argnums=(1, 2, 3), donate_argnums=0)
def _relayout(kernel, layout: KernelLayout, in_axes: int, head_dim: int):
  if layout == "out_in":  # [*inputs, *outputs] -> [outputs, inputs]
    inputs = math.prod(kernel.shape[:in_axes])
    return kernel.reshape(inputs, -1).T
  # [outputs, inputs] -> [*inputs, *outputs]: attention's head axes split as q_norm's size says
  in_out = kernel.T
  if in_axes == 2:  # o_proj [D, N*H] -> [N, H, D]
    return in_out.reshape(-1, head_dim, in_out.shape[1])
  if head_dim:  # q/k/v_proj [N*H, D] -> [D, N, H]
    return in_out.reshape(in_out.shape[0], -1, head_dim)
  return in_out


class Attention(nn.Module):
  """Qwen3 attention: q/k RMSNorm over head_dim, RoPE, grouped KV heads."""

  config: Qwen3Config
  dtype: Dtype = jnp.float32
  impl: AttentionImpl = "xla"
  layout: KernelLayout = "in_out"

  def setup(self):
    c = self.config
    dense = functools.partial(projection, self.layout, self.dtype)
    self.q_proj = dense((c.num_attention_heads, c.head_dim))
    self.k_proj = dense((c.num_key_value_heads, c.head_dim))
    self.v_proj = dense((c.num_key_value_heads, c.head_dim))
    self.o_proj = dense(c.hidden_size, in_axes=2)
    self.q_norm = nn.RMSNorm(epsilon=c.rms_norm_eps, dtype=self.dtype)
    self.k_norm = nn.RMSNorm(epsilon=c.rms_norm_eps, dtype=self.dtype)

  def keys_values(self, x_btd, positions_bt):
    k_btkh = apply_rope(self.k_norm(self.k_proj(x_btd)), positions_bt, self.config.rope_theta)
    return k_btkh, self.v_proj(x_btd)

  def __call__(self, x_btd, positions_bt, kv, cache_index_b, mask_bts, tree_mask_btt=None):
    """Attends the T new rows to the cache after writing their keys at `cache_index_b`.

    `kv` is this layer's `(k_bskh, v_bskh)` buffers, or None to attend to the new rows only.
    `mask_bts` None (with `kv`) means causal over slots, computed only up to the rows' slots
    (with a kernel impl, by the tree kernel: the slots before the rows, then the rows causally).
    With `tree_mask_btt`, the cache is read-only: the rows read its first `cache_index_b`
    slots plus each other under that mask, and their own (k, v) are returned unwritten.
    """
    q_btnh = apply_rope(self.q_norm(self.q_proj(x_btd)), positions_bt, self.config.rope_theta)
    k_btkh, v_btkh = self.keys_values(x_btd, positions_bt)
    interpret = jax.default_backend() == "cpu"  # Pallas has no CPU backend; there it interprets
    if tree_mask_btt is not None:
      out_btnh = tree_attention(q_btnh, kv[0], kv[1], cache_index_b, k_btkh.astype(self.dtype),
                                v_btkh.astype(self.dtype), tree_mask_btt, impl=self.impl,
                                interpret=interpret)
      return self.o_proj(out_btnh), (k_btkh, v_btkh)
    k_bskh, v_bskh = k_btkh, v_btkh  # without a cache, the rows' own K/V at slots 0..T-1
    if kv is not None:
      k_bskh = write_rows(kv[0], k_btkh, cache_index_b)
      v_bskh = write_rows(kv[1], v_btkh, cache_index_b)
    if mask_bts is not None:
      out_btnh = attention(q_btnh, k_bskh.astype(self.dtype), v_bskh.astype(self.dtype),
                           mask_bts, impl=self.impl)
    elif self.impl == "xla":  # causal over slots, in blocks only as far as the rows reach
      slots_bt = cache_index_b[:, None] + jnp.arange(x_btd.shape[1], dtype=jnp.int32)
      out_btnh = cached_attention(q_btnh, k_bskh.astype(self.dtype), v_bskh.astype(self.dtype),
                                  slots_bt)
    else:  # the same through the tree kernel: the slots before the rows, then the rows, causally
      start_b = cache_index_b if kv is not None else jnp.zeros_like(cache_index_b)
      out_btnh = causal_attention(q_btnh, k_bskh, v_bskh, start_b, k_btkh.astype(k_bskh.dtype),
                                  v_btkh.astype(v_bskh.dtype), impl=self.impl,
                                  interpret=interpret)
    return self.o_proj(out_btnh), (k_bskh, v_bskh)


class MLP(nn.Module):
  """SwiGLU feed-forward."""

  hidden_size: int
  intermediate_size: int
  dtype: Dtype = jnp.float32
  layout: KernelLayout = "in_out"

  def setup(self):
    self.gate_proj = projection(self.layout, self.dtype, self.intermediate_size)
    self.up_proj = projection(self.layout, self.dtype, self.intermediate_size)
    self.down_proj = projection(self.layout, self.dtype, self.hidden_size)

  def __call__(self, x_btd):
    return self.down_proj(nn.silu(self.gate_proj(x_btd)) * self.up_proj(x_btd))


class DecoderLayer(nn.Module):
  """Pre-norm attention block and pre-norm MLP (or MoE) block, each residual."""

  config: Qwen3Config
  layer: int
  dtype: Dtype = jnp.float32
  impl: AttentionImpl = "xla"
  experts: ExpertsImpl = "ragged"
  mesh: Mesh | None = None
  layout: KernelLayout = "in_out"

  def setup(self):
    c = self.config
    self.input_layernorm = nn.RMSNorm(epsilon=c.rms_norm_eps, dtype=self.dtype)
    self.self_attn = Attention(c, dtype=self.dtype, impl=self.impl, layout=self.layout)
    self.post_attention_layernorm = nn.RMSNorm(epsilon=c.rms_norm_eps, dtype=self.dtype)
    if c.is_moe_layer(self.layer):  # experts stay [E, in, out] in either layout
      self.mlp = MoE(c, dtype=self.dtype, experts=self.experts, mesh=self.mesh)
    else:
      self.mlp = MLP(c.hidden_size, c.intermediate_size, dtype=self.dtype, layout=self.layout)

  def __call__(self, x_btd, positions_bt, kv, cache_index_b, mask_bts, tree_mask_btt=None):
    with jax.named_scope("attention_block"):
      attn_btd, kv = self.self_attn(self.input_layernorm(x_btd), positions_bt, kv, cache_index_b,
                                    mask_bts, tree_mask_btt)
      x_btd = x_btd + attn_btd
    with jax.named_scope("mlp_block"):
      x_btd = x_btd + self.mlp(self.post_attention_layernorm(x_btd))
    return x_btd, kv


_float32_out = functools.partial(jax.lax.dot_general, preferred_element_type=jnp.float32)


class Qwen3(nn.Module):
  """Embedding, decoder stack, final norm; `logits` applies the (tied or untied) LM head."""

  config: Qwen3Config
  dtype: Dtype = jnp.float32
  impl: AttentionImpl = "xla"
  experts: ExpertsImpl = "ragged"
  mesh: Mesh | None = None  # a decode mesh: MoE layers run their experts per shard
  layout: KernelLayout = "in_out"

  def setup(self):
    c = self.config
    self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype)
    self.layers = [DecoderLayer(c, i, dtype=self.dtype, impl=self.impl, experts=self.experts,
                                mesh=self.mesh, layout=self.layout)
                   for i in range(c.num_hidden_layers)]
    self.norm = nn.RMSNorm(epsilon=c.rms_norm_eps, dtype=self.dtype)
    if not c.tie_word_embeddings:
      self.lm_head = nn.Dense(c.vocab_size, use_bias=False, dtype=self.dtype,
                              dot_general=_float32_out)

  def __call__(self, tokens_bt, positions_bt, cache: KVCache | None, cache_index_b, mask_bts,
               tap_layers: Sequence[int] = (), tree_mask_btt=None):
    """Returns (final normed hidden `[B, T, D]`, updated cache, taps `[B, T, len(taps), D]`).

    Without a cache, the returned `KVCache` holds the T rows' own keys and values.
    Tap i is the raw output of decoder layer `tap_layers[i]` (HF `hidden_states[i + 1]`).
    With `tree_mask_btt` the cache is only read, and the returned cache holds the T new
    rows' keys and values (`[B, T, K, H]` per layer) instead.
    """
    x_btd = self.embed_tokens(tokens_bt)
    new_k, new_v, taps = [], [], {}
    for i, layer in enumerate(self.layers):
      kv = None if cache is None else (cache.k[i], cache.v[i])
      x_btd, (k, v) = layer(x_btd, positions_bt, kv, cache_index_b, mask_bts, tree_mask_btt)
      new_k.append(k)
      new_v.append(v)
      if i in tap_layers:
        taps[i] = x_btd
    new_cache = KVCache(k=tuple(new_k), v=tuple(new_v))
    taps_btld = jnp.stack([taps[i] for i in tap_layers], axis=2) if tap_layers else None
    return self.norm(x_btd), new_cache, taps_btld

  def embed(self, tokens_bt):
    return self.embed_tokens(tokens_bt)

  def logits(self, hidden_btd):
    """float32 logits from final-normed hidden states: one matmul in the params' dtype that
    accumulates into float32 and returns it (bf16 logits would be rounded to ~3 digits, and
    casting them is one more pass over `[..., vocab]`)."""
    if self.config.tie_word_embeddings:
      return jnp.einsum("...d,vd->...v", hidden_btd.astype(self.dtype),
                        self.embed_tokens.embedding.astype(self.dtype),
                        preferred_element_type=jnp.float32)
    return self.lm_head(hidden_btd)


@functools.partial(jax.jit, static_argnames=("config", "dtype"))
def init_params(config: Qwen3Config, rng: jax.Array, dtype: Dtype = jnp.float32):
  """Random params of the right structure (for tests and abstract shapes)."""
  model = Qwen3(config, dtype=dtype)
  tokens = jnp.zeros((1, 1), jnp.int32)
  zero = jnp.zeros((1,), jnp.int32)

  params = model.init(rng, tokens, zero[:, None], None, zero, jnp.ones((1, 1, 1), bool))["params"]
  if not config.tie_word_embeddings:  # `init` does not trace `logits`; add the untied head
    head = model.init(rng, jnp.zeros((1, 1, config.hidden_size), dtype), method=Qwen3.logits)
    params = {**params, "lm_head": head["params"]["lm_head"]}
  return jax.tree.map(lambda p: p.astype(dtype), params)


def params_dtype(params) -> Dtype:
  """The dtype a target's params were loaded in; computation runs in it."""
  return params["embed_tokens"]["embedding"].dtype


def abstract_params(config: Qwen3Config, dtype: Dtype = jnp.float32,
                    layout: KernelLayout = "in_out"):
  """Shapes and dtypes of the params pytree (kernels stored in `layout`), without allocating it."""
  return jax.eval_shape(lambda: with_kernel_layout(init_params(config, jax.random.key(0), dtype),
                                                   layout))


def forward(params, config: Qwen3Config, tokens_bt, *, positions_bt=None,
            cache: KVCache | None = None, cache_index_b=None, mask_bts=None,
            tap_layers: Sequence[int] = (), dtype: Dtype | None = None,
            impl: AttentionImpl = "xla", tree_mask_btt=None, experts: ExpertsImpl = "ragged",
            mesh: Mesh | None = None):
  """One target forward. Returns (hidden `[B, T, D]`, cache, taps).

  Without a cache, the T rows attend to each other causally (or by `mask_bts`,
  `[B, T, T]`) and the returned `KVCache` holds their keys and values (a prefill
  turns it into a cache with `KVCache.from_rows`). With a cache, their keys are written at slots
  `cache_index_b[b] + t` and `mask_bts` is `[B, T, S]`, by default causal over
  slots (then only the slots up to the rows' own are read: the cost follows the
  sequence, not the buffer). RoPE positions default to the slot indices.

  With `tree_mask_btt` (`[B, T, T]`, tree verification and draft blocks), the
  cache is read-only: the rows see its first `cache_index_b[b]` slots and each
  other where the mask is True, and the returned `KVCache` holds their own keys
  and values (`[B, T, K, H]`), for the caller to commit the rows it keeps.

  `experts` picks the MoE layers' grouped matmuls (see `moe.MoE`); with a decode `mesh`
  (axes data, tp, ep; params placed by `jetflow_jax.mesh.DecodeMesh`) MoE layers run
  expert-parallel instead.

  Args:
    params: the target's params.
    config: its config.
    tokens_bt: `[B, T]` token ids.
    positions_bt: `[B, T]` RoPE positions; by default the rows' slots.
    cache: a `KVCache` to write into (and read), or None.
    cache_index_b: `[B]` the slot of each row's first token; by default 0.
    mask_bts: `[B, T, S]` (or `[B, T, T]` without a cache) which keys each row reads; by
      default causal over slots.
    tap_layers: decoder layers whose raw outputs to return.
    dtype: the compute dtype; by default the params'.
    impl: the attention path (`xla`, `pallas`, `pallas_tpu`).
    tree_mask_btt: `[B, T, T]` for tree verification and draft blocks: the cache is only read.
    experts: the MoE layers' grouped matmuls (`ragged`, `blocked`).
    mesh: a decode mesh, for expert-parallel MoE layers.

  Returns:
    `(hidden_btd, cache, taps)`: the final-normed hidden states `[B, T, D]`, the cache (or the
    rows' own K/V), and the taps `[B, T, len(tap_layers), D]` (None without taps).

  Raises:
    ValueError: `tree_mask_btt` without a cache.
  """
  batch, length = tokens_bt.shape
  if cache_index_b is None:
    cache_index_b = jnp.zeros((batch,), jnp.int32)
  slots_bt = cache_index_b[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]
  if positions_bt is None:
    positions_bt = slots_bt
  if tree_mask_btt is not None and cache is None:
    raise ValueError("tree_mask_btt needs the cache it reads")
  if tree_mask_btt is not None:
    mask_bts = None  # the cache prefix and the tree mask say it all
  # No mask: attention is causal over slots (the rows' own, without a cache), in blocks only as
  # far as the rows reach.
  dtype = dtype or params_dtype(params)
  model = Qwen3(config, dtype=dtype, impl=impl, experts=experts, mesh=mesh,
                layout=kernel_layout(params))
  return model.apply({"params": params}, tokens_bt, positions_bt, cache, cache_index_b, mask_bts,
                     tuple(tap_layers), tree_mask_btt)


def _layer_runs(config: Qwen3Config, tap_layers: Sequence[int]) -> list[range]:
  """The decoder stack as runs of consecutive layers of one kind (dense or MoE), each run ending
  at a tap or before a layer of the other kind."""
  runs, start = [], 0
  for i in range(config.num_hidden_layers):
    last = (i + 1 == config.num_hidden_layers or i in tap_layers
            or config.is_moe_layer(i + 1) != config.is_moe_layer(i))
    if last:
      runs.append(range(start, i + 1))
      start = i + 1
  return runs


def forward_by_layer(params, config: Qwen3Config, tokens_bt, *, positions_bt=None, mask_bts=None,
                     tap_layers: Sequence[int] = (), experts: ExpertsImpl = "ragged",
                     layout: Layout = Layout()):
  """`forward` without a cache, as a loop over its layers: (final normed hidden `[B, T, D]`, taps).

  For a frozen target split over a mesh (the train step's `layout`): the loop body picks its
  layer's weights by the loop index, so they are gathered (and, on CPU, upcast) inside the
  body, one layer's at a time; an unrolled stack lets XLA gather and convert every layer's
  weights at the start of the program and hold them all. Activations keep their rows split
  between layers. One body per run of layers of one kind (`_layer_runs`) also compiles in a
  fraction of the unrolled stack's time.
  """
  dtype = params_dtype(params)
  batch, length = tokens_bt.shape
  if positions_bt is None:
    positions_bt = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  starts_b = jnp.zeros((batch,), jnp.int32)
  x_btd = layout.rows(embed_tokens(params, config, tokens_bt, dtype))
  taps = {}
  for run in _layer_runs(config, tap_layers):
    layer = DecoderLayer(config, run.start, dtype=dtype, experts=experts,
                         layout=kernel_layout(params))

    def step(x_btd, i, run=run, layer=layer):
      pick = [lambda i=i: params[f"layers_{i}"] for i in run]
      layer_params = jax.lax.switch(i - run.start, pick) if len(run) > 1 else pick[0]()
      x_btd, _ = layer.apply({"params": layout.params(layer_params)}, x_btd, positions_bt, None,
                             starts_b, mask_bts)
      return layout.rows(x_btd), None

    if len(run) == 1:
      x_btd, _ = step(x_btd, run.start)
    else:
      x_btd, _ = jax.lax.scan(step, x_btd, jnp.arange(run.start, run.stop, dtype=jnp.int32))
    taps[run.stop - 1] = x_btd
  hidden_btd = Qwen3(config, dtype=dtype).apply({"params": params}, x_btd,
                                                method=lambda model, x: model.norm(x))
  taps_btld = jnp.stack([taps[i] for i in tap_layers], axis=2) if tap_layers else None
  return hidden_btd, taps_btld


def embed_tokens(params, config: Qwen3Config, tokens_bt, dtype: Dtype | None = None):
  """The target's token embeddings."""
  dtype = dtype or params_dtype(params)
  return Qwen3(config, dtype=dtype).apply({"params": params}, tokens_bt, method=Qwen3.embed)


def lm_logits(params, config: Qwen3Config, hidden_btd, dtype: Dtype | None = None):
  """The target's float32 logits `[..., V]` for final-normed hidden states `[..., D]` (the LM
  head, or the embedding when tied; computed in `dtype`, default the params', accumulated in
  float32)."""
  dtype = dtype or params_dtype(params)
  return Qwen3(config, dtype=dtype).apply({"params": params}, hidden_btd, method=Qwen3.logits)


@functools.partial(jax.jit, static_argnames=("config", "tap_layers"))
def qwen3_forward(params, config: Qwen3Config, token_ids, tap_layers: Sequence[int] = ()):
  """Full-sequence causal forward: float32 logits `[batch, seq, vocab]`. Jitted.

  Args:
    params: the target's params, as `load_qwen3` returns them.
    config: the target's config (static).
    token_ids: `[batch, seq]` int token ids.
    tap_layers: decoder layers whose raw outputs to return too (static).

  Returns:
    The logits, float32 `[batch, seq, vocab]`; with `tap_layers`, `(logits, taps)` where taps is
    `[batch, seq, len(tap_layers), hidden]` (raw outputs of those decoder layers, before the
    final norm).
  """
  hidden, _, taps = forward(params, config, jnp.asarray(token_ids, jnp.int32),
                            tap_layers=tap_layers)
  logits = lm_logits(params, config, hidden)
  return (logits, taps) if tap_layers else logits
