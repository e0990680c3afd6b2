"""The jitted train step: frozen target pass, many anchors per sequence, one head forward."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax

from jetflow_jax.config import Qwen3Config
from jetflow_jax.head import training_logits
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.model import forward, lm_logits
from jetflow_jax.train.losses import depth_weights, kl_divergence, masked_mean, per_depth_loss


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  head_params: Any
  opt_state: Any


@dataclasses.dataclass(frozen=True)
class LossConfig:
  kind: str = "forward_kl"
  temperature: float = 1.0
  depth_gamma: float = 0.0  # <= 0: every depth weighs the same
  num_anchors: int = 256
  head_dtype: Any = jnp.float32


def sample_anchors(rng, loss_mask_bt, num_anchors: int):
  """Up to `num_anchors` distinct anchor positions per row, uniformly among response tokens.

  An anchor is a response token followed by another response token (so depth 1
  has a label). Returns (anchors `[B, A]`, valid `[B, A]`); rows with fewer candidate
  positions than A fill the rest with invalid anchors at position 0.
  """
  length = loss_mask_bt.shape[1]
  position = jnp.arange(length)
  followed_bt = jnp.pad(loss_mask_bt[:, 1:], ((0, 0), (0, 1)))
  candidate_bt = loss_mask_bt & followed_bt & (position >= 1)
  # Gumbel top-k on a uniform score: A distinct positions drawn without replacement.
  scores = jnp.where(candidate_bt, jax.random.gumbel(rng, loss_mask_bt.shape), -jnp.inf)
  _, anchors_ba = jax.lax.top_k(scores, num_anchors)
  valid_ba = jnp.take_along_axis(candidate_bt, anchors_ba, axis=1)
  return jnp.where(valid_ba, anchors_ba, 0).astype(jnp.int32), valid_ba


def make_loss_fn(head_config: HeadConfig, target_config: Qwen3Config,
                 loss: LossConfig) -> Callable:
  """Returns `loss_fn(head_params, target_params, tokens_bt, loss_mask_bt, rng) -> (loss, aux)`.

  Only `head_params` is meant to be differentiated; the target is frozen.
  """
  depth = head_config.depth
  weights_k = depth_weights(depth, loss.depth_gamma)

  def loss_fn(head_params, target_params, tokens_bt, loss_mask_bt, rng):
    length = tokens_bt.shape[1]
    hidden_btd, _, taps_btld = forward(target_params, target_config, tokens_bt,
                                       tap_layers=head_config.target_layer_ids)
    hidden_btd, taps_btld = jax.lax.stop_gradient((hidden_btd, taps_btld))
    anchors_ba, anchor_valid_ba = sample_anchors(rng, loss_mask_bt, loss.num_anchors)

    # Depth k of anchor a predicts token a + k; its teacher is the target at position a + k - 1.
    predicted_bak = anchors_ba[:, :, None] + jnp.arange(1, depth + 1)
    in_row_bak = predicted_bak < length
    predicted_bak = jnp.minimum(predicted_bak, length - 1)
    gather = jax.vmap(lambda x, i: x[i])
    teacher_hidden = gather(hidden_btd, predicted_bak - 1)
    teacher_logits = jax.lax.stop_gradient(lm_logits(target_params, target_config, teacher_hidden))
    labels_bak = gather(tokens_bt, predicted_bak)
    valid_bak = anchor_valid_ba[:, :, None] & in_row_bak & gather(loss_mask_bt, predicted_bak)

    draft = training_logits(head_params, head_config, target_params, target_config, taps_btld,
                            tokens_bt, anchors_ba, dtype=loss.head_dtype)
    losses_bak = per_depth_loss(loss.kind, draft, teacher_logits, labels_bak, loss.temperature)
    value = masked_mean(losses_bak, valid_bak * weights_k)

    # Metrics, sharing work with the loss where they coincide (vocab-wide passes are the cost).
    plain_kl = loss.kind == "forward_kl" and loss.temperature == 1.0
    kl_bak = losses_bak if plain_kl else kl_divergence(teacher_logits, draft)
    teacher_top = jnp.argmax(teacher_logits, -1)[..., None]
    agree_bak = jnp.take_along_axis(draft, teacher_top, -1)[..., 0] >= jnp.max(draft, -1)
    aux = {
        "forward_kl": masked_mean(kl_bak, valid_bak),
        "agreement_k": masked_mean(agree_bak, valid_bak, axis=(0, 1)),  # per depth
        "num_predictions": valid_bak.sum(),
    }
    return value, aux

  return loss_fn


def make_train_step(loss_fn: Callable, optimizer: optax.GradientTransformation,
                    schedule: Callable, seed: int) -> Callable:
  """`train_step(state, target_params, tokens_bt, loss_mask_bt) -> (state, metrics)`, unjitted.

  The step's randomness (anchor sampling) is `fold_in(seed, step)`, so a
  resumed run draws exactly what an uninterrupted one would.
  """

  def train_step(state: TrainState, target_params, tokens_bt, loss_mask_bt):
    rng = jax.random.fold_in(jax.random.key(seed), state.step)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, aux), grads = grad_fn(state.head_params, target_params, tokens_bt, loss_mask_bt, rng)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.head_params)
    params = optax.apply_updates(state.head_params, updates)
    metrics = {"loss": loss, "learning_rate": schedule(state.step),
               "grad_norm": optax.tree.norm(grads), **aux}
    return TrainState(step=state.step + 1, head_params=params, opt_state=opt_state), metrics

  return train_step


def make_optimizer(lr: float, b1: float, b2: float, weight_decay: float, grad_clip: float,
                   total_steps: int, warmup_frac: float, final_lr_frac: float):
  """AdamW with linear warmup then cosine decay to `final_lr_frac * lr`; global-norm clipping."""
  warmup = int(round(warmup_frac * total_steps))
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=lr, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1), end_value=lr * final_lr_frac)
  optimizer = optax.chain(optax.clip_by_global_norm(grad_clip),
                          optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay))
  return optimizer, schedule
