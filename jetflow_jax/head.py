"""The causal-parallel draft head (JetFlow) and its bidirectional twin (DFlash).

Context injection: the target's tapped hidden states of each committed token are
concatenated, projected by `fc` and normed (`hidden_norm`); every head layer
turns these fused features into context keys/values with its own
`k_proj`/`k_norm`/`v_proj` and RoPE, stored in the head's own `KVCache`. The
block `[anchor, MASK x (block - 1)]`, embedded with the target's embedding,
then runs through ordinary Qwen3 decoder layers whose queries read the context
slots plus their block (causally or not), a final RMSNorm, and the target's LM
head. Output row k (k >= 1) is the distribution of the token at depth k.

A head with a draft vocabulary (`HeadConfig.draft_vocab_size` = K) predicts over K of the
target's tokens instead: its params then hold its own LM head (`lm_head`, `[D, K]`, the
target's rows for those tokens unless imported otherwise) and the target id of each draft
token (`draft_vocab/target_ids`). Both stay frozen in training (`split_frozen`).
"""

from __future__ import annotations

import functools
from typing import Callable, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from jetflow_jax.attention import AttentionImpl, apply_rope
from jetflow_jax.config import Qwen3Config
from jetflow_jax.errors import InputError
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.kernels.train_attention import TrainAttentionImpl, train_attention
from jetflow_jax.masks import in_block_mask
from jetflow_jax.model import (DecoderLayer, Dtype, KernelLayout, KVCache, embed_tokens, forward,
                               kernel_layout, lm_logits, projection, write_rows)

