"""The budget chooser fed the H200 cost table, simulated: the budget it picks by busy rows and draft.

  python bench/chooser_sim.py                 # writes bench/results/chooser_sim_h200.json
  python bench/chooser_sim.py --mfu 0.4 --rounds 1000

Cost table, Qwen3-8B shapes, bf16, 4,096 committed tokens, from
bench/results/gpu/step_costs_qwen3-8b_h200.json (one row, pallas attention):
  measured  a whole round (head, tree, verify, accept, commit) at N = 64 and N = 256;
  modelled  one row at the other ladder budgets: linear in N through those two rounds;
            AR: the pallas verify extrapolated the same way to one node (the measured AR step,
            25.3 ms, ran XLA attention over the whole cache buffer; this is the cheaper AR);
            B rows: a round's fixed part (the measured time less its one-row roofline) plus
            max(memory, compute) for B rows: weights once and every row's KV at 4.8 TB/s;
            B x (N tree tokens + the head's block) of FLOPs at `--mfu` x 790 TFLOP/s.
Drafts are synthetic: each depth's distribution has top-1 probability q and a geometric tail;
q is set so the mean row's true tau at N = 256 is about 4, 8 or 10. A row's draft predicts
`expected_tau` of its tree; the row truly accepts a fixed fraction (0.75-1.05) of the predicted
gain, q moves a little every round, and accepted counts are binomial draws with the true mean.
Every round the chooser picks one budget from the `AcceptanceModel` estimates; the best fixed
budget is the one with the most expected tokens/s under the true taus.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's jetflow_jax

import jax
import numpy as np

from jetflow_jax.decoding.budget import (LADDER, AcceptanceModel, CostTable, choose_budget,
                                         cost_key, draft_expected_tau)

PEAK_FLOPS, HBM_BYTES_S = 790e12, 4.8e12  # H200: dense bf16, HBM bandwidth
DEPTH, TOP_K, VOCAB = 15, 7, 64
MEASURED = os.path.join(ROOT, "bench/results/gpu/step_costs_qwen3-8b_h200.json")


def shapes(config: dict, head: dict, context: int) -> dict:
  """FLOPs per token and bytes per round of the target and head (matmuls and attention)."""
  def layer_params(c):
    q = c["hidden_size"] * c["num_attention_heads"] * c["head_dim"]
    kv = 2 * c["hidden_size"] * c["num_key_value_heads"] * c["head_dim"]
    return 2 * q + kv + 3 * c["hidden_size"] * c["intermediate_size"]

  def attention_flops(c, layers):
    return 4 * layers * context * c["num_attention_heads"] * c["head_dim"]

  def kv_bytes(c, layers):
    return 2 * 2 * layers * context * c["num_key_value_heads"] * c["head_dim"]

  lm_head = config["vocab_size"] * config["hidden_size"]
  target = config["num_hidden_layers"] * layer_params(config) + lm_head
  head_layers = head["num_layers"] * layer_params(head)
  block = head["block_size"]
  return {
      "target_flops_per_token": 2 * target + attention_flops(config, config["num_hidden_layers"]),
      "head_flops_per_row": block * (2 * head_layers + attention_flops(head, head["num_layers"]))
                            + (block - 1) * 2 * lm_head,
      "target_weight_bytes": 2 * target, "head_weight_bytes": 2 * (head_layers + lm_head),
      "kv_bytes_per_row": kv_bytes(config, config["num_hidden_layers"])
                          + kv_bytes(head, head["num_layers"])}


def h200_cost_table(mfu: float, rows=(1, 8, 32)) -> CostTable:
  """The cost table the module docstring describes, every entry tagged measured or modelled."""
  with open(MEASURED) as f:
    record = json.load(f)
  [(context, length)] = record["lengths"].items()
  ms = {name: piece["ms"] for name, piece in length["pieces"].items()}
  s = shapes(record["config"], record["head_config"], int(context))

  def line(key):  # (ms at N = 0, ms per node) through the two measured budgets
    slope = (ms[f"{key}/256"] - ms[f"{key}/64"]) / 192
    return ms[f"{key}/64"] - 64 * slope, slope

  def roofline_ms(busy, nodes, head):
    weights = s["target_weight_bytes"] + (s["head_weight_bytes"] if head else 0)
    memory = (weights + busy * s["kv_bytes_per_row"]) / HBM_BYTES_S
    flops = busy * (nodes * s["target_flops_per_token"] + (s["head_flops_per_row"] if head else 0))
    return 1e3 * max(memory, flops / (PEAK_FLOPS * mfu))

  round0, round_slope = line("round/pallas")
  verify0, verify_slope = line("verify/pallas")
  seconds = {"ar": {}, "jetflow": {}}
  source = {"ar": {}, "jetflow": {}}
  for n in LADDER:
    head = n > 1
    one_row = verify0 + verify_slope if n == 1 else round0 + round_slope * n
    fixed = one_row - roofline_ms(1, n, head)
    method = "jetflow" if head else "ar"
    seconds[method][n] = tuple(1e-3 * (fixed + roofline_ms(b, n, head)) for b in rows)
    measured = n in (64, 256)
    source[method][n] = tuple("measured" if measured and b == 1 else "modelled" for b in rows)
  key = cost_key(record["device"], type("Target", (), record["config"])(),
                 type("Head", (), record["head_config"])(), slots=max(rows), dtype="bfloat16")
  notes = (f"Qwen3-8B shapes at {context} committed tokens, pallas attention. Measured: rounds "
           f"at N=64 ({ms['round/pallas/64']:.2f} ms) and N=256 ({ms['round/pallas/256']:.2f} ms),"
           f" one row. Modelled: other budgets linear in N; AR as a 1-node pallas verify (the "
           f"measured XLA AR step is {ms['ar_step']:.1f} ms); more rows as fixed part + "
           f"max(HBM, FLOPs at {mfu:.0%} of 790 TFLOP/s).")
  return CostTable(key=key, rows=tuple(rows), seconds=seconds, source=source, notes=notes)


def draft_logprobs(q_s) -> np.ndarray:
  """Per-depth log-probs `[S, D, V]`: top-1 probability q, the rest a geometric tail."""
  tail_v = 0.6 ** np.arange(VOCAB - 1)
  probs = np.concatenate([q_s[:, None], (1 - q_s[:, None]) * tail_v / tail_v.sum()], axis=1)
  return np.broadcast_to(np.log(probs)[:, None, :], (len(q_s), DEPTH, VOCAB)).astype(np.float32)


def tau_curves(q_grid) -> np.ndarray:
  """`expected_tau` at every ladder budget `[Q, L]` for each q of the grid."""
  return np.asarray(jax.jit(draft_expected_tau, static_argnums=(1, 2))(
      draft_logprobs(q_grid), LADDER, TOP_K), np.float64)


def simulate(costs: CostTable, q_grid, curves_ql, q: float, rows: int, rounds: int,
             seed: int) -> dict:
  """Runs `rounds` rounds of `rows` busy rows with the chooser; returns what it did and earned."""
  rng = np.random.default_rng(seed)
  fraction_b = rng.uniform(0.75, 1.05, rows)  # true gain / the draft's predicted gain
  prior_l = curves_ql[0]  # a weak head until a row has drafted
  model = AcceptanceModel(LADDER, rows, prior_l)
  seconds_l = costs.round_seconds("jetflow", LADDER, rows)
  chosen, predicted, true_sum_l = [], [], np.zeros(len(LADDER))
  tokens = elapsed = 0.0
  for _ in range(rounds):
    choice = choose_budget(model.estimate(), costs, "jetflow", LADDER, probe=model.probe_due())
    q_b = np.clip(q + rng.normal(0, 0.03, rows), q_grid[0], q_grid[-1])
    predicted_bl = np.stack([np.interp(q_b, q_grid, c) for c in curves_ql.T], axis=1)
    true_bl = 1 + fraction_b[:, None] * (predicted_bl - 1)
    true_sum_l += true_bl.sum(axis=0)
    trials = min(DEPTH, choice.budget - 1)
    accepted_b = rng.binomial(trials, (true_bl[:, choice.index] - 1) / max(trials, 1))
    tokens += rows + accepted_b.sum()
    elapsed += seconds_l[choice.index]
    model.update(predicted_bl if choice.budget > 1 else None, 1 + accepted_b, choice.budget)
    chosen.append(choice.budget)
    predicted.append(choice.tokens_per_s_l[choice.index])
  fixed_l = true_sum_l / rounds / seconds_l
  fixed_l[0] = rows / seconds_l[0]
  best = int(np.argmax(fixed_l))
  budgets, counts = np.unique(chosen, return_counts=True)
  return {"rows": rows, "true_tau_at_256": float(true_sum_l[-1] / rounds / rows),
          "chosen_budgets": {int(b): int(c) for b, c in zip(budgets, counts)},
          "chosen_budget": int(budgets[np.argmax(counts)]),
          "chosen_predicted_tokens_per_s": float(np.mean(predicted[rounds // 4:])),
          "chosen_simulated_tokens_per_s": tokens / elapsed,
          "best_fixed_budget": LADDER[best], "best_fixed_tokens_per_s": float(fixed_l[best]),
          "ar_tokens_per_s": float(fixed_l[0]),
          "fixed_tokens_per_s": {n: float(x) for n, x in zip(LADDER, fixed_l)},
          "ratio_to_best_fixed": tokens / elapsed / fixed_l[best]}


def chooser_seconds(costs: CostTable, rows: int = 32) -> float:
  """Median seconds of one estimate plus one choice for `rows` rows over the whole ladder."""
  model = AcceptanceModel(LADDER, rows, np.linspace(1, 5, len(LADDER)))
  model.update(np.tile(np.linspace(1, 9, len(LADDER)), (rows, 1)), np.full(rows, 5.0), 64)
  samples = []
  for _ in range(500):
    start = time.perf_counter()
    choose_budget(model.estimate(), costs, "jetflow", LADDER, probe=model.probe_due())
    samples.append(time.perf_counter() - start)
  return float(np.median(samples))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--mfu", type=float, default=0.6,
                      help="fraction of 790 TFLOP/s a verify of many rows reaches")
  parser.add_argument("--rounds", type=int, default=400)
  parser.add_argument("--taus", default="4,8,10", help="true tau at N = 256 of the mean row")
  parser.add_argument("--out", default=os.path.join(ROOT, "bench/results/chooser_sim_h200.json"))
  args = parser.parse_args(argv)

  costs = h200_cost_table(args.mfu)
  q_grid = np.linspace(0.05, 0.995, 96)
  curves_ql = tau_curves(q_grid)
  mean_fraction = 0.9  # of fraction_b in `simulate`
  results = []
  for target in (float(t) for t in args.taus.split(",")):
    q = float(np.interp(target, 1 + mean_fraction * (curves_ql[:, -1] - 1), q_grid))
    for rows in costs.rows:
      results.append(dict(simulate(costs, q_grid, curves_ql, q, rows, args.rounds, seed=rows),
                          tau_profile=target, q=q))
  chooser_s = chooser_seconds(costs)
  smallest_round_s = min(min(t) for by_budget in costs.seconds.values()
                         for t in by_budget.values())

  print(f"{'rows':>4} {'tau':>4} | {'chosen':>6} {'pred tok/s':>10} {'sim tok/s':>9} | "
        f"{'best fixed':>10} {'tok/s':>7} | {'ratio':>5} | {'AR tok/s':>8}")
  for r in results:
    print(f"{r['rows']:>4} {r['true_tau_at_256']:>4.1f} | {r['chosen_budget']:>6} "
          f"{r['chosen_predicted_tokens_per_s']:>10.0f} {r['chosen_simulated_tokens_per_s']:>9.0f} "
          f"| {r['best_fixed_budget']:>10} {r['best_fixed_tokens_per_s']:>7.0f} | "
          f"{r['ratio_to_best_fixed']:>5.3f} | {r['ar_tokens_per_s']:>8.0f}")
  print(f"chooser: {chooser_s * 1e6:.0f} us for 32 rows x {len(LADDER)} budgets "
        f"({chooser_s / smallest_round_s:.2%} of the shortest round in the table)")
  with open(args.out, "w") as f:
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    json.dump({"settings": settings, "cost_table": costs.to_json(),
               "chooser_seconds_32_rows": chooser_s, "results": results}, f, indent=1)
  print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
  main()
