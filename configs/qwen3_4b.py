"""JetFlow head for Qwen3-4B (36 layers, hidden 2560): 5 layers, taps [1, 9, 17, 25, 33].

  python train.py --config=configs/qwen3_4b.py --workdir=runs/qwen3_4b \
      --config.target.checkpoint=/models/Qwen3-4B --config.data.prompts=prompts.jsonl
"""

from jetflow_jax.train.defaults import base_config, shrink_for_smoke_run


def get_config(arg: str | None = None):
  c = base_config()
  c.head.num_layers = 5
  c.head.target_layer_ids = (1, 9, 17, 25, 33)
  return shrink_for_smoke_run(c) if arg == "smoke" else c
