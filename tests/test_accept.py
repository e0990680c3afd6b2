"""Vectorised acceptance against a Python walk down the tree."""

import jax
import numpy as np

from jetflow_jax.accept import accept
from jetflow_jax.tree import build_tree


def walk(tokens, parents, choices):
  """The accepted path by following, from the root, the child holding the target's choice."""
  path = [0]
  while True:
    children = [i for i in range(len(tokens)) if parents[i] == path[-1]]
    nxt = [i for i in children if tokens[i] == choices[path[-1]]]
    if not nxt:
      return path
    path.append(nxt[0])


def test_accept_equals_a_walk_on_random_trees():
  rng = np.random.default_rng(0)
  depth, vocab, budget = 5, 6, 24
  logprobs = jax.nn.log_softmax(rng.normal(size=(64, depth, vocab)) * 2, axis=-1)
  tree = build_tree(logprobs, budget, 3)
  tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
  # Choices that often match a child, so paths of every length occur.
  choices = np.where(rng.random((64, budget)) < 0.7,
                     tokens[np.arange(64)[:, None], rng.integers(0, budget, (64, budget))],
                     rng.integers(0, vocab, (64, budget)))
  path, accepted_depth, emitted = map(np.asarray, accept(tree, choices, depth))
  lengths = set()
  for b in range(64):
    want = walk(tokens[b], parents[b], choices[b])
    lengths.add(len(want))
    assert accepted_depth[b] == len(want) - 1
    assert path[b, :len(want)].tolist() == want
    # Emitted: the accepted draft tokens, then the bonus (the choice at the deepest node).
    assert emitted[b, :len(want)].tolist() == [tokens[b, i] for i in want[1:]] + [
        choices[b, want[-1]]]
  assert len(lengths) >= 3
