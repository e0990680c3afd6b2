"""A draft vocabulary from the training data: the K target tokens its responses use most.

Counted over response tokens only (the ones a head predicts), ties broken by the lower id, so
tokens the responses never use fill up from id 0; the ids come out sorted, as speculators'
`d2t` expects. The head then predicts over those K with the target's LM-head rows for them,
trained by forward KL against the target's distribution renormalised over the same K
(`train/step.py`).
"""

from __future__ import annotations

import numpy as np

from jetflow_jax.train.store import TokenStore


def response_token_counts(store: TokenStore, vocab_size: int,
                          chunk_tokens: int = 1 << 24) -> np.ndarray:
  """How often each token id occurs in the store's responses, `[vocab_size]` int64."""
  counts = np.zeros(vocab_size, np.int64)
  pending, size = [], 0
  for record in range(store.num_records):
    response = store.tokens(record)[store.prompt_lengths[record]:]
    pending.append(response)
    size += len(response)
    if size >= chunk_tokens or record == store.num_records - 1:
      counts += np.bincount(np.concatenate(pending), minlength=vocab_size)[:vocab_size]
      pending, size = [], 0
  return counts


def most_frequent(counts: np.ndarray, k: int) -> np.ndarray:
  """The `k` most counted ids (ties: the lower id first), ascending."""
  order = np.lexsort((np.arange(len(counts)), -counts))
  return np.sort(order[:k]).astype(np.int32)
