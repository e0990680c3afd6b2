"""Per-depth distillation losses between draft logits and the target's (teacher) logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOSSES = ("forward_kl", "reverse_kl", "cross_entropy")


def kl_divergence(p_logits, q_logits, temperature: float = 1.0):
  """KL(softmax(p / T) || softmax(q / T)) over the last axis, times T^2 (gradient scale).

  Written as sum(P * (p - q)) - lse(p) + lse(q): two reductions and one fused pass
  over the vocabulary, instead of materialising two log-softmax arrays.
  """
  p = p_logits.astype(jnp.float32) / temperature
  q = q_logits.astype(jnp.float32) / temperature
  lse_p = jax.nn.logsumexp(p, axis=-1, keepdims=True)
  lse_q = jax.nn.logsumexp(q, axis=-1, keepdims=True)
  kl = jnp.sum(jnp.exp(p - lse_p) * (p - q), axis=-1) - lse_p[..., 0] + lse_q[..., 0]
  return kl * temperature**2


def per_depth_loss(kind: str, draft_logits, teacher_logits, labels, temperature: float = 1.0):
  """`[..., depth]` losses: forward KL (teacher || draft), reverse KL, or hard-label CE."""
  if kind == "forward_kl":
    return kl_divergence(teacher_logits, draft_logits, temperature)
  if kind == "reverse_kl":
    return kl_divergence(draft_logits, teacher_logits, temperature)
  if kind == "cross_entropy":
    log_q = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(log_q, labels[..., None], axis=-1)[..., 0]
  raise ValueError(f"unknown loss {kind!r}; expected one of {LOSSES}")


def depth_weights(depth: int, gamma: float):
  """exp(-(k - 1) / gamma) for k = 1..depth; gamma <= 0 weighs every depth equally."""
  if gamma <= 0:
    return jnp.ones((depth,), jnp.float32)
  return jnp.exp(-jnp.arange(depth, dtype=jnp.float32) / gamma)


def masked_mean(values, mask, axis=None):
  mask = mask.astype(jnp.float32)
  return jnp.sum(values * mask, axis=axis) / jnp.maximum(jnp.sum(mask, axis=axis), 1.0)
