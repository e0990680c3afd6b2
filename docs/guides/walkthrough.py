"""A research walk-through of jetflow_jax on the embedded pair, on CPU.

Run it as a script (`python docs/guides/walkthrough.py`) or read it with its output in the docs
(docs/guides/walkthrough.md). `# %% name` lines split it into the cells the page shows, and
tests/test_docs.py runs it and checks what it prints.
"""

# %% load
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

import jetflow_jax
from jetflow_jax import compile_cache
from jetflow_jax.embedded import default_head, default_target

compile_cache.enable()  # compiled programs kept on disk: a second run loads them, as decode.py does
target_dir = default_target()  # the target shipped in the package
config, target_params = jetflow_jax.load_qwen3(target_dir)  # float32 by default
head_config, head_params = jetflow_jax.load_head(default_head("jetflow"))
# The checkpoint's tokenizer file (transformers' AutoTokenizer reads the same directory; the
# `tokenizers` package alone imports faster).
tokenizer = Tokenizer.from_file(f"{target_dir}/tokenizer.json")

print(f"target: {config.num_hidden_layers} layers, width {config.hidden_size}, "
      f"vocabulary {config.vocab_size}")
print(f"head: {head_config.num_layers} layers, taps {head_config.target_layer_ids}, "
      f"block {head_config.block_size}, causal {head_config.causal}")

# %% forward
prompts = ["def fibonacci(n):", "import os\nimport"]
prompt_ids = [tokenizer.encode(p).ids for p in prompts]
ids = jnp.asarray(prompt_ids[:1])  # [batch, tokens]: the first prompt
logits, taps = jetflow_jax.qwen3_forward(target_params, config, ids,
                                         tap_layers=head_config.target_layer_ids)
print("logits:", logits.shape, logits.dtype, "| taps:", taps.shape)
print("the target's next token:", repr(tokenizer.decode([int(logits[0, -1].argmax())])))

# %% draft
# One head forward drafts depths 1..15 after the anchor (the prompt's last token).
draft = jetflow_jax.draft_logits(head_params, head_config, target_params, config, ids)
print("draft logits:", draft.shape)  # [batch, block_size - 1, vocab]
print("head's top-1 per depth:", repr(tokenizer.decode(draft[0].argmax(-1).tolist())))
# Plain greedy decoding of both prompts: what every drafter below must reproduce.
ar = jetflow_jax.generate(target_params, config, prompt_ids, 48)
print("the target's greedy text:", repr(tokenizer.decode(ar.tokens[0][:15])))

# %% tree
# The exact top-8 tree over each depth's top-3 tokens (node 0 is the root: the anchor).
logprobs = jax.nn.log_softmax(draft, axis=-1)
build_tree = jax.jit(jetflow_jax.build_tree, static_argnames=("budget", "top_k"))
tree = build_tree(logprobs, budget=8, top_k=3)
print("tree arrays:", {k: v.shape for k, v in vars(tree).items()})
for node in range(8):
  token = "(anchor)" if node == 0 else repr(tokenizer.decode([int(tree.tokens[0, node])]))
  print(f"node {node}: depth {int(tree.depths[0, node])}, parent {int(tree.parents[0, node]):2d}, "
        f"path log-prob {float(tree.scores[0, node]):6.2f}, token {token}")

# %% drafter
from jetflow_jax.decoding import TreeShape, decode_prompts


@dataclasses.dataclass(frozen=True)
class BigramDrafter:
  """Drafts a chain by looking up each token's usual successor in a table (its params).

  The Drafter protocol is `depth`, `tap_layers`, `init_state`, `draft` and `commit`. This one
  reads no target hidden states (no taps) and keeps no state; frozen, it is static under jit.
  """

  depth: int = 4
  tap_layers: tuple[int, ...] = ()
  confidence: float = 0.9

  def init_state(self, params, target_params, taps_btld, cache_size):
    return None

  def draft(self, params, target_params, target_config, state, anchor_b, context_len_b):
    vocab = target_config.vocab_size
    rest = jnp.log((1 - self.confidence) / (vocab - 1))
    token_b, rows = anchor_b, []
    for _ in range(self.depth):  # depth d guesses the successor of depth d - 1's guess
      token_b = params[token_b]
      rows.append(jnp.where(jnp.arange(vocab) == token_b[:, None], jnp.log(self.confidence),
                            rest))
    return jnp.stack(rows, axis=1)  # log-probs [B, depth, V]

  def commit(self, params, state, taps_btld, start_b):
    return state


# The table: each token's most frequent successor in a file of the standard library.
text_ids = np.array(tokenizer.encode(open(dataclasses.__file__).read()).ids)
pairs, counts = np.unique(np.stack([text_ids[:-1], text_ids[1:]]), axis=1, return_counts=True)
successor = np.zeros(config.vocab_size, np.int32)
for (first, second), _ in sorted(zip(pairs.T.tolist(), counts), key=lambda x: x[1]):
  successor[first] = second  # the most frequent pair is written last

mine = decode_prompts(target_params, config, BigramDrafter(), jnp.asarray(successor),
                      prompt_ids, 48, tree_shape=TreeShape("chain"))
print("tokens per target forward (tau):", round(mine.tau, 2))
print("tokens committed by row 0's first rounds:", mine.committed_per_round[0][:12])
print("identical to plain greedy decoding:", mine.tokens == ar.tokens)
print("stop reasons:", [str(reason) for reason in mine.stop_reasons])

# %% train
from jetflow_jax.head import init_head_params
from jetflow_jax.train.step import (LossConfig, TrainState, make_loss_fn, make_optimizer,
                                    make_train_step)

# A fresh one-layer causal head for the embedded target, trained on the target's own text.
fresh = jetflow_jax.HeadConfig.for_target(config, num_layers=1, target_layer_ids=(1, 6),
                                          mask_token_id=head_config.mask_token_id,
                                          intermediate_size=256)
# Rows of the last 4 prompt tokens + the response; the loss reads response tokens only.
tokens = np.zeros((len(prompts), 52), np.int32)
loss_mask = np.zeros(tokens.shape, bool)
for row, (prompt, response) in enumerate(zip(prompt_ids, ar.tokens)):
  sample = (prompt[-4:] + response)[:52]
  tokens[row, :len(sample)] = sample
  loss_mask[row, 4:len(sample)] = True

optimizer, schedule = make_optimizer(lr=3e-3, b1=0.9, b2=0.95, weight_decay=0.0, grad_clip=1.0,
                                     total_steps=100, warmup_frac=0.0, final_lr_frac=0.1)
loss_fn = make_loss_fn(fresh, config, LossConfig(num_anchors=8))  # forward KL by default
train_step = jax.jit(make_train_step(loss_fn, optimizer, schedule, seed=0))
params = init_head_params(fresh, jax.random.key(0))
state = TrainState(step=jnp.zeros((), jnp.int32), head_params=params,
                   opt_state=optimizer.init(params))
for _ in range(3):
  state, metrics = train_step(state, target_params, tokens, loss_mask)
  print(f"step {int(state.step)}: loss {float(metrics['loss']):.3f}, "
        f"depth-1 agreement {float(metrics['agreement_k'][0]):.2f}")
