"""JetFlow head for Qwen3-235B-A22B (94 layers, hidden 4096, 128 experts, top-8): 5 dense layers,
taps spread 1..91.

The head's MLP width defaults to the target's dense `intermediate_size` (12288).

  python train.py --config=configs/qwen3_235b_a22b.py --workdir=runs/qwen3_235b \
      --config.target.checkpoint=/models/Qwen3-235B-A22B --config.data.prompts=prompts.jsonl \
      --config.mesh.fsdp=32 --config.train.batch_size=32 \
      --coordinator_address=HOST0:12345 --num_processes=4 --process_id=P

At the reference settings (seq 3072, 512 anchors, block 16, one row per device) the step holds
41.0 GiB per device over 4 hosts x 8 devices (fsdp 32), 55.3 GiB over 2 x 8 (fsdp 16) and
34.3 GiB over 8 x 8 (fsdp 64), as XLA compiles it on fake CPU devices (no weights needed):

  python train.py --config=configs/qwen3_235b_a22b.py --memory_report --num_processes=4 \
      --devices_per_process=8 --config.mesh.fsdp=32 --config.train.batch_size=32 \
      --config.train.num_anchors=512 --config.data.seq_len=3072
  python decode.py --memory_report --config configs/qwen3_235b_a22b.py --mesh tp=4,ep=2 \
      --batch-size 8 --budget 256 --cache-size 8192
"""

import ml_collections

from jetflow_jax.train.defaults import base_config, shrink_for_smoke_run


def get_config(arg: str | None = None):
  c = base_config()
  # The published Qwen3-235B-A22B architecture: the memory reports compile against it without
  # a checkpoint (a checkpoint's config.json, when given, is used instead).
  c.target.shape = ml_collections.ConfigDict(dict(
      vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
      num_attention_heads=64, num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
      num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536, norm_topk_prob=True))
  c.head.num_layers = 5
  c.head.target_layer_ids = (1, 24, 46, 68, 91)
  return shrink_for_smoke_run(c) if arg == "smoke" else c
