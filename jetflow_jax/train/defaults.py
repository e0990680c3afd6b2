"""Defaults shared by every training config file (the reference's hyper-parameters)."""

from __future__ import annotations

import ml_collections

from jetflow_jax.head_config import QWEN3_MASK_TOKEN_ID


def base_config() -> ml_collections.ConfigDict:
  """Every field of a training config, with the reference's defaults; each `configs/*.py`
  file's `get_config` starts from it. Any field can be set on the command line
  (`--config.train.lr=1e-4`)."""
  c = ml_collections.ConfigDict()

  c.target = ml_collections.ConfigDict()
  c.target.checkpoint = ""  # HF or converted Qwen3 directory
  c.target.dtype = "bfloat16"
  c.target.random_init = False  # a random target of shape `random` instead (tests, smoke runs)
  c.target.random_seed = 0
  c.target.random_sharpness = 4.0  # scales the random LM head: peaked, LM-like predictions
  c.target.random = ml_collections.ConfigDict(dict(
      vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6,
      max_position_embeddings=4096))

  c.head = ml_collections.ConfigDict()
  c.head.num_layers = 5
  c.head.target_layer_ids = ()  # () spreads num_layers taps from layer 1 to L-3
  c.head.block_size = 16
  c.head.mask_token_id = QWEN3_MASK_TOKEN_ID
  c.head.causal = True  # False trains the bidirectional DFlash baseline
  c.head.hidden_size = 0  # 0: the target's (must equal it; set only to have it checked)
  c.head.intermediate_size = 0  # 0: the target's
  # K > 0: predict over the K target tokens the training responses use most (the LM head's rows
  # for them, frozen; forward KL against the target renormalised over them); 0: all of them
  c.head.draft_vocab_size = 0
  c.head.dtype = "bfloat16"  # compute dtype; params stay float32

  c.data = ml_collections.ConfigDict()
  c.data.prompts = ""  # JSONL of prompts to regenerate with the target (resumable)
  c.data.store = ""  # with prompts: the store to regenerate into; default WORKDIR/store
  c.data.regenerated = ""  # instead of prompts: an existing token store, or a regenerated JSONL
  c.data.tokenizer = ""  # default: the target checkpoint directory
  c.data.seq_len = 3072
  c.data.max_new_tokens = 2048
  c.data.regenerate_batch_size = 32  # the engine's slots (jax), or a static batch's prompts
  c.data.regenerate_temperature = 0.0
  c.data.regenerate_seed = 0
  c.data.regenerate_backend = "jax"  # the engine; or jax_static, torch (see train/regenerate.py)
  c.data.regenerate_mesh = ""  # jax: "tp=T[,ep=E]" per copy of the target; copies fill the rest
  c.data.shuffle_seed = 0
  c.data.pack = True  # fill rows with whole samples (short chats would waste 3072-token rows)

  c.train = ml_collections.ConfigDict()
  c.train.batch_size = 8
  c.train.num_anchors = 256
  c.train.loss_chunk_anchors = 32  # anchors whose vocabulary-wide logits exist at once; 0: all
  c.train.head_attention = "split"  # dense | split | pallas (GPU): the head's training mask
  # split: anchors whose attention scores exist at once (each chunk recomputed in the backward
  # pass, so the [T, S] scores of all layers never coexist); 0: all anchors at once
  c.train.attention_chunk_anchors = 64
  c.train.remat = "none"  # none | full | dots: recompute head layers in the backward pass
  # An MoE target's experts in the frozen pass: blocked (each row routes its own pairs; lean on
  # any backend) | ragged (one lax.ragged_dot over the whole batch; dense on CPU)
  c.train.target_experts = "blocked"
  c.train.loss = "forward_kl"  # forward_kl | reverse_kl | cross_entropy
  c.train.temperature = 1.0  # KL temperature (losses scaled by T^2)
  c.train.depth_gamma = 0.0  # > 0 weighs depth k by exp(-(k-1)/gamma)
  c.train.lr = 3e-4
  c.train.b1 = 0.9
  c.train.b2 = 0.95
  c.train.weight_decay = 0.0
  c.train.warmup_frac = 0.04
  c.train.final_lr_frac = 0.1
  c.train.grad_clip = 1.0
  c.train.epochs = 6
  c.train.num_steps = 0  # > 0 caps the run below `epochs` worth of steps
  c.train.seed = 0
  # An exported head, workdir or hub id to start from instead of random params (fine-tuning on
  # new data); the optimizer and schedule start afresh. Ignored once the workdir has a checkpoint.
  c.train.init_head = ""
  c.train.log_every = 10
  c.train.checkpoint_every = 500
  c.train.keep_checkpoints = 3

  # After training, the head's acceptance on the target's continuations of held-out prompts
  # (the data.prompts format), kept as acceptance.json beside it: --budget auto's prior on a
  # target the head never drafted for. "": measured later, if at all (train.measure_acceptance).
  c.eval = ml_collections.ConfigDict()
  c.eval.prompts = ""
  c.eval.count = 64  # prompts used, from the first
  c.eval.max_new_tokens = 256  # tokens of each greedy continuation

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # -1: all devices not used by fsdp
  c.mesh.fsdp = 1
  return c


def shrink_for_smoke_run(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A quick local run of a real config: short sequences, few anchors, a handful of steps."""
  c.data.seq_len = 256
  c.data.max_new_tokens = 128
  c.data.regenerate_batch_size = 4
  c.train.batch_size = 1
  c.train.num_anchors = 16
  c.train.num_steps = 20
  c.train.log_every = 1
  c.train.checkpoint_every = 10
  return c
