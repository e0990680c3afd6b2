"""JetFlow head for Qwen3-30B-A3B (48 layers, hidden 2048, MoE): 5 dense layers, taps spread 1..45.

The head's MLP width defaults to the target's dense `intermediate_size` (6144).
Shard the target over devices with `--config.mesh.fsdp=N`.

  python train.py --config=configs/qwen3_30b_a3b.py --workdir=runs/qwen3_30b_a3b \
      --config.target.checkpoint=/models/Qwen3-30B-A3B --config.data.prompts=prompts.jsonl
"""

import ml_collections

from jetflow_jax.train.defaults import base_config, shrink_for_smoke_run


def get_config(arg: str | None = None):
  c = base_config()
  # The published Qwen3-30B-A3B architecture: `--memory_report` compiles against it without a
  # checkpoint (a checkpoint's config.json, when given, is used instead).
  c.target.shape = ml_collections.ConfigDict(dict(
      vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
      num_attention_heads=32, num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
      num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True))
  c.head.num_layers = 5
  c.head.target_layer_ids = (1, 12, 23, 34, 45)
  return shrink_for_smoke_run(c) if arg == "smoke" else c
