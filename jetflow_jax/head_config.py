"""Draft-head config: its own layers, the target taps it reads, block size, mask id, mask flag,
and the draft vocabulary it predicts over.

The HF-style dict form is the reference layout (`config.json` of
`JetSpec/jetspec-qwen3-8b` or `z-lab/Qwen3-8B-DFlash-b16`): Qwen3 fields plus
`block_size`, `num_target_layers` and `dflash_config` (and, for a head with a draft
vocabulary, which the reference does not have, `draft_vocab_size`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jetflow_jax.config import Qwen3Config
from jetflow_jax.errors import ConfigError

QWEN3_MASK_TOKEN_ID = 151669  # a padded row of Qwen3's 151936-row embedding


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> tuple[int, ...]:
  """Taps spread evenly from layer 1 to L-3 (the reference's rule, rounding included)."""
  if num_taps == 1:
    return (num_target_layers // 2,)
  start, end = 1, num_target_layers - 3
  return tuple(int(round(start + i * (end - start) / (num_taps - 1))) for i in range(num_taps))


@dataclasses.dataclass(frozen=True)
class HeadConfig:
  """Architecture of a draft head and how it attaches to its target. Hashable (static under jit).

  Attributes:
    num_layers: the head's own Qwen3 decoder layers.
    hidden_size: its width, which must be the target's (it uses the target's embedding and LM
      head).
    intermediate_size: its MLP width.
    num_attention_heads: its query heads.
    num_key_value_heads: its key/value heads.
    head_dim: its head width.
    target_layer_ids: the target layers whose raw outputs (taps) it reads for committed
      tokens; never the last layer.
    num_target_layers: the layer count of the target it was built for.
    vocab_size: the target's vocabulary.
    block_size: the block `[anchor, MASK x (block_size - 1)]`; it drafts `block_size - 1`
      depths a round.
    mask_token_id: the reserved vocabulary id of MASK (Qwen3: 151669, a padded embedding row).
    causal: True for JetFlow (offset i of the block sees offsets <= i); False for the
      bidirectional DFlash baseline.
    rms_norm_eps: the epsilon of its RMSNorms.
    rope_theta: its RoPE base.
  """

  num_layers: int
  hidden_size: int
  intermediate_size: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  target_layer_ids: tuple[int, ...]
  num_target_layers: int  # 0 when unknown (see `speculators_format.from_speculators_dict`)
  vocab_size: int
  block_size: int = 16
  mask_token_id: int = QWEN3_MASK_TOKEN_ID
  causal: bool = True  # JetFlow; False is the bidirectional DFlash baseline
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1e6
  # K > 0: the head predicts over K of the target's tokens (its own LM head [D, K] and the
  # target id of each, in its params); 0: over the target's whole vocabulary, with its LM head.
  draft_vocab_size: int = 0
  # Not architecture: what the head measured of itself on held-out text
  # (`head_acceptance.HeadAcceptance`, not imported: that module imports the decoding policy,
  # which imports this one), read from its directory by `load_head`; out of equality and
  # hashing, so it never changes a compiled program's key.
  acceptance: HeadAcceptance | None = dataclasses.field(default=None, compare=False)

  @property
  def depth(self) -> int:
    """Tokens drafted per block (the anchor is given)."""
    return self.block_size - 1

  @property
  def num_taps(self) -> int:
    """How many target layers it reads."""
    return len(self.target_layer_ids)

  @property
  def output_vocab_size(self) -> int:
    """Tokens the head's log-probs cover: the draft vocabulary's, or the target's."""
    return self.draft_vocab_size or self.vocab_size

  def layer_config(self) -> Qwen3Config:
    """A dense Qwen3 config describing the head's decoder layers."""
    return Qwen3Config(
        vocab_size=self.vocab_size, hidden_size=self.hidden_size,
        intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
        num_attention_heads=self.num_attention_heads,
        num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
        rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta)

  @classmethod
  def for_target(cls, target: Qwen3Config, num_layers: int = 5,
                 target_layer_ids: tuple[int, ...] | None = None, block_size: int = 16,
                 mask_token_id: int = QWEN3_MASK_TOKEN_ID, causal: bool = True,
                 **overrides) -> "HeadConfig":
    """A head shaped like its target's layers; taps default to `num_layers` spread taps.

    Args:
      target: the target's config.
      num_layers: the head's decoder layers.
      target_layer_ids: the taps; None spreads `num_layers` of them from layer 1 to L-3 (the
        reference's rule).
      block_size: the draft block, anchor included.
      mask_token_id: the reserved MASK id.
      causal: JetFlow (True) or DFlash (False).
      **overrides: any other field, e.g. `intermediate_size`.

    Returns:
      The config (not yet validated against the target: `validate_for`).
    """
    taps = target_layer_ids or default_target_layer_ids(target.num_hidden_layers, num_layers)
    fields = dict(
        num_layers=num_layers, hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size or target.moe_intermediate_size,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads, head_dim=target.head_dim,
        target_layer_ids=tuple(taps), num_target_layers=target.num_hidden_layers,
        vocab_size=target.vocab_size, block_size=block_size, mask_token_id=mask_token_id,
        causal=causal, rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta)
    fields.update(overrides)
    return cls(**fields)

  def validate_for(self, target: Qwen3Config) -> None:
    """Checks this head against `target`.

    Raises:
      ConfigError: one error listing every way this head does not fit `target` (width,
        vocabulary, layer count, taps, mask id, block size, heads).
    """
    problems = []
    if self.hidden_size != target.hidden_size:
      problems.append(f"head hidden_size {self.hidden_size} != target hidden_size "
                      f"{target.hidden_size} (the head uses the target's embedding and LM head)")
    if self.vocab_size != target.vocab_size:
      problems.append(f"head vocab_size {self.vocab_size} != target vocab_size {target.vocab_size}")
    # 0: unknown (a speculators head whose verifier's config was not at hand)
    if self.num_target_layers not in (0, target.num_hidden_layers):
      problems.append(f"head was built for a {self.num_target_layers}-layer target; this target "
                      f"has {target.num_hidden_layers} layers")
    # A tap on the last layer is ambiguous (HF's last hidden state is final-normed): refuse it.
    bad_taps = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers - 1]
    if bad_taps:
      problems.append(f"target_layer_ids {bad_taps} out of range [0, "
                      f"{target.num_hidden_layers - 2}] for a {target.num_hidden_layers}-layer "
                      "target (the last layer is never tapped)")
    if len(set(self.target_layer_ids)) != len(self.target_layer_ids) or not self.target_layer_ids:
      problems.append(f"target_layer_ids {list(self.target_layer_ids)} must be non-empty and "
                      "distinct")
    if not 0 <= self.mask_token_id < target.vocab_size:
      problems.append(f"mask_token_id {self.mask_token_id} out of range [0, {target.vocab_size})")
    if self.block_size < 2:
      problems.append(f"block_size {self.block_size} must be >= 2")
    if not 0 <= self.draft_vocab_size < target.vocab_size:
      problems.append(f"draft_vocab_size {self.draft_vocab_size} must be 0 (the target's whole "
                      f"vocabulary) or below the target's {target.vocab_size}")
    if self.num_layers < 1:
      problems.append(f"num_layers {self.num_layers} must be >= 1")
    if self.num_attention_heads % self.num_key_value_heads:
      problems.append(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                      f"num_key_value_heads {self.num_key_value_heads}")
    if problems:
      raise ConfigError("draft head does not fit the target:\n  " + "\n  ".join(problems))

  def to_hf_dict(self) -> dict[str, Any]:
    """The reference's `config.json` layout."""
    extra = {"draft_vocab_size": self.draft_vocab_size} if self.draft_vocab_size else {}
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads,
        "head_dim": self.head_dim,
        "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,
        "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
        "vocab_size": self.vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": self.block_size,
        "num_target_layers": self.num_target_layers,
        "dflash_config": {"target_layer_ids": list(self.target_layer_ids),
                          "mask_token_id": self.mask_token_id, "causal_head": self.causal},
        **extra,
    }

  @classmethod
  def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "HeadConfig":
    """Reads a reference head `config.json` (JetSpec or DFlash; DFlash heads are bidirectional).

    Raises:
      ConfigError: not a draft-head config, or layers this port does not support.
    """
    if "block_size" not in raw or "num_target_layers" not in raw:
      raise ConfigError(f"{source} is not a draft-head config (needs block_size and "
                        "num_target_layers)")
    layers = Qwen3Config.from_hf_dict({**raw, "model_type": "qwen3"}, source)
    dflash = raw.get("dflash_config") or {}
    taps = dflash.get("target_layer_ids") or default_target_layer_ids(
        raw["num_target_layers"], layers.num_hidden_layers)
    return cls(
        num_layers=layers.num_hidden_layers, hidden_size=layers.hidden_size,
        intermediate_size=layers.intermediate_size,
        num_attention_heads=layers.num_attention_heads,
        num_key_value_heads=layers.num_key_value_heads, head_dim=layers.head_dim,
        target_layer_ids=tuple(taps), num_target_layers=raw["num_target_layers"],
        vocab_size=layers.vocab_size, block_size=raw["block_size"],
        mask_token_id=dflash.get("mask_token_id", QWEN3_MASK_TOKEN_ID),
        causal=bool(dflash.get("causal_head", False)), rms_norm_eps=layers.rms_norm_eps,
        rope_theta=layers.rope_theta, draft_vocab_size=int(raw.get("draft_vocab_size") or 0))
