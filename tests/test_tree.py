"""Draft trees against a brute-force enumeration of the whole per-depth top-k tree."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetflow_jax.errors import InputError
from jetflow_jax.tree import (MAX_NODES, build_tree, chain_tree, max_tree_nodes,
                              validate_tree_args)

jit_build = jax.jit(build_tree, static_argnames=("budget", "top_k"))


def full_tree(logprobs_dv, top_k):
  """Every node of the depth-D top-k tree as levels of (score, token path), best first.

  Scores are float32 sums in path order, exactly as build_tree adds them; the stable sort keeps
  equal scores in (parent rank, child rank) order, the tie-break build_tree promises.
  """
  logprobs_dv = np.asarray(logprobs_dv, np.float32)
  levels = [[(np.float32(0.0), ())]]
  for row in logprobs_dv:
    best = np.argsort(-row, kind="stable")[:top_k]
    children = [(score + row[t], path + (int(t),)) for score, path in levels[-1] for t in best]
    levels.append(sorted(children, key=lambda c: -c[0]))
  return levels


def reference_tree(logprobs_dv, budget, top_k):
  """(tokens, parents, depths, scores) of the best `budget` nodes by (score, depth, rank)."""
  levels = full_tree(logprobs_dv, top_k)
  ranked = sorted((-score, depth, rank, path) for depth, level in enumerate(levels)
                  for rank, (score, path) in enumerate(level))
  kept = sorted(ranked[:budget], key=lambda r: (r[1], r[2]))
  index = {path: i for i, (_, _, _, path) in enumerate(kept)}
  return (np.array([path[-1] if path else 0 for *_, path in kept]),
          np.array([index[path[:-1]] if path else -1 for *_, path in kept]),
          np.array([depth for _, depth, _, _ in kept]),
          np.array([-neg for neg, *_ in kept], np.float32))


def walk_ancestors(parents_n):
  """Ancestor mask built by following parent pointers in Python."""
  n = len(parents_n)
  mask = np.zeros((n, n), bool)
  for i in range(n):
    j = i
    while j >= 0:
      mask[i, j] = True
      j = parents_n[j]
  return mask


def log_softmax(logits):
  """float32 log-softmax over the last axis; -inf logits stay -inf (whole rows included)."""
  with np.errstate(divide="ignore", invalid="ignore"):
    top = np.max(logits, axis=-1, keepdims=True)
    shifted = logits - np.where(np.isfinite(top), top, 0)
    out = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  return np.where(np.isneginf(logits), -np.inf, out).astype(np.float32)


def random_logprobs(seed, batch, depth, vocab, scale=2.0):
  return log_softmax(np.random.default_rng(seed).normal(size=(batch, depth, vocab)) * scale)


def assert_matches_reference(tree, logprobs_bdv, budget, top_k):
  """Exact agreement with the reference, and optimal scores whatever the tie-break."""
  for b, logprobs_dv in enumerate(logprobs_bdv):
    tokens, parents, depths, scores = reference_tree(logprobs_dv, budget, top_k)
    np.testing.assert_array_equal(np.asarray(tree.tokens[b]), tokens)
    np.testing.assert_array_equal(np.asarray(tree.parents[b]), parents)
    np.testing.assert_array_equal(np.asarray(tree.depths[b]), depths)
    np.testing.assert_allclose(np.asarray(tree.scores[b]), scores, atol=1e-5)
    all_scores = np.array([s for level in full_tree(logprobs_dv, top_k) for s, _ in level])
    best = np.sort(all_scores)[::-1][:budget]
    np.testing.assert_allclose(np.sort(np.asarray(tree.scores[b]))[::-1], best, atol=1e-5)


def assert_well_formed(tree, logprobs_bdv):
  batch, n = tree.tokens.shape
  assert tree.tokens.dtype == tree.parents.dtype == tree.depths.dtype == jnp.int32
  assert tree.scores.dtype == jnp.float32 and tree.ancestor_mask.dtype == jnp.bool_
  assert tree.ancestor_mask.shape == (batch, n, n)
  tokens, parents, depths, scores, mask = (np.asarray(x) for x in (
      tree.tokens, tree.parents, tree.depths, tree.scores, tree.ancestor_mask))
  for b in range(batch):
    assert parents[b, 0] == -1 and depths[b, 0] == 0 and tokens[b, 0] == 0 and scores[b, 0] == 0
    child = np.arange(1, n)
    parent = parents[b, 1:]
    assert np.all((parent >= 0) & (parent < child))
    np.testing.assert_array_equal(depths[b, 1:], depths[b, parent] + 1)
    step = logprobs_bdv[b, depths[b, 1:] - 1, tokens[b, 1:]]
    np.testing.assert_allclose(scores[b, 1:], scores[b, parent] + step, atol=1e-5)
    siblings = list(zip(parent.tolist(), tokens[b, 1:].tolist()))
    assert len(set(siblings)) == len(siblings)
    np.testing.assert_array_equal(mask[b], walk_ancestors(parents[b]))
    assert mask[b, 0].sum() == 1
    # Emitted by depth, so each depth is one contiguous run.
    assert np.all(np.diff(depths[b]) >= 0)


# Every test runs [BATCH, D, VOCAB] inputs through these (D, top_k, budget) so the jitted
# build_tree compiles once per combination: budgets from 2 to the whole tree, K = 1 to 4, and
# K = the whole vocabulary, wider than the N - 1 children a kept node can have.
BATCH, VOCAB = 4, 8
COMBOS = [(1, 3, 2), (1, 4, 5), (2, 2, 7), (2, 4, 12), (2, 8, 6), (3, 1, 4), (3, 2, 9),
          (3, 3, 20), (4, 2, 31), (4, 3, 50), (4, 4, 120)]


@pytest.mark.parametrize("depth,top_k,budget", COMBOS)
def test_matches_brute_force(depth, top_k, budget):
  logprobs = random_logprobs(depth * 100 + top_k * 10 + budget, BATCH, depth, VOCAB)
  tree = jit_build(logprobs, budget=budget, top_k=top_k)
  assert_well_formed(tree, logprobs)
  assert_matches_reference(tree, logprobs, budget, top_k)
  for b in range(BATCH):
    levels = full_tree(logprobs[b], top_k)
    nodes = sorted(((s, path) for level in levels for s, path in level), key=lambda n: -n[0])
    if len({s for s, _ in nodes}) == len(nodes):  # no ties: the set of paths is unique
      want = {path for _, path in nodes[:budget]}
      got = set()
      parents, tokens = np.asarray(tree.parents[b]), np.asarray(tree.tokens[b])
      for i in range(budget):
        path, j = [], i
        while j > 0:
          path.append(int(tokens[j]))
          j = parents[j]
        got.add(tuple(reversed(path)))
      assert got == want


def test_a_flat_first_depth_fills_the_budget_with_the_roots_children():
  # Depth 1 nearly uniform, depth 2 unlikely: the best 8 nodes are the root and its 7 best
  # children, as wide as any kept node's children get; top-k 7 and the whole vocab agree.
  first = np.log(np.full(8, 1 / 8)) - np.arange(8) * 1e-3
  logprobs = np.stack([first, np.full(8, -10.0)])[None].astype(np.float32)
  for top_k in (7, 8):
    tree = jit_build(logprobs, budget=8, top_k=top_k)
    np.testing.assert_array_equal(tree.depths[0], [0] + [1] * 7)
    np.testing.assert_array_equal(tree.tokens[0, 1:], np.arange(7))


def test_structure_of_a_large_tree():
  logprobs = random_logprobs(7, 2, 6, vocab=40)
  assert_well_formed(jit_build(logprobs, budget=200, top_k=5), logprobs)


def tie_logprobs():
  """Rows of exact zeros, of equal values (uniform), and of a few repeated values."""
  zeros = np.zeros((4, VOCAB), np.float32)
  uniform = np.full((4, VOCAB), -np.log(VOCAB), np.float32)
  repeated = np.asarray(np.random.default_rng(3).integers(-2, 1, size=(4, VOCAB)), np.float32)
  mixed = np.stack([zeros[0], uniform[0], repeated[0], zeros[0]])
  return np.stack([zeros, uniform, repeated, mixed])


@pytest.mark.parametrize("depth,top_k,budget", [(4, 2, 31), (4, 3, 50), (4, 4, 120)])
def test_ties_are_exact_and_deterministic(depth, top_k, budget):
  logprobs = tie_logprobs()
  first = jit_build(logprobs, budget=budget, top_k=top_k)
  second = jit_build(logprobs, budget=budget, top_k=top_k)
  flipped = jit_build(logprobs[::-1], budget=budget, top_k=top_k)  # rows are independent
  for a, b, c in zip(*(jax.tree.leaves(t) for t in (first, second, flipped))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c)[::-1])
  assert_well_formed(first, logprobs)
  assert_matches_reference(first, logprobs, budget, top_k)


def test_minus_inf_logprobs_give_a_well_formed_tree():
  logits = np.random.default_rng(5).normal(size=(BATCH, 4, VOCAB)).astype(np.float32)
  logits[0, :, 2:] = -np.inf  # two live tokens per depth, but top-3 asked for
  logits[1, 1, 1:] = -np.inf  # one live token at depth 2
  logits[2, 0, :] = -np.inf  # nothing live at depth 1 (not a distribution, but must not break)
  logprobs = log_softmax(logits)
  tree = jit_build(logprobs, budget=50, top_k=3)
  again = jit_build(logprobs, budget=50, top_k=3)
  for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(again)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for b in range(BATCH):
    np.testing.assert_array_equal(np.asarray(tree.ancestor_mask[b]),
                                  walk_ancestors(np.asarray(tree.parents[b])))
  assert np.all(np.asarray(tree.parents[:, 1:]) < np.arange(1, 50))
  assert_matches_reference(tree, logprobs, 50, 3)


def test_jit_shapes_are_static():
  logprobs = random_logprobs(9, BATCH, 4, VOCAB)
  abstract = jax.eval_shape(functools.partial(build_tree, budget=50, top_k=3),
                            jax.ShapeDtypeStruct(logprobs.shape, jnp.float32))
  eager = build_tree(logprobs, 50, 3)
  jitted = jit_build(logprobs, budget=50, top_k=3)
  assert abstract.ancestor_mask.shape == (BATCH, 50, 50)
  for a, e, j in zip(jax.tree.leaves(abstract), jax.tree.leaves(eager), jax.tree.leaves(jitted)):
    assert a.shape == e.shape == j.shape and a.dtype == e.dtype == j.dtype
    np.testing.assert_array_equal(np.asarray(e), np.asarray(j))


def test_chain_tree():
  logprobs = random_logprobs(11, BATCH, 3, VOCAB)
  chain = chain_tree(logprobs)
  np.testing.assert_array_equal(np.asarray(chain.tokens[:, 1:]), logprobs.argmax(-1))
  np.testing.assert_array_equal(np.asarray(chain.parents), np.tile(np.arange(-1, 3), (BATCH, 1)))
  np.testing.assert_array_equal(np.asarray(chain.depths), np.tile(np.arange(4), (BATCH, 1)))
  np.testing.assert_array_equal(np.asarray(chain.ancestor_mask[1]), np.tril(np.ones((4, 4), bool)))
  np.testing.assert_allclose(np.asarray(chain.scores[:, 1:]),
                             np.cumsum(logprobs.max(-1), axis=1), atol=1e-5)
  assert_well_formed(chain, logprobs)
  same = jit_build(logprobs, budget=4, top_k=1)  # a top-1 tree of D + 1 nodes is the chain
  for a, b in zip(jax.tree.leaves(chain), jax.tree.leaves(same)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_max_tree_nodes():
  assert max_tree_nodes(3, 2) == 15
  assert max_tree_nodes(15, 1) == 16
  assert max_tree_nodes(0, 7) == 1
  assert max_tree_nodes(2, 10) == 111
  assert max_tree_nodes(15, 151936) == MAX_NODES


@pytest.mark.parametrize("depth,vocab,budget,top_k,message", [
    (3, 10, 1, 2, "budget must be >= 2"),
    (3, 10, 0, 2, "budget must be >= 2"),
    (3, 10, 4, 0, "top_k must be >= 1"),
    (3, 10, 4, 11, "top_k 11 exceeds the vocabulary of 10"),
    (3, 10, 16, 2, "budget 16 exceeds the 15 nodes a depth-3 tree with top-k 2"),
    (4, 10, 6, 1, "budget 6 exceeds the 5 nodes a depth-4 tree with top-k 1"),
])
def test_bad_arguments(depth, vocab, budget, top_k, message):
  with pytest.raises(InputError, match=message):
    validate_tree_args(depth, vocab, budget, top_k)
  with pytest.raises(InputError, match=message):
    build_tree(np.zeros((1, depth, vocab), np.float32), budget, top_k)


def test_bad_logprob_rank():
  with pytest.raises(InputError, match=r"\[batch, depth, vocab\]"):
    build_tree(np.zeros((3, 10), np.float32), 4, 2)