RematPolicy = Literal["none", "full", "dots"]
DRAFT_VOCAB = "draft_vocab"  # params key: {"target_ids": [K] int32}, draft id -> target id
FROZEN = ("lm_head", DRAFT_VOCAB)  # params a draft vocabulary adds, never trained
# "dots" keeps the outputs of the weight matmuls (projections, MLP) and recomputes the rest. The
# attention einsums carry batch axes, so they are recomputed too: saving them would keep the very
# score matrices remat is there to drop.
_REMAT_POLICIES = {"full": jax.checkpoint_policies.nothing_saveable,
                   "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


class DraftHead(nn.Module):
  config: HeadConfig
  dtype: Dtype = jnp.float32
  impl: AttentionImpl = "xla"
  layout: KernelLayout = "in_out"  # how the head's params store their kernels (`kernel_layout`)

  def setup(self):
    c = self.config
    self.fc = projection(self.layout, self.dtype, c.hidden_size)
    self.hidden_norm = nn.RMSNorm(epsilon=c.rms_norm_eps, dtype=self.dtype)
    self.layers = [DecoderLayer(c.layer_config(), i, dtype=self.dtype, impl=self.impl,
                                layout=self.layout)
                   for i in range(c.num_layers)]
    self.norm = nn.RMSNorm(epsilon=c.rms_norm_eps, dtype=self.dtype)

  def context_features(self, taps_btld):
    """Fused context features `[B, T, D]` from target taps `[B, T, n_taps, D]`."""
    batch, length = taps_btld.shape[:2]
    return self.hidden_norm(self.fc(taps_btld.reshape(batch, length, -1)))

  def context_kv(self, taps_btld, positions_bt):
    """Per-layer context (k, v) from target taps `[B, T, n_taps, D]`."""
    features_btd = self.context_features(taps_btld)
    return [layer.self_attn.keys_values(features_btd, positions_bt) for layer in self.layers]

  def __call__(self, x_btd, positions_bt, cache: KVCache, cache_index_b, mask_bts,
               block_mask_btt=None):
    """Block rows through the layers, reading `cache` (context) under `mask_bts`.

    With `block_mask_btt` the cache is only read: the rows see its first
    `cache_index_b` slots and each other under that mask (decode time).
    """
    for i, layer in enumerate(self.layers):
      x_btd, _ = layer(x_btd, positions_bt, (cache.k[i], cache.v[i]), cache_index_b, mask_bts,
                       block_mask_btt)
    return self.norm(x_btd)

  def init_everything(self, taps_btld, x_btd, positions_bt, cache, cache_index_b, mask_bts):
    self.context_kv(taps_btld, positions_bt)
    return self(x_btd, positions_bt, cache, cache_index_b, mask_bts)


@functools.partial(jax.jit, static_argnames=("config", "dtype"))
def init_head_params(config: HeadConfig, rng: jax.Array, dtype: Dtype = jnp.float32):
  """Fresh head params (float32 master weights by default). Jitted.

  Args:
    config: the head's config (static).
    rng: a `jax.random.key`.
    dtype: the params' dtype (static).

  Returns:
    The params pytree, as `load_head` returns it.
  """
  c = config
  taps = jnp.zeros((1, 1, c.num_taps, c.hidden_size), dtype)
  x = jnp.zeros((1, 1, c.hidden_size), dtype)
  zero = jnp.zeros((1,), jnp.int32)
  cache = KVCache.zeros(c.layer_config(), 1, 1, dtype)
  variables = DraftHead(c, dtype).init(rng, taps, x, zero[:, None], cache, zero,
                                       jnp.ones((1, 1, 1), bool), method=DraftHead.init_everything)
  params = jax.tree.map(lambda p: p.astype(dtype), variables["params"])
  if c.draft_vocab_size:  # placeholders of the right shapes: training sets the real ones
    kernel = jax.random.normal(jax.random.fold_in(rng, 1), (c.hidden_size, c.draft_vocab_size))
    params = {**params, "lm_head": {"kernel": (kernel / c.hidden_size**0.5).astype(dtype)},
              DRAFT_VOCAB: {"target_ids": jnp.arange(c.draft_vocab_size, dtype=jnp.int32)}}
  return params


def head_dtype(head_params) -> Dtype:
  """The dtype of the head's weights (its draft vocabulary's ids are int32)."""
  return jax.tree.leaves(head_params["fc"])[0].dtype


def split_frozen(head_params) -> tuple[dict, dict]:
  """(trainable, frozen) halves of the head's params; frozen is empty without a draft vocab."""
  trainable = {k: v for k, v in head_params.items() if k not in FROZEN}
  return trainable, {k: v for k, v in head_params.items() if k in FROZEN}


def with_draft_vocab(head_params, target_params, target_config: Qwen3Config, target_ids_k):
  """The head's params with the draft vocabulary `target_ids_k` (`[K]` target ids) and the
  target's LM-head rows for it, in the head params' dtype."""
  dtype = head_dtype(head_params)
  ids_k = jnp.asarray(target_ids_k, jnp.int32)
  kernel_dk = lm_head_columns(target_params, target_config, ids_k).astype(dtype)
  return {**head_params, "lm_head": {"kernel": kernel_dk}, DRAFT_VOCAB: {"target_ids": ids_k}}


def lm_head_columns(target_params, target_config: Qwen3Config, ids_k):
  """`[D, K]`: the target's LM head for the tokens `ids_k` only."""
  if target_config.tie_word_embeddings:
    return jnp.take(target_params["embed_tokens"]["embedding"], ids_k, axis=0).T
  return jnp.take(target_params["lm_head"]["kernel"], ids_k, axis=1)


def vocab_logits(hidden_bd, kernel_dk):
  """float32 logits of final-normed hidden states through an LM head `[D, K]` in its dtype."""
  return jnp.einsum("...d,dk->...k", hidden_bd.astype(kernel_dk.dtype), kernel_dk,
                    preferred_element_type=jnp.float32)


def head_logits(head_params, config: HeadConfig, target_params, target_config: Qwen3Config,
                hidden_bd):
  """float32 logits `[..., output_vocab_size]`: the head's draft-vocabulary LM head if it has
  one, else the target's."""
  if config.draft_vocab_size:
    return vocab_logits(hidden_bd, head_params["lm_head"]["kernel"])
  return lm_logits(target_params, target_config, hidden_bd)


def to_target_ids(head_params, config: HeadConfig, ids):
  """Target token ids of the head's output ids (themselves without a draft vocabulary)."""
  if not config.draft_vocab_size:
    return ids
  return jnp.take(head_params[DRAFT_VOCAB]["target_ids"], ids, axis=0)


def _module_params(head_params):
  """The params `DraftHead` itself reads (the draft vocabulary is read by `head_logits`)."""
  return split_frozen(head_params)[0]


def init_head_cache(config: HeadConfig, batch: int, size: int, dtype: Dtype) -> KVCache:
  return KVCache.zeros(config.layer_config(), batch, size, dtype)


def append_context(head_params, config: HeadConfig, cache: KVCache, taps_btld, start_b,
                   dtype: Dtype = jnp.float32) -> KVCache:
  """Writes context K/V for T newly committed tokens at slots (= positions) start_b + t.

  Args:
    head_params: the head's params.
    config: its config.
    cache: the head's context `KVCache`.
    taps_btld: `[B, T, taps, D]` the target's taps of the committed tokens.
    start_b: `[B]` the slot of each row's first one.
    dtype: the compute dtype.

  Returns:
    The cache with every layer's context K/V written.
  """
  positions_bt = start_b[:, None] + jnp.arange(taps_btld.shape[1], dtype=jnp.int32)[None, :]
  kvs = DraftHead(config, dtype, layout=kernel_layout(head_params)).apply(
      {"params": _module_params(head_params)}, taps_btld.astype(dtype), positions_bt,
      method=DraftHead.context_kv)
  return KVCache(k=tuple(write_rows(buf, k, start_b) for buf, (k, _) in zip(cache.k, kvs)),
                 v=tuple(write_rows(buf, v, start_b) for buf, (_, v) in zip(cache.v, kvs)))


def context_cache(head_params, config: HeadConfig, taps_btld, size: int,
                  dtype: Dtype = jnp.float32) -> KVCache:
  """A context cache of `size` slots holding the K/V of T prompt rows' taps at slots 0..T-1
  (what `append_context` writes into a zeroed cache, built in one pass).

  Returns:
    The head's context `KVCache`.
  """
  positions_bt = jnp.broadcast_to(jnp.arange(taps_btld.shape[1], dtype=jnp.int32),
                                  taps_btld.shape[:2])
  kvs = DraftHead(config, dtype, layout=kernel_layout(head_params)).apply(
      {"params": _module_params(head_params)}, taps_btld.astype(dtype), positions_bt,
      method=DraftHead.context_kv)
  return KVCache.from_rows(KVCache(k=tuple(k for k, _ in kvs), v=tuple(v for _, v in kvs)), size)


def _block_tokens(config: HeadConfig, anchors_ba):
  """[B, A, block]: each anchor followed by block - 1 MASK tokens."""
  masks = jnp.full(anchors_ba.shape + (config.depth,), config.mask_token_id, jnp.int32)
  return jnp.concatenate([anchors_ba[..., None].astype(jnp.int32), masks], axis=-1)


def draft_block(head_params, config: HeadConfig, target_params, target_config: Qwen3Config,
                cache: KVCache, context_len_b, anchor_b, dtype: Dtype = jnp.float32,
                impl: AttentionImpl = "xla"):
  """Per-depth draft logits `[B, depth, V]` for one block after `context_len_b` cached rows
  (V: `config.output_vocab_size`, draft ids when the head has a draft vocabulary).

  The cache is only read: the block attends to its context slots and to itself
  (causally or not), and its own keys never enter the cache.

  Args:
    head_params: the head's params.
    config: its config.
    target_params: the target's params (embedding and LM head).
    target_config: the target's config.
    cache: the head's context `KVCache`.
    context_len_b: `[B]` context rows each block reads (the anchor's position).
    anchor_b: `[B]` the anchor tokens.
    dtype: the compute dtype.
    impl: the attention path (`xla`, `pallas`, `pallas_tpu`).

  Returns:
    float32 logits `[B, depth, V]`.
  """
  batch, block = anchor_b.shape[0], config.block_size
  x_btd = embed_tokens(target_params, target_config, _block_tokens(config, anchor_b[:, None])[:, 0])
  positions_bt = context_len_b[:, None] + jnp.arange(block, dtype=jnp.int32)[None, :]
  block_mask_btt = jnp.broadcast_to(in_block_mask(block, config.causal), (batch, block, block))
  hidden_btd = DraftHead(config, dtype, impl, kernel_layout(head_params)).apply(
      {"params": _module_params(head_params)}, x_btd.astype(dtype), positions_bt, cache,
      context_len_b, None, block_mask_btt)
  return head_logits(head_params, config, target_params, target_config, hidden_btd[:, 1:])


@functools.partial(jax.jit, static_argnames=("head_config", "target_config"))
def draft_logits(head_params, head_config: HeadConfig, target_params,
                 target_config: Qwen3Config, token_ids):
  """Per-depth draft logits `[batch, block_size - 1, vocab]` (over the head's draft vocabulary,
  if it has one: `to_target_ids` maps its ids). Jitted.

  The last token of `token_ids` is the anchor; the target's taps of the n - 1 earlier tokens
  are the context, at positions 0..n-2, and the block sits at positions n-1 .. n-2+block.
  This is the decode-time path from scratch (one target forward for the taps, then the head);
  decoding itself keeps the head's context K/V across rounds (`drafters.HeadDrafter`).

  Args:
    head_params: the head's params.
    head_config: its config (static).
    target_params: the target's params (its embedding, taps and LM head are used).
    target_config: the target's config (static).
    token_ids: `[batch, n]` int token ids, n >= 2.

  Returns:
    float32 logits `[batch, block_size - 1, vocab]`: row k - 1 is the distribution of the token
    at depth k after the anchor.

  Raises:
    InputError: fewer than 2 tokens per row.
  """
  token_ids = jnp.asarray(token_ids, jnp.int32)
  batch, n = token_ids.shape
  if n < 2:
    raise InputError(f"draft_logits needs at least 2 tokens per row (context + anchor); got {n}")
  dtype = head_dtype(head_params)
  _, _, taps = forward(target_params, target_config, token_ids[:, :-1],
                       tap_layers=head_config.target_layer_ids)
  cache = init_head_cache(head_config, batch, n - 1, dtype)
  start = jnp.zeros((batch,), jnp.int32)
  cache = append_context(head_params, head_config, cache, taps, start, dtype)
  return draft_block(head_params, head_config, target_params, target_config, cache,
                     jnp.full((batch,), n - 1, jnp.int32), token_ids[:, -1], dtype)


def _training_layer(layer: DecoderLayer, x_btd, positions_bt, features_btd, context_positions_bt,
                    anchors_ba, context_start_ba, causal: bool, attention: TrainAttentionImpl,
                    attention_chunk: int):
  """A head layer's own modules over the packed blocks, with packed-anchor attention."""
  # The context K/V are made here from the fused features, so remat recomputes them, not keeps them.
  attn, theta = layer.self_attn, layer.config.rope_theta
  with jax.named_scope("attention_block"):
    k_ctx_bskh, v_ctx_bskh = attn.keys_values(features_btd, context_positions_bt)
    h_btd = layer.input_layernorm(x_btd)
    q_btnh = apply_rope(attn.q_norm(attn.q_proj(h_btd)), positions_bt, theta)
    k_btkh, v_btkh = attn.keys_values(h_btd, positions_bt)
    out_btnh = train_attention(q_btnh, k_ctx_bskh, v_ctx_bskh, k_btkh, v_btkh, anchors_ba, causal,
                               context_start_ba, impl=attention, chunk_anchors=attention_chunk,
                               # Pallas has no CPU backend; there it runs interpreted.
                               interpret=jax.default_backend() == "cpu")
    x_btd = x_btd + attn.o_proj(out_btnh)
  with jax.named_scope("mlp_block"):
    return x_btd + layer.mlp(layer.post_attention_layernorm(x_btd))


def training_hidden(head_params, config: HeadConfig, target_params, target_config: Qwen3Config,
                    taps_btld, tokens_bt, anchors_ba, dtype: Dtype = jnp.float32, *,
                    segment_starts_bt=None, attention: TrainAttentionImpl = "split",
                    attention_chunk: int = 0, remat: RematPolicy = "none",
                    rows: Callable = lambda x: x):
  """Final-normed draft hidden `[B, A, depth, D]` for A anchors per sequence, one packed forward.

  Context rows are all T tokens' taps; anchor a's block reads rows < a and its own block only
  (the mask of `masks.training_mask`), so each block sees what it would see at decode time.
  In rows packed with several samples, `segment_starts_bt` (`masks.segment_starts`) says where
  each token's sample begins: blocks then read their own sample's rows only, and positions
  count from the sample's start.
  `attention` picks how that mask is applied (see `kernels.train_attention`): "dense" (the
  masked reference), "split" (XLA, no cross-block scores; `attention_chunk` > 0 anchors at a
  time) or "pallas" (Triton prefix kernel).
  `remat` recomputes each head layer in the backward pass: "none", "full" (keeps only the
  layer inputs) or "dots" (also keeps the weight-matmul outputs). `rows` pins the batch axis
  of the activations between layers (`partitioning.Layout.rows` of the train step's mesh).
  """
  if remat not in ("none", *_REMAT_POLICIES):
    raise ValueError(f"unknown remat policy {remat!r}")
  batch = tokens_bt.shape[0]
  num_anchors, block = anchors_ba.shape[1], config.block_size
  anchor_tokens_ba = jnp.take_along_axis(tokens_bt, anchors_ba, axis=1)
  x_btd = rows(embed_tokens(target_params, target_config,
                            _block_tokens(config, anchor_tokens_ba).reshape(batch, -1)))
  x_btd = x_btd.astype(dtype)
  if segment_starts_bt is None:
    segment_starts_bt = jnp.zeros(tokens_bt.shape, jnp.int32)
  context_positions_bt = jnp.arange(tokens_bt.shape[1], dtype=jnp.int32) - segment_starts_bt
  context_start_ba = jnp.take_along_axis(segment_starts_bt, anchors_ba, axis=1)
  positions_bt = ((anchors_ba - context_start_ba)[:, :, None]
                  + jnp.arange(block, dtype=jnp.int32)).reshape(batch, -1)
  head = DraftHead(config, dtype)
  module_params = _module_params(head_params)
  features_btd = rows(head.apply({"params": module_params}, taps_btld.astype(dtype),
                                 method=DraftHead.context_features))

  for i in range(config.num_layers):
    layer = DecoderLayer(config.layer_config(), i, dtype=dtype)
    run = lambda layer_params, *args, layer=layer: layer.apply(
        {"params": layer_params}, *args, config.causal, attention, attention_chunk,
        method=_training_layer)
    if remat != "none":
      run = jax.checkpoint(run, policy=_REMAT_POLICIES[remat])
    # `DraftHead.setup` keeps its layers in a list, which Flax names layers_0, layers_1, ...
    x_btd = rows(run(head_params[f"layers_{i}"], x_btd, positions_bt, features_btd,
                     context_positions_bt, anchors_ba, context_start_ba))
  hidden_btd = head.apply({"params": module_params}, x_btd, method=lambda h, x: h.norm(x))
  return hidden_btd.reshape(batch, num_anchors, block, -1)[:, :, 1:]


def training_logits(head_params, config: HeadConfig, target_params, target_config: Qwen3Config,
                    taps_btld, tokens_bt, anchors_ba, dtype: Dtype = jnp.float32, **options):
  """Draft logits `[B, A, depth, V]`: `training_hidden` (and its options) through the LM head."""
  hidden_bakd = training_hidden(head_params, config, target_params, target_config, taps_btld,
                                tokens_bt, anchors_ba, dtype, **options)
  return head_logits(head_params, config, target_params, target_config, hidden_bakd)
