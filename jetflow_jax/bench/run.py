"""Runs every (temperature, method, budget, tree) cell over a prompt set, AR measured in the same
run.

Tree builders for the tree methods (ddtree, jetflow), named in `trees`:
  top_n  the exact top-N nodes over each depth's top-k (ours; the controlled comparison);
  accum  the reference JetFlow's best-first heap, every expanded node taking all top-k children;
  wide   the exact top-N with top-k = N - 1 (`--top-k` ignored), as DDTree's own code runs it.
An entry `METHOD:TREE` applies to that method only; `paper` stands for `top_n,ddtree:wide,
jetflow:accum`: the paper's comparison as the paper ran it, beside the controlled one.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

from jetflow_jax.decoding import TreeShape, decode_prompts, drafter_for, tree_shape_for
from jetflow_jax.decoding.policy import DEFAULT_BUDGET
from jetflow_jax.errors import InputError
from jetflow_jax.sampling import make_sampler

TREES = ("top_n", "accum", "wide")
TREE_METHODS = ("ddtree", "jetflow")
PAPER = ("top_n", "ddtree:wide", "jetflow:accum")


@dataclasses.dataclass
class Cell:
  method: str
  budget: int  # tree nodes; the chain's D + 1 for dflash, 1 for ar
  top_k: int | None  # candidate children per depth (trees only)
  tree: str | None  # the tree builder, one of TREES (trees only)
  temperature: float
  tau: float  # tokens committed per verifying target forward, bonus included
  num_target_forwards: int
  num_tokens: int
  wall_s: float
  tokens_per_s: float
  speedup: float  # AR wall time / this cell's, same prompts, same run
  identical_to_ar: bool | None  # greedy only


def parse_trees(text: str) -> tuple[tuple[str | None, str], ...]:
  """`--trees` entries as (method or None for every tree method, tree builder)."""
  items = [x.strip() for x in text.split(",") if x.strip()]
  items = [y for x in items for y in (PAPER if x == "paper" else (x,))]
  entries = []
  for item in items:
    method, _, tree = item.rpartition(":")
    if tree not in TREES or method not in ("",) + TREE_METHODS:
      raise InputError(f"--trees entries are TREE or METHOD:TREE with TREE in {', '.join(TREES)} "
                       f"and METHOD in {', '.join(TREE_METHODS)}, or 'paper' (got {item!r})")
    if (method or None, tree) not in entries:
      entries.append((method or None, tree))
  return tuple(entries)


def tree_cells(method: str, budgets, top_ks, trees) -> list[tuple[int | str, int, str]]:
  """(budget, top_k, tree) of every cell a tree method runs; budget `auto` chooses each round's
  on the ladder up to the largest fixed budget (not for wide trees: their top-k is N - 1)."""
  kinds = dict.fromkeys(t for m, t in trees if m in (None, method))
  return [(budget, top_k, tree) for budget in budgets for tree in kinds
          if not (budget == "auto" and tree == "wide")
          for top_k in ([budget - 1] if tree == "wide" else top_ks)]


def tree_shape(method: str, budget: int, top_k: int, tree: str | None) -> TreeShape:
  """The round's tree for a cell."""
  if tree == "accum":
    return TreeShape("accum", budget, top_k)
  return tree_shape_for(method, budget, top_k)  # wide is top_n at top-k N - 1


def _cell(method, budget, top_k, tree, temperature, runs, ar_wall_s, ar_tokens) -> Cell:
  wall = sum(r.wall_s for r in runs)
  tokens = sum(r.num_tokens for r in runs)
  rounds = sum(len(c) for r in runs for c in r.committed_per_round)
  committed = sum(sum(c) for r in runs for c in r.committed_per_round)
  identical = None
  if temperature == 0 and ar_tokens is not None:
    identical = [r.tokens for r in runs] == ar_tokens
  return Cell(method=method, budget=budget, top_k=top_k, tree=tree, temperature=temperature,
              tau=committed / rounds if rounds else 0.0,
              num_target_forwards=sum(r.num_forwards for r in runs), num_tokens=tokens,
              wall_s=wall, tokens_per_s=tokens / wall, speedup=(ar_wall_s or wall) / wall,
              identical_to_ar=identical)


