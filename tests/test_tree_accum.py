"""The reference's `accum_logp` tree against a plain heapq port of it, and decoding with it."""

import dataclasses
import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetflow_jax
from jetflow_jax.decoding import TreeShape, decode_prompts, generate
from jetflow_jax.errors import InputError
from jetflow_jax.tree import build_tree_accum, chain_tree
from test_speculative import CheatingDrafter

jit_accum = jax.jit(build_tree_accum, static_argnames=("budget", "top_k"))


def heap_tree(logprobs_dv, budget, top_k):
  """(tokens, parents, depths, scores): the reference's heap, with float32 sums as ours.

  Heap entries are (-score, insertion counter); a node's index is its insertion counter. Each
  depth's top-k is sorted by log-prob, lower token id first on ties.
  """
  logprobs_dv = np.asarray(logprobs_dv, np.float32)
  ranked = [np.argsort(-row, kind="stable")[:top_k] for row in logprobs_dv]
  tokens, parents, depths, scores = [0], [-1], [0], [np.float32(0.0)]
  heap = [(0.0, 0)]
  while heap and len(tokens) < budget:
    _, node = heapq.heappop(heap)
    depth = depths[node]
    if depth >= len(logprobs_dv):
      continue
    for token in ranked[depth][:budget - len(tokens)]:
      score = np.float32(scores[node] + logprobs_dv[depth, token])
      tokens.append(int(token))
      parents.append(node)
      depths.append(depth + 1)
      scores.append(score)
      heapq.heappush(heap, (-float(score), len(tokens) - 1))
  return (np.array(tokens), np.array(parents), np.array(depths),
          np.array(scores, np.float32))


def grid_logprobs(seed, batch, depth, vocab):
  """Log-probs on a grid of 0.5 steps: sums are exact, so equal path scores abound."""
  rng = np.random.default_rng(seed)
  return (-0.5 * rng.integers(0, 5, size=(batch, depth, vocab))).astype(np.float32)


def random_logprobs(seed, batch, depth, vocab):
  logits = np.random.default_rng(seed).normal(size=(batch, depth, vocab)) * 2
  return np.asarray(jax.nn.log_softmax(logits, axis=-1), np.float32)


def assert_matches_heap(tree, logprobs_bdv, budget, top_k):
  for b, logprobs_dv in enumerate(logprobs_bdv):
    tokens, parents, depths, scores = heap_tree(logprobs_dv, budget, top_k)
    np.testing.assert_array_equal(np.asarray(tree.tokens[b]), tokens)
    np.testing.assert_array_equal(np.asarray(tree.parents[b]), parents)
    np.testing.assert_array_equal(np.asarray(tree.depths[b]), depths)
    np.testing.assert_array_equal(np.asarray(tree.scores[b]), scores)
    mask = np.zeros((budget, budget), bool)
    for i in range(budget):
      j = i
      while j >= 0:
        mask[i, j], j = True, parents[j]
    np.testing.assert_array_equal(np.asarray(tree.ancestor_mask[b]), mask)


# (depth, top_k, budget): one expansion only, cut-short last expansions, whole trees, K = vocab.
COMBOS = [(1, 3, 2), (1, 8, 9), (2, 2, 7), (3, 1, 4), (3, 2, 9), (3, 3, 20), (4, 2, 31),
          (4, 3, 50), (4, 7, 64), (5, 3, 100), (6, 8, 64)]


@pytest.mark.parametrize("depth,top_k,budget", COMBOS)
def test_matches_the_heap(depth, top_k, budget):
  seed = depth * 100 + top_k * 10 + budget
  logprobs = np.concatenate([random_logprobs(seed, 3, depth, 8), grid_logprobs(seed, 5, depth, 8)])
  assert_matches_heap(jit_accum(logprobs, budget=budget, top_k=top_k), logprobs, budget, top_k)


