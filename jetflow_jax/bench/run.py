"""Runs every (temperature, method, budget) cell over a prompt set, AR measured in the same run."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

from jetflow_jax.decoding import speculative_generate
from jetflow_jax.sampling import make_sampler


@dataclasses.dataclass
class Cell:
  method: str
  budget: int  # tree nodes; the chain's D + 1 for dflash, 1 for ar
  top_k: int | None  # candidate children per depth (trees only)
  temperature: float
  tau: float  # tokens committed per verifying target forward, bonus included
  num_target_forwards: int
  num_tokens: int
  wall_s: float
  tokens_per_s: float
  speedup: float  # AR wall time / this cell's, same prompts, same run
  identical_to_ar: bool | None  # greedy only


def _cell(method, budget, top_k, temperature, runs, ar_wall_s, ar_tokens) -> Cell:
  wall = sum(r.wall_s for r in runs)
  tokens = sum(r.num_tokens for r in runs)
  rounds = sum(len(c) for r in runs for c in r.committed_per_round)
  committed = sum(sum(c) for r in runs for c in r.committed_per_round)
  identical = None
  if temperature == 0 and ar_tokens is not None:
    identical = [r.tokens for r in runs] == ar_tokens
  return Cell(method=method, budget=budget, top_k=top_k, temperature=temperature,
              tau=committed / rounds if rounds else 0.0,
              num_target_forwards=sum(r.num_forwards for r in runs), num_tokens=tokens,
              wall_s=wall, tokens_per_s=tokens / wall, speedup=(ar_wall_s or wall) / wall,
              identical_to_ar=identical)


def run_benchmark(target_params, config, heads: dict, prompts: Sequence[Sequence[int]], *,
                  methods: Sequence[str], budgets: Sequence[int], temperatures: Sequence[float],
                  max_new_tokens: int, top_ks: Sequence[int] = (7,), attention: str = "xla",
                  on_run: Callable[[], None] = lambda: None):
  """Returns (cells, greedy AR tokens per prompt or None); each prompt decodes alone.

  `heads` maps each speculative method to its `(head_config, head_params)`; the tree
  methods run at every (budget, top-k) pair.
  """
  cells, greedy_ar_tokens = [], None
  for temperature in temperatures:
    sampler = make_sampler(temperature)

    def decode_all(method, budget, top_k=0):
      head_config, head_params = heads.get(method, (None, None))
      runs = []
      for seed, prompt in enumerate(prompts):
        runs.append(speculative_generate(
            target_params, config, head_params, head_config, [prompt], max_new_tokens,
            method=method, budget=budget, top_k=top_k, sampler=sampler, seed=seed,
            attention=attention, warn=lambda _: None))
        on_run()
      return runs

    ar_runs = decode_all("ar", 1)
    ar_wall = sum(r.wall_s for r in ar_runs)
    ar_tokens = [r.tokens for r in ar_runs]
    if temperature == 0:
      greedy_ar_tokens = [t[0] for t in ar_tokens]
    if "ar" in methods:
      cells.append(_cell("ar", 1, None, temperature, ar_runs, ar_wall, ar_tokens))
    for method in methods:
      if method == "dflash":
        runs = decode_all(method, 0)
        cells.append(_cell(method, heads[method][0].depth + 1, None, temperature, runs, ar_wall,
                           ar_tokens))
      elif method != "ar":
        for budget in budgets:
          for top_k in top_ks:
            runs = decode_all(method, budget, top_k)
            cells.append(_cell(method, budget, top_k, temperature, runs, ar_wall, ar_tokens))
  return cells, greedy_ar_tokens


def runs_per_benchmark(methods, budgets, top_ks, temperatures, num_prompts) -> int:
  """How many single-prompt decodes `run_benchmark` makes (for a progress bar)."""
  per_temperature = 1 + sum(1 if m == "dflash" else len(budgets) * len(top_ks)
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