def run_benchmark(target_params, config, heads: dict, prompts: Sequence[Sequence[int]], *,
                  methods: Sequence[str], budgets: Sequence[int], temperatures: Sequence[float],
                  max_new_tokens: int, top_ks: Sequence[int] = (7,),
                  trees: Sequence[tuple[str | None, str]] = ((None, "top_n"),),
                  attention: str = "xla", on_run: Callable[[], None] = lambda: None):
  """Returns (cells, greedy AR tokens per prompt or None); each prompt decodes alone.

  `heads` maps each speculative method to its `(head_config, head_params)`; the tree
  methods run every `tree_cells` (budget, top-k, tree), `trees` as `parse_trees` gives them.
  """
  cells, greedy_ar_tokens = [], None
  for temperature in temperatures:
    sampler = make_sampler(temperature)

    largest = max([b for b in budgets if b != "auto"], default=DEFAULT_BUDGET)

    def decode_all(method, budget, top_k=0, tree=None):
      head_config, head_params = heads.get(method, (None, None))
      drafter = drafter_for(method, config, head_params, head_config, attention,
                            warn=lambda _: None)
      auto = budget == "auto"
      runs = []
      for seed, prompt in enumerate(prompts):
        runs.append(decode_prompts(
            target_params, config, drafter, head_params, [prompt], max_new_tokens,
            tree_shape=tree_shape(method, largest if auto else budget, top_k, tree),
            sampler=sampler, seed=seed, impl=attention, auto=auto))
        on_run()
      return runs

    ar_runs = decode_all("ar", 1)
    ar_wall = sum(r.wall_s for r in ar_runs)
    ar_tokens = [r.tokens for r in ar_runs]
    if temperature == 0:
      greedy_ar_tokens = [t[0] for t in ar_tokens]
    if "ar" in methods:
      cells.append(_cell("ar", 1, None, None, temperature, ar_runs, ar_wall, ar_tokens))
    for method in methods:
      if method == "dflash":
        runs = decode_all(method, 0)
        cells.append(_cell(method, heads[method][0].depth + 1, None, None, temperature, runs,
                           ar_wall, ar_tokens))
      elif method != "ar":
        for budget, top_k, tree in tree_cells(method, budgets, top_ks, trees):
          runs = decode_all(method, budget, top_k, tree)
          cells.append(_cell(method, budget, top_k, tree, temperature, runs, ar_wall,
                             ar_tokens))
  return cells, greedy_ar_tokens


def runs_per_benchmark(methods, budgets, top_ks, temperatures, num_prompts,
                       trees=((None, "top_n"),)) -> int:
  """How many single-prompt decodes `run_benchmark` makes (for a progress bar)."""
  per_temperature = 1 + sum(1 if m == "dflash" else len(tree_cells(m, budgets, top_ks, trees))
                            for m in methods if m != "ar")
  return per_temperature * len(temperatures) * num_prompts


def transformers_peer(checkpoint: str, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      eos_token_ids: Sequence[int]) -> tuple[list[list[int]], float]:
  """Greedy `generate` of transformers (torch, CPU, float32): (tokens per prompt, wall seconds)."""
  import torch
  from transformers import AutoModelForCausalLM
  model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
  outputs, wall = [], 0.0
  with torch.no_grad():
    for prompt in prompts:
      ids = torch.tensor([list(prompt)])
      start = time.perf_counter()
      out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                           eos_token_id=list(eos_token_ids) or None,
                           pad_token_id=(list(eos_token_ids) or [0])[0])
      wall += time.perf_counter() - start
      outputs.append(out[0, ids.shape[1]:].tolist())
  return outputs, wall
