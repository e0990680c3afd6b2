"""What a trained head expects of itself: per round, the tokens greedy verification commits and
the tokens its drafts predict, at every tree budget, measured on held-out text.

`--budget auto` starts a target the head has never drafted for from it
(`decoding.budget.AcceptancePrior`, through `HeadDrafter.acceptance_prior`) instead of from AR
and a look at a tree. It is measured as a greedy decode would meet it: at sampled anchors of the
target's own greedy continuations the head drafts with the true context (what a greedy decode
has committed there), the round's tree is built at the largest budget (the top-n tree over each
depth's top-k tokens), and at every budget n its top-n nodes by score are read twice: what they
predict (`expected_tau`: the sum of their path probabilities) and what verification commits (the
deepest node on the continuation, plus the bonus token). Kept beside the head's weights as
`acceptance.json`; `head_checkpoint.load_head` puts it in `HeadConfig.acceptance`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jetflow_jax.decoding.budget import AcceptancePrior, expected_tau
from jetflow_jax.decoding.policy import DEFAULT_TOP_K
from jetflow_jax.errors import InputError
from jetflow_jax.head import to_target_ids, training_logits
from jetflow_jax.model import forward
from jetflow_jax.tree import DraftTree, build_tree, max_tree_nodes

ACCEPTANCE_FILE = "acceptance.json"
MAX_BUDGET = 256  # the ladder's largest (`decoding.budget.LADDER`)


@dataclasses.dataclass(frozen=True)
class HeadAcceptance:
  """Per round, greedy, at every budget n = 1..len(tau_n) of the top-n tree over each depth's
  top-`top_k` tokens: the tokens committed (`tau_n`, bonus included) and predicted
  (`predicted_n`), averaged over `anchors` held-out anchors."""

  tau_n: tuple[float, ...]
  predicted_n: tuple[float, ...]
  top_k: int = DEFAULT_TOP_K
  anchors: int = 0

  def prior(self, ladder) -> AcceptancePrior:
    """The `AcceptancePrior` at these ladder budgets (past the largest measured: its values,
    which a head's depth has long saturated)."""
    index_l = np.minimum(np.asarray(ladder), len(self.tau_n)) - 1
    return AcceptancePrior(tau_l=np.asarray(self.tau_n)[index_l],
                           predicted_l=np.asarray(self.predicted_n)[index_l])

  def summary(self, budgets=(4, 16, 64)) -> str:
    """One line: tokens committed / predicted per greedy round at each of `budgets`."""
    return "per greedy round, tokens committed / predicted at budget " + ", ".join(
        f"{n} {self.tau_n[n - 1]:.2f} / {self.predicted_n[n - 1]:.2f}"
        for n in budgets if n <= len(self.tau_n)) + f" ({self.anchors} anchors)"

  def save(self, directory: str) -> None:
    with open(os.path.join(directory, ACCEPTANCE_FILE), "w") as f:
      json.dump(dataclasses.asdict(self), f, indent=1)


def load_acceptance(directory: str) -> HeadAcceptance | None:
  """The head's `acceptance.json` in `directory`; None where there is none, and, with a warning,
  where it cannot be read (a prior: decoding goes on without it)."""
  path = os.path.join(directory, ACCEPTANCE_FILE)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      raw = json.load(f)
    found = HeadAcceptance(tau_n=tuple(map(float, raw["tau_n"])),
                           predicted_n=tuple(map(float, raw["predicted_n"])),
                           top_k=int(raw["top_k"]), anchors=int(raw["anchors"]))
    found.prior((1, len(found.tau_n)))  # the checks an AcceptancePrior makes
    return found
  except (OSError, ValueError, KeyError, TypeError, IndexError, InputError) as e:
    warnings.warn(f"ignoring {path}: {e}")
    return None


def committed_by_budget(tree: DraftTree, truth_bd) -> jax.Array:
  """`[B, N]`: what greedy verification of the top-n nodes by score commits, n = 1..N, when
  the target continues each row with `truth_bd` (its tokens at depths 1..D), bonus included."""
  depth = truth_bd.shape[1]
  depths_bn = tree.depths
  truth_bn = jnp.take_along_axis(truth_bd, jnp.clip(depths_bn - 1, 0, depth - 1), axis=1)
  matches_bn = (tree.tokens == truth_bn) | (depths_bn == 0)
  on_bn = depths_bn == 0  # the root; then each depth's nodes whose parent is on the path
  for _ in range(depth):
    parent_on_bn = jnp.take_along_axis(on_bn, jnp.maximum(tree.parents, 0), axis=1)
    on_bn = matches_bn & ((depths_bn == 0) | parent_on_bn)
  order_bn = jnp.argsort(-tree.scores, axis=1, stable=True)  # as `expected_tau` ranks them
  reached_bn = jnp.take_along_axis(jnp.where(on_bn, depths_bn, 0), order_bn, axis=1)
  return 1 + jax.lax.cummax(reached_bn, axis=1)


@functools.partial(jax.jit, static_argnames=("head_config", "target_config", "budget", "top_k"))
def _round_stats(head_params, head_config, target_params, target_config, tokens_bt, anchors_ba,
                 budget: int, top_k: int):
  """(predicted, committed) `[B * A, budget]` at every budget, for each anchor's round."""
  _, _, taps_btld = forward(target_params, target_config, tokens_bt,
                            tap_layers=head_config.target_layer_ids)
  logits_bakv = training_logits(head_params, head_config, target_params, target_config, taps_btld,
                                tokens_bt, anchors_ba)
  *_, depth, vocab = logits_bakv.shape
  tree = build_tree(jax.nn.log_softmax(logits_bakv, -1).reshape(-1, depth, vocab), budget, top_k)
  tree = dataclasses.replace(tree, tokens=to_target_ids(head_params, head_config, tree.tokens))
  predicted_bn = expected_tau(tree, range(1, budget + 1))
  after_bad = anchors_ba[..., None] + 1 + jnp.arange(depth)
  truth_bad = jnp.take_along_axis(tokens_bt[:, None, :], after_bad, axis=2)
  return predicted_bn, committed_by_budget(tree, truth_bad.reshape(-1, depth))


def measure_acceptance(head_params, head_config, target_params, target_config,
                       continuations, anchors_per_row: int = 32, budget: int = MAX_BUDGET,
                       top_k: int = DEFAULT_TOP_K) -> HeadAcceptance:
  """The head's `HeadAcceptance` on the target's continuations of held-out prompts.

  Args:
    continuations: `(prompt_ids, response_ids)` pairs: the target's greedy continuation of
      prompts neither model trained on.
    anchors_per_row: anchors taken evenly along each response, every one with a full draft
      depth of response after it.
    budget: the largest tree measured.
    top_k: each depth's candidate tokens, as the decode's tree has them.

  Raises:
    ValueError: no response long enough for one full-depth anchor.
  """
  depth = head_config.depth
  budget = min(budget, max_tree_nodes(depth, min(top_k, head_config.output_vocab_size)))
  rows, anchors = [], []
  for prompt, response in continuations:
    if len(response) < depth + 1:
      continue
    tokens = list(prompt) + list(response)
    # A decode's first round anchors at the first response token (the prefill's).
    anchors.append(np.linspace(len(prompt), len(tokens) - 1 - depth,
                               anchors_per_row).round().astype(np.int32))
    rows.append(tokens)
  if not rows:
    raise ValueError(f"no continuation is long enough for a depth-{depth} draft")
  width = max(map(len, rows))
  predicted, committed = [], []
  for tokens, anchors_a in zip(rows, anchors):  # one row at a time: one compiled shape
    tokens_bt = jnp.asarray(np.pad(tokens, (0, width - len(tokens)))[None], jnp.int32)
    predicted_bn, committed_bn = _round_stats(head_params, head_config, target_params,
                                              target_config, tokens_bt,
                                              jnp.asarray(anchors_a[None]), budget, top_k)
    predicted.append(np.asarray(predicted_bn))
    committed.append(np.asarray(committed_bn))
  predicted, committed = np.concatenate(predicted), np.concatenate(committed)
  return HeadAcceptance(tau_n=tuple(np.round(committed.mean(0), 4).tolist()),
                        predicted_n=tuple(np.round(predicted.mean(0), 4).tolist()),
                        top_k=top_k, anchors=len(committed))
