"""The embedded pair's draft heads, trained on the embedded target's own continuations.

  python train.py --config=configs/embedded.py:jetflow --workdir=runs/embedded/head_jetflow
  python train.py --config=configs/embedded.py:dflash --workdir=runs/embedded/head_dflash

Both heads read the same regenerated data (`data.store`): the target's greedy
continuations of 20,000 training-file prompts (`python -m jetflow_jax.embedded.prompts`,
seeds 4 and 5). scripts/build_embedded.sh runs the whole pipeline; it trains the shipped
heads with this config's schedule as it is, and names the target and the continuations it
regenerated beforehand (`--config.data.prompts= --config.data.store=
--config.data.regenerated=STORE`). Same size, data and steps: only the in-block mask differs.

`:quick` (what `make train` runs) is a JetFlow head of the same shape trained from scratch in
minutes on CPU, on the target's continuations of the 128 prompts shipped in
configs/data/embedded_quick_prompts.jsonl (seed 3): too little to match the shipped head, but a
head `decode.py --head WORKDIR` drafts with.
"""

import os

from jetflow_jax import embedded
from jetflow_jax.train.defaults import base_config


def get_config(arg: str | None = "jetflow"):
  if arg == "quick":
    return quick(get_config("jetflow"))
  if arg not in ("jetflow", "dflash"):
    raise ValueError(f"configs/embedded.py takes :jetflow, :dflash or :quick (got {arg!r})")
  c = base_config()
  c.target.checkpoint = embedded.TARGET_DIR
  c.target.dtype = "float32"
  # 2 layers at a third of the target's MLP width: under 15% of its non-embedding params.
  c.head.num_layers = 2
  c.head.intermediate_size = 256
  c.head.target_layer_ids = (1, 6)
  c.head.block_size = 16
  c.head.mask_token_id = 1  # <|mask|> in the embedded tokenizer
  c.head.causal = arg == "jetflow"
  c.head.dtype = "float32"
  c.data.prompts = "runs/embedded/prompts.jsonl"
  c.data.store = "runs/embedded/regenerated"  # one store for both heads
  c.data.seq_len = 304
  c.data.max_new_tokens = 256
  c.data.regenerate_batch_size = 64
  c.data.regenerate_backend = "torch"  # twice our JAX loop's speed on these 2-core CPUs
  c.data.pack = False  # every sample fills its row anyway (48 + 256 = seq_len)
  c.train.batch_size = 16
  # 16 anchors of 16 rows already cover a 256-token response about once; more anchors
  # overlap and cost full-vocabulary logits (the step's main cost on CPU) for little new signal.
  c.train.num_anchors = 16
  c.train.lr = 2e-3
  # Weigh depth k by exp(-(k-1)/7): the far depths a tree rarely reaches get less say.
  c.train.depth_gamma = 7.0
  # 2,200 steps of 16 rows cover the 20,000 continuations 1.8 times; the agreement curve
  # is flat from about step 1,500 (docs/figures/embedded_heads.png).
  c.train.epochs = 4
  c.train.num_steps = 2200
  c.train.log_every = 20
  c.train.checkpoint_every = 100
  return c


def quick(c):
  """A few minutes on CPU: 128 prompts of 32 tokens, 64-token answers, 96 steps."""
  c.data.prompts = os.path.join(os.path.dirname(__file__), "data",
                                "embedded_quick_prompts.jsonl")
  c.data.store = ""  # WORKDIR/store
  c.data.seq_len = 96
  c.data.max_new_tokens = 64
  c.data.regenerate_batch_size = 32
  c.data.regenerate_backend = "jax"  # torch would add its import to every run
  c.train.num_anchors = 8
  c.train.epochs = 12
  c.train.num_steps = 0
  c.train.log_every = 8
  c.train.checkpoint_every = 48
  return c
