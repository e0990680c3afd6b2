"""JetFlow head for Qwen3-32B (64 layers, hidden 5120): 5 layers, taps spread 1..61.

  python train.py --config=configs/qwen3_32b.py --workdir=runs/qwen3_32b \
      --config.target.checkpoint=/models/Qwen3-32B --config.data.prompts=prompts.jsonl \
      --config.mesh.fsdp=8
  python decode.py --memory_report --config configs/qwen3_32b.py --mesh tp=2 \
      --batch-size 8 --budget 256 --cache-size 8192
"""

import ml_collections

from jetflow_jax.train.defaults import base_config, shrink_for_smoke_run


def get_config(arg: str | None = None):
  c = base_config()
  # The published Qwen3-32B architecture: the memory reports compile against it without a
  # checkpoint (a checkpoint's config.json, when given, is used instead).
  c.target.shape = ml_collections.ConfigDict(dict(
      vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
      num_attention_heads=64, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False))
  c.head.num_layers = 5
  c.head.target_layer_ids = (1, 16, 31, 46, 61)
  return shrink_for_smoke_run(c) if arg == "smoke" else c