def test_ties_across_depths_follow_the_heap_counter():
  # Depth 1: A (-0.1), P (-1.0); depth 2: 0 and -0.5; depth 3: -0.4. A's second child A1
  # (-0.6) pops before P, so A1's child (node 11, -1.0, depth 3) pops before P's first child
  # (node 13, -1.0, depth 2): the heap breaks the tie by whose parent popped first, not by
  # depth, and from budget 16 on the trees differ.
  logprobs = np.full((1, 4, 4), -9.0, np.float32)
  logprobs[0, :, :2] = [[-0.1, -1.0], [0.0, -0.5], [-0.4, -0.45], [-0.2, -0.3]]
  for budget in (15, 16, 21):
    tree = jit_accum(logprobs, budget=budget, top_k=2)
    assert_matches_heap(tree, logprobs, budget, 2)
  assert tree.depths[0, 11] == 3 and tree.depths[0, 13] == 2 and tree.parents[0, 15] == 11


def test_exact_zeros_and_uniform_rows():
  zeros = np.zeros((1, 4, 6), np.float32)
  uniform = np.full((1, 4, 6), -np.log(6), np.float32)
  logprobs = np.concatenate([zeros, uniform, -zeros])
  assert_matches_heap(jit_accum(logprobs, budget=40, top_k=3), logprobs, 40, 3)


def test_prefix_of_a_larger_budget_and_top_1_is_the_chain():
  logprobs = random_logprobs(3, 4, 5, 16)
  big = jit_accum(logprobs, budget=60, top_k=4)
  for budget in (2, 9, 33):
    small = jit_accum(logprobs, budget=budget, top_k=4)
    for a, b in zip(jax.tree.leaves(small), jax.tree.leaves(big)):
      if a.ndim == 3:
        b = b[:, :budget, :budget]
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[:, :budget])
  chain = jit_accum(logprobs, budget=6, top_k=1)
  for a, b in zip(jax.tree.leaves(chain), jax.tree.leaves(chain_tree(logprobs))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_bad_arguments():
  with pytest.raises(InputError, match="budget 16 exceeds the 15 nodes"):
    build_tree_accum(np.zeros((1, 3, 10), np.float32), 16, 2)
  with pytest.raises(InputError, match="top_k must be >= 1"):
    TreeShape("accum", 8, 0).validate(ReferenceDrafter(depth=3), type("C", (), {"vocab_size": 10}))


@dataclasses.dataclass(frozen=True)
class ReferenceDrafter(CheatingDrafter):
  """Drafts a known continuation (its params: `[B, S]` tokens) and two equal runners-up."""

  def draft(self, params, target_params, target_config, state, anchor_b, context_len_b):
    next_bd = self.known(params, context_len_b)
    vocab = target_config.vocab_size
    logits_bdv = 8.0 * jax.nn.one_hot(next_bd, vocab)
    for shift in (1, 2):  # ties inside the tree, the drafted token still on top
      logits_bdv += 2.0 * jax.nn.one_hot((next_bd + shift) % vocab, vocab)
    return jax.nn.log_softmax(logits_bdv, axis=-1)


PROMPTS = [[5, 17, 3, 88, 40], [9, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11], [60, 61, 62]]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
  from conftest import make_hf_model
  directory = str(tmp_path_factory.mktemp("target"))
  make_hf_model(num_hidden_layers=2, vocab_size=96).save_pretrained(directory)
  return jetflow_jax.load_qwen3(directory)


def test_greedy_with_the_accum_tree_equals_ar(target):
  config, params = target
  reference = generate(params, config, PROMPTS, 24, stop_tokens=()).tokens
  # Rows 0 and 1 draft the AR continuation, row 2 random tokens: long and rejected paths.
  ref_bs = np.random.default_rng(0).integers(0, config.vocab_size, (3, 48)).astype(np.int32)
  for b, (p, r) in enumerate(zip(PROMPTS[:2], reference)):
    ref_bs[b, :len(p) + len(r)] = p + r
  result = decode_prompts(params, config, ReferenceDrafter(depth=4), jnp.asarray(ref_bs),
                          PROMPTS, 24, tree_shape=TreeShape("accum", 16, 3), stop_tokens=())
  assert result.tokens == reference
  tau_b = [sum(c) / len(c) for c in result.committed_per_round]
  assert tau_b[0] > 4 and tau_b[1] > 4 and tau_b[2] < 2
