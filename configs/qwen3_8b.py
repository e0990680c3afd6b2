"""JetFlow head for Qwen3-8B: the reference setup (5 layers, taps [1, 9, 17, 25, 33], block 16).

  python train.py --config=configs/qwen3_8b.py --workdir=runs/qwen3_8b \
      --config.target.checkpoint=/models/Qwen3-8B --config.data.prompts=prompts.jsonl

`--config=configs/qwen3_8b.py:smoke` shrinks it for a quick local run;
`--validate_only` checks it against the checkpoint's config.json without loading weights.
"""

from jetflow_jax.train.defaults import base_config, shrink_for_smoke_run


def get_config(arg: str | None = None):
  c = base_config()
  c.head.num_layers = 5
  c.head.target_layer_ids = (1, 9, 17, 25, 33)
  c.head.block_size = 16
  return shrink_for_smoke_run(c) if arg == "smoke" else c
