"""JetFlow head for Qwen3-8B: the reference setup (5 layers, taps [1, 9, 17, 25, 33], block 16).

  python train.py --config=configs/qwen3_8b.py --workdir=runs/qwen3_8b \
      --config.target.checkpoint=/models/Qwen3-8B --config.data.prompts=prompts.jsonl

`--config=configs/qwen3_8b.py:smoke` shrinks it for a quick local run;
`--validate_only` checks it against the checkpoint's config.json without loading weights;
`--memory_report --config.mesh.fsdp=8` prints the train step's per-device memory on 8 fake
devices, without a checkpoint or a GPU.
"""

import ml_collections

from jetflow_jax.train.defaults import base_config, shrink_for_smoke_run


def get_config(arg: str | None = None):
  c = base_config()
  # The published Qwen3-8B architecture: `--memory_report` compiles against it without a
  # checkpoint (a checkpoint's config.json, when given, is used instead).
  c.target.shape = ml_collections.ConfigDict(dict(
      vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
      num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False))
  c.head.num_layers = 5
  c.head.target_layer_ids = (1, 9, 17, 25, 33)
  c.head.block_size = 16
  return shrink_for_smoke_run(c) if arg == "smoke" else c
