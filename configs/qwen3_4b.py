"""JetFlow head for Qwen3-4B (36 layers, hidden 2560): 5 layers, taps [1, 9, 17, 25, 33].

  python train.py --config=configs/qwen3_4b.py --workdir=runs/qwen3_4b \
      --config.target.checkpoint=/models/Qwen3-4B --config.data.prompts=prompts.jsonl
"""

import ml_collections

from jetflow_jax.train.defaults import base_config, shrink_for_smoke_run


def get_config(arg: str | None = None):
  c = base_config()
  # The published Qwen3-4B architecture: `--memory_report` compiles against it without a
  # checkpoint (a checkpoint's config.json, when given, is used instead).
  c.target.shape = ml_collections.ConfigDict(dict(
      vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
      num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True))
  c.head.num_layers = 5
  c.head.target_layer_ids = (1, 9, 17, 25, 33)
  return shrink_for_smoke_run(c) if arg == "smoke" else c
