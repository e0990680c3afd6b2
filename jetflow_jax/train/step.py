"""The jitted train step: frozen target pass, many anchors per sequence, chunked LM-head loss."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax

from jetflow_jax.config import Qwen3Config
from jetflow_jax.head import (DRAFT_VOCAB, lm_head_columns, split_frozen, training_hidden,
                              vocab_logits)
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.masks import packed_causal_mask, segment_starts
from jetflow_jax.model import forward_by_layer, lm_logits
from jetflow_jax.partitioning import Layout
from jetflow_jax.train.losses import depth_sums, depth_weights, mean_of_sums


@flax.struct.dataclass
class TrainState:
  """What a train step carries: a pytree, donated to the jitted step.

  Attributes:
    step: int32 scalar, the number of steps taken (the data position, and the key of the
      step's randomness).
    head_params: the head's params (float32 master weights).
    opt_state: the optimizer's state.
  """

  step: jax.Array
  head_params: Any
  opt_state: Any


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """How the distillation loss is computed (`train.loop.loss_config` reads it from a config's
  `train` fields).

  Attributes:
    kind: `forward_kl`, `reverse_kl` or `cross_entropy`.
    temperature: the KL temperature (losses scaled by T^2).
    depth_gamma: > 0 weighs depth k by exp(-(k-1)/gamma); <= 0: every depth the same.
    num_anchors: anchors drawn per sequence.
    chunk_anchors: anchors whose vocabulary-wide logits exist at once; 0: all.
    head_dtype: the head's compute dtype.
    head_attention: `split`, `dense` or `pallas`: how the head applies the training mask.
    attention_chunk_anchors: with `split`, anchors whose attention scores exist at once; 0: all.
    remat: `none`, `full` or `dots`: recompute the head's layers in the backward pass.
    target_experts: an MoE target's grouped matmuls in the frozen pass (`blocked`, `ragged`).
  """

  kind: str = "forward_kl"
  temperature: float = 1.0
  depth_gamma: float = 0.0  # <= 0: every depth weighs the same
  num_anchors: int = 256
  chunk_anchors: int = 32  # anchors per LM-head and loss chunk; 0: all at once
  head_dtype: Any = jnp.float32
  head_attention: str = "split"  # see head.training_hidden
  attention_chunk_anchors: int = 64  # anchors whose head attention scores exist at once; 0: all
  remat: str = "none"
  target_experts: str = "blocked"  # the MoE target's grouped matmuls: see moe.MoE


class TargetPass(NamedTuple):
  """The frozen target's outputs the loss reads, and the row layout they were computed under."""
  hidden_btd: jax.Array  # final normed hidden states
  taps_btld: jax.Array  # the head's tapped layers
  segment_starts_bt: jax.Array  # where each token's sample starts in its row (0 unless packed)


def sample_anchors(rng, loss_mask_bt, num_anchors: int, segment_starts_bt=None):
  """Up to `num_anchors` distinct anchor positions per row, uniformly among response tokens.

  An anchor is a response token, not its sample's first, followed by another response
  token of its sample (so depth 1 has a label and anchors never straddle packed samples).
  Returns (anchors `[B, A]`, valid `[B, A]`); rows with fewer candidate positions than A
  fill the rest with invalid anchors at position 0.
  """
  index_bt = jnp.broadcast_to(jnp.arange(loss_mask_bt.shape[1]), loss_mask_bt.shape)
  if segment_starts_bt is None:
    segment_starts_bt = jnp.zeros_like(index_bt)
  next_in_sample_bt = jnp.pad(segment_starts_bt[:, 1:] == segment_starts_bt[:, :-1],
                              ((0, 0), (0, 1)))
  followed_bt = jnp.pad(loss_mask_bt[:, 1:], ((0, 0), (0, 1))) & next_in_sample_bt
  candidate_bt = loss_mask_bt & followed_bt & (index_bt > segment_starts_bt)
  # Gumbel top-k on a uniform score: A distinct positions drawn without replacement.
  scores = jnp.where(candidate_bt, jax.random.gumbel(rng, loss_mask_bt.shape), -jnp.inf)
  _, anchors_ba = jax.lax.top_k(scores, num_anchors)
  valid_ba = jnp.take_along_axis(candidate_bt, anchors_ba, axis=1)
  return jnp.where(valid_ba, anchors_ba, 0).astype(jnp.int32), valid_ba


def _sum_over_chunks(fn: Callable, chunk: int, *xs_ba):
  """`fn(*xs_ba)` (a pytree of sums) computed `chunk` anchors (axis 1) at a time, then summed.

  Each chunk's body is rematerialised in the backward pass, so only one chunk's
  intermediates are ever live. The anchor axis is zero-padded to a multiple of
  `chunk`; `fn` must give zero-padded rows zero weight.
  """
  num_anchors = xs_ba[0].shape[1]
  if chunk <= 0 or chunk >= num_anchors:
    return fn(*xs_ba)
  num_chunks = -(-num_anchors // chunk)

  def split(x_ba):
    pad = [(0, 0), (0, num_chunks * chunk - num_anchors)] + [(0, 0)] * (x_ba.ndim - 2)
    x_bnc = jnp.pad(x_ba, pad).reshape(x_ba.shape[0], num_chunks, chunk, *x_ba.shape[2:])
    return jnp.moveaxis(x_bnc, 1, 0)

  # Inside a scan the recomputation cannot be merged away, so CSE need not be prevented.
  body = jax.checkpoint(lambda xs: fn(*xs), prevent_cse=False)
  sums = jax.lax.map(body, tuple(split(x) for x in xs_ba))
  return jax.tree.map(lambda s: s.sum(0), sums)


@dataclasses.dataclass(frozen=True)
class DistillLoss:
  """`loss_fn(head_params, target_params, tokens, loss_mask, rng[, segment_ids])`, in parts.

  Returns (loss, aux). `segment_ids` marks the samples of packed rows (equal ids:
  one sample, contiguous); without it each row is one sample. `prepare` (the frozen
  target's pass and the anchors) needs no gradient; `at_anchors` is the part to
  differentiate, with respect to `head_params` only. `layout` pins the activations to the
  train step's mesh (rows over its batch axes); the default leaves placement to XLA.
  """

  head_config: HeadConfig
  target_config: Qwen3Config
  config: LossConfig
  layout: Layout = Layout()

  def __call__(self, head_params, target_params, tokens_bt, loss_mask_bt, rng,
               segment_ids_bt=None):
    return self.at_anchors(head_params, target_params, tokens_bt, loss_mask_bt,
                           *self.prepare(target_params, tokens_bt, loss_mask_bt, rng,
                                         segment_ids_bt))

  def prepare(self, target_params, tokens_bt, loss_mask_bt, rng, segment_ids_bt=None):
    """(target pass, anchors `[B, A]`, anchor validity `[B, A]`) for one batch."""
    tap_layers = self.head_config.target_layer_ids
    positions_bt = mask_bts = None
    if segment_ids_bt is None:
      starts_bt = jnp.zeros(tokens_bt.shape, jnp.int32)
    else:  # each sample sees only itself, at the positions it would have alone
      starts_bt = segment_starts(segment_ids_bt)
      positions_bt = jnp.arange(tokens_bt.shape[1], dtype=jnp.int32) - starts_bt
      mask_bts = packed_causal_mask(starts_bt)
    hidden_btd, taps_btld = forward_by_layer(
        target_params, self.target_config, self.layout.rows(tokens_bt), positions_bt=positions_bt,
        mask_bts=mask_bts, tap_layers=tap_layers, experts=self.config.target_experts,
        layout=self.layout)
    target = TargetPass(*jax.lax.stop_gradient((hidden_btd, taps_btld)), starts_bt)
    return (target, *sample_anchors(rng, loss_mask_bt, self.config.num_anchors, starts_bt))

  def at_anchors(self, head_params, target_params, tokens_bt, loss_mask_bt, target: TargetPass,
                 anchors_ba, anchor_valid_ba):
    """(loss, aux) of the blocks at `anchors_ba`; aux holds per-depth means (`*_k`) and totals."""
    depth, length = self.head_config.depth, tokens_bt.shape[1]
    # Depth k of anchor a predicts token a + k; its teacher is the target at position a + k - 1.
    predicted_bak = anchors_ba[:, :, None] + jnp.arange(1, depth + 1)
    in_row_bak = predicted_bak < length
    predicted_bak = jnp.minimum(predicted_bak, length - 1)
    gather = jax.vmap(lambda x, i: x[i])
    teacher_bakd = gather(target.hidden_btd, predicted_bak - 1)
    labels_bak = gather(tokens_bt, predicted_bak)
    starts_bt = target.segment_starts_bt
    in_sample_bak = (gather(starts_bt, predicted_bak)
                     == jnp.take_along_axis(starts_bt, anchors_ba, axis=1)[:, :, None])
    valid_bak = (anchor_valid_ba[:, :, None] & in_row_bak & in_sample_bak
                 & gather(loss_mask_bt, predicted_bak))
    draft_bakd = training_hidden(head_params, self.head_config, target_params, self.target_config,
                                 target.taps_btld, tokens_bt, anchors_ba, self.config.head_dtype,
                                 segment_starts_bt=starts_bt,
                                 attention=self.config.head_attention,
                                 attention_chunk=self.config.attention_chunk_anchors,
                                 remat=self.config.remat,
                                 rows=self.layout.rows)
    logits = self._logits_fns(head_params, target_params)
    if self.head_config.draft_vocab_size and self.config.kind == "cross_entropy":
      # Hard labels outside the draft vocabulary cannot be predicted: those positions drop out.
      labels_bak = self._draft_ids(head_params)[labels_bak]
      valid_bak = valid_bak & (labels_bak >= 0)
      labels_bak = jnp.maximum(labels_bak, 0)

    def chunk_sums(draft_bckd, teacher_bckd, labels_bck, valid_bck):
      # Vocabulary-wide logits exist one chunk of anchors at a time, split as the layout says.
      pin = lambda l: self.layout(l, ("batch", None, None, "vocab"))
      return depth_sums(self.config.kind, pin(logits["draft"](self.layout.rows(draft_bckd))),
                        pin(logits["teacher"](self.layout.rows(teacher_bckd))), labels_bck,
                        valid_bck, self.config.temperature)

    sums = _sum_over_chunks(chunk_sums, self.config.chunk_anchors, draft_bakd, teacher_bakd,
                            labels_bak, valid_bak)
    count_k = valid_bak.sum((0, 1)).astype(jnp.float32)
    weights_k = depth_weights(depth, self.config.depth_gamma)
    value = mean_of_sums(jnp.sum(sums["loss_k"] * weights_k), jnp.sum(count_k * weights_k))
    aux = {
        "loss_k": mean_of_sums(sums["loss_k"], count_k),
        "forward_kl": mean_of_sums(sums["forward_kl_k"].sum(), count_k.sum()),
        "agreement_k": mean_of_sums(sums["agreement_k"], count_k),
        "num_predictions": valid_bak.sum(),
    }
    return value, aux

  def _logits_fns(self, head_params, target_params) -> dict[str, Callable]:
    """Draft and teacher logits of final-normed hidden states: over the target's vocabulary,
    or (draft vocabulary) the head's LM head and the target's rows for the same tokens, so
    the teacher is the target's distribution renormalised over them."""
    if not self.head_config.draft_vocab_size:
      full = lambda hidden: lm_logits(target_params, self.target_config, hidden)
      return {"draft": full, "teacher": full}
    kernel_dk = head_params["lm_head"]["kernel"].astype(self.config.head_dtype)
    teacher_dk = lm_head_columns(target_params, self.target_config,
                                 head_params[DRAFT_VOCAB]["target_ids"])
    return {"draft": lambda hidden: vocab_logits(hidden, kernel_dk),
            "teacher": lambda hidden: vocab_logits(hidden, teacher_dk)}

  def _draft_ids(self, head_params):
    """`[V]`: each target token's draft id, -1 outside the draft vocabulary."""
    ids_k = head_params[DRAFT_VOCAB]["target_ids"]
    return jnp.full((self.target_config.vocab_size,), -1, jnp.int32).at[ids_k].set(
        jnp.arange(ids_k.shape[0], dtype=jnp.int32))


def make_loss_fn(head_config: HeadConfig, target_config: Qwen3Config,
                 loss: LossConfig, layout: Layout = Layout()) -> DistillLoss:
  """`loss_fn(head_params, target_params, tokens_bt, loss_mask_bt, rng[, segment_ids_bt])`.

  Only `head_params` is meant to be differentiated; the target is frozen.

  Args:
    head_config: the head's config.
    target_config: the target's config.
    loss: the `LossConfig`.
    layout: `train.sharding.activation_layout(mesh)` pins the activations to a mesh; the
      default leaves placement to XLA.

  Returns:
    The loss function (a `DistillLoss`), which returns `(loss, aux)`: aux holds per-depth
    means (`loss_k`, `agreement_k`), `forward_kl` and `num_predictions`.
  """
  return DistillLoss(head_config, target_config, loss, layout)


def make_train_step(loss_fn: DistillLoss, optimizer: optax.GradientTransformation,
                    schedule: Callable, seed: int) -> Callable:
  """`train_step(state, target_params, tokens_bt, loss_mask_bt[, segment_ids_bt])`, unjitted.

  The step returns `(state, metrics)`: the next `TrainState` and the loss, learning rate,
  grad norm and the loss function's aux. The optimizer state covers the head's trainable
  params only (`optimizer.init(head.split_frozen(params)[0])`). The step's randomness (anchor
  sampling) is `fold_in(seed, step)`, so a resumed run draws exactly what an uninterrupted one
  would.

  Args:
    loss_fn: from `make_loss_fn`.
    optimizer: the optax transformation (`make_optimizer`).
    schedule: the learning rate by step, for the metrics.
    seed: the run's seed.

  Returns:
    The step function, to `jax.jit` (with `donate_argnames=("state",)`).
  """

  def train_step(state: TrainState, target_params, tokens_bt, loss_mask_bt, segment_ids_bt=None):
    rng = jax.random.fold_in(jax.random.key(seed), state.step)
    # The target runs outside differentiation, so none of its activations are kept for backprop.
    inputs = loss_fn.prepare(target_params, tokens_bt, loss_mask_bt, rng, segment_ids_bt)
    # A draft vocabulary's LM head and ids stay as they are: the optimizer never sees them.
    trainable, frozen = split_frozen(state.head_params)
    loss_of = lambda params, *args: loss_fn.at_anchors({**params, **frozen}, *args)
    grad_fn = jax.value_and_grad(loss_of, has_aux=True)
    (loss, aux), grads = grad_fn(trainable, target_params, tokens_bt, loss_mask_bt, *inputs)
    updates, opt_state = optimizer.update(grads, state.opt_state, trainable)
    params = {**optax.apply_updates(trainable, updates), **frozen}
    metrics = {"loss": loss, "learning_rate": schedule(state.step),
               "grad_norm": optax.tree.norm(grads), **aux}
    return TrainState(step=state.step + 1, head_params=params, opt_state=opt_state), metrics

  return train_step


def make_optimizer(lr: float, b1: float, b2: float, weight_decay: float, grad_clip: float,
                   total_steps: int, warmup_frac: float, final_lr_frac: float):
  """AdamW with linear warmup then cosine decay to `final_lr_frac * lr`; global-norm clipping.

  Args:
    lr: the peak learning rate.
    b1: Adam's beta1.
    b2: Adam's beta2.
    weight_decay: AdamW's decoupled weight decay.
    grad_clip: the global gradient norm clipped to.
    total_steps: the schedule's length.
    warmup_frac: the share of steps warming up linearly from 0.
    final_lr_frac: where the cosine ends, as a fraction of `lr`.

  Returns:
    `(optimizer, schedule)`: the optax transformation and the learning rate by step.
  """
  warmup = int(round(warmup_frac * total_steps))
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=lr, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1), end_value=lr * final_lr_frac)
  optimizer = optax.chain(optax.clip_by_global_norm(grad_clip),
                          optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay))
  return optimizer, schedule
