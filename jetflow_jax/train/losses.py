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
  """`[..., depth]` losses: forward KL (teacher || draft), reverse KL, or hard-label CE.

  Args:
    kind: `forward_kl`, `reverse_kl` or `cross_entropy`.
    draft_logits: `[..., depth, V]` the head's logits.
    teacher_logits: `[..., depth, V]` the target's logits at the same positions.
    labels: `[..., depth]` the tokens (cross-entropy only).
    temperature: the KL temperature (scaled by T^2).

  Raises:
    ValueError: an unknown kind.
  """
  if kind == "forward_kl":
    return kl_divergence(teacher_logits, draft_logits, temperature)
  if kind == "reverse_kl":
    return kl_divergence(draft_logits, teacher_logits, temperature)
  if kind == "cross_entropy":
    log_q = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(log_q, labels[..., None], axis=-1)[..., 0]
  raise ValueError(f"unknown loss {kind!r}; expected one of {LOSSES}")


def depth_sums(kind: str, draft_logits, teacher_logits, labels, valid, temperature: float = 1.0):
  """Per-depth sums over valid predictions (`[depth]` each) of the loss, forward KL and agreement.

  Logits are `[..., depth, V]`. Agreement: the teacher's top token is (one of) the draft's.
  """
  losses = per_depth_loss(kind, draft_logits, teacher_logits, labels, temperature)
  # Metrics carry no gradient; they reuse the loss's vocabulary pass where they coincide.
  draft_logits, teacher_logits = jax.lax.stop_gradient((draft_logits, teacher_logits))
  if kind == "forward_kl" and temperature == 1.0:
    kl = jax.lax.stop_gradient(losses)
  else:
    kl = kl_divergence(teacher_logits, draft_logits)
  teacher_top = jnp.argmax(teacher_logits, -1)[..., None]
  agree = jnp.take_along_axis(draft_logits, teacher_top, -1)[..., 0] >= jnp.max(draft_logits, -1)
  weight = valid.astype(jnp.float32)
  total = lambda x: jnp.sum(x * weight, axis=tuple(range(weight.ndim - 1)))
  return {"loss_k": total(losses), "forward_kl_k": total(kl), "agreement_k": total(agree)}


def depth_weights(depth: int, gamma: float):
  """exp(-(k - 1) / gamma) for k = 1..depth; gamma <= 0 weighs every depth equally."""
  if gamma <= 0:
    return jnp.ones((depth,), jnp.float32)
  return jnp.exp(-jnp.arange(depth, dtype=jnp.float32) / gamma)


def mean_of_sums(total, count):
  """`total / count`, reading 0 / 0 as 0 (no valid prediction)."""
  return total / jnp.maximum(count, 1.0)
