"""`--budget auto` against AR and the best fixed budget, side by side, where trees lose and
where they pay: does the default ever cost a user time?

  python bench/auto_budget.py                       # every part below (about an hour here)
  python bench/auto_budget.py --parts embedded --new-tokens 32,128 --repeats 3
  python bench/auto_budget.py --parts decode_py     # the five prompts through decode.py

Parts:
- `embedded`: the embedded pair (a trained JetFlow head; trees lose on this CPU), through
  `speculative_generate`, five short code prompts one at a time (batch 1) and together with three
  repeated (batch 8), at each of `--new-tokens`;
- `qwen3-0.6b`, `qwen3-1.7b`: real Qwen3 shapes with random float32 weights and the controlled
  drafter at each of `--taus` (a round commits tau tokens on average; trees pay), through
  `decode_prompts`, one 64-token random prompt, at each of `--cpu-new-tokens`; each pass draws
  the drafter's accepted depths from its own seed (the same for every cell of the pass): another
  request of the same acceptance, so that the record kept on disk meets new draws, as a user's
  next request would, and the median is over several draw sequences, not one;
- `decode_py`: `decode.py --prompt P --json` for each of the five prompts, one process after
  another (its `speedup` is auto over AR in the same process), the cost table absent before the
  first and on disk after it.

Cells of a part: AR, each of `--budgets`, auto with its cost table and drafter record absent
(removed before each run: every run calibrates and starts from a drafter never seen) and auto
with them present (kept from a first, untimed run). Every pass runs every cell once, in an order
rotated from pass to pass and reversed every other pass; a cell's figure is its median tokens/s
over `--repeats` passes (wall time of decoding, prefill included; compilation, warm-up and
calibration excluded, as `Generation.wall_s` counts); auto over the best cell is given of the
medians and, paired, as the median over passes of the two cells' ratio in the same pass (the
same draws). Every run's tokens are checked against AR's. Writes bench/results/auto_budget.json;
the engine at 1, 4 and 8 clients is `bench/serve_budgets.py`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # before the imports below: measure this checkout, installed or not

import jax  # noqa: E402
import numpy as np  # noqa: E402
import tqdm  # noqa: E402

from jetflow_jax import embedded, load_head, load_qwen3, speculative_generate  # noqa: E402
from jetflow_jax.controlled_drafter import (ControlledDrafter, controlled_params,  # noqa: E402
                                            depth_distribution_for_tau)
from jetflow_jax.decoding import TreeShape, auto, decode_prompts, generate  # noqa: E402
from jetflow_jax.decoding.budget import COST_TABLES_ENV  # noqa: E402
from jetflow_jax.model import (decode_kernel_layout, init_params,  # noqa: E402
                               with_kernel_layout)
from jetflow_jax.text import encode_prompt, load_tokenizer  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "bench"))
import step_costs  # noqa: E402

PROMPTS = ("def merge(a, b):", "class Stack:\n    def push(self, x):", "def is_prime(n):",
           "import os\n\ndef walk(root):", "def parse_args(argv):")


class Tables:
  """The cost tables file of auto's runs: one kept across a part's "present" runs, and a fresh
  one for each "absent" run (and the process's memo of round times forgotten with it)."""

  def __init__(self, directory: str):
    self.directory, self.count = directory, 0

  def use(self, kept: bool, scenario: str) -> None:
    if kept:
      path = os.path.join(self.directory, f"kept_{scenario}.json")
    else:
      self.count += 1
      path = os.path.join(self.directory, f"absent_{self.count}.json")
    os.environ[COST_TABLES_ENV] = path
    auto._seconds.clear()


def rotated(cells, repeat):
  """The pass's order: rotated by one a pass and reversed every other pass, so that a cell
  follows a different one from pass to pass (one order kept auto with its table right after
  auto without at Qwen3-0.6B shapes, 2,048 tokens, tau 8, and read it 0.84 of JetFlow 16 over
  two passes; with the order varied, 0.95 over three)."""
  shift = repeat % len(cells)
  order = cells[shift:] + cells[:shift]
  return order[::-1] if repeat % 2 else order


def measure(scenario: str, cells: dict, repeats: int, tables: Tables, reference) -> dict:
  """Runs every cell `repeats` times, alternated and rotated; each run takes the pass's draw
  (0 for the first, untimed one) and returns a Generation."""
  for name, run in cells.items():  # compiles; auto's present table and record
    tables.use(name != "auto, table absent", scenario)
    run(0)
  rates, chosen = collections.defaultdict(list), collections.defaultdict(collections.Counter)
  exact = True
  for repeat in range(repeats):
    for name in rotated(list(cells), repeat):
      tables.use(name != "auto, table absent", scenario)
      result = cells[name](repeat + 1)
      rates[name].append(result.num_tokens / result.wall_s)
      chosen[name].update(result.budgets)
      exact &= result.tokens == reference
  median = {name: statistics.median(r) for name, r in rates.items()}
  best = max((k for k in median if not k.startswith("auto")), key=median.get)
  # A pass's cells meet the same draws: their ratio in that pass leaves out how lucky the draws
  # were, which moves every cell of a pass together (tau 4: 6.6 to 15 tokens/s from pass to pass).
  paired = {k: statistics.median(a / b for a, b in zip(rates[k], rates[best]))
            for k in median if k.startswith("auto")}
  return {"tokens_per_s": median, "runs": rates, "identical_to_ar": exact,
          "best_fixed_or_ar": median[best], "best_cell": best,
          **{f"{k} / best": median[k] / median[best] for k in paired},
          **{f"{k} / best, paired": v for k, v in paired.items()},
          "auto_rounds": {k: {str(n): c for n, c in sorted(v.items())} for k, v in chosen.items()
                          if k.startswith("auto")}}


def embedded_part(args, tables: Tables) -> dict:
  config, params = load_qwen3(embedded.default_target())
  head_config, head_params = load_head(embedded.default_head("jetflow"))
  params, head_params = (with_kernel_layout(p, decode_kernel_layout())  # as decode.py does
                         for p in (params, head_params))
  tokenizer = load_tokenizer(embedded.default_target())
  ids = [encode_prompt(tokenizer, p, False) for p in PROMPTS]
  out = {}
  for batch in args.batches:
    for new_tokens in args.new_tokens:
      groups = [[p] for p in ids] if batch == 1 else [(ids * batch)[:batch]]

      def cell(method, budget):
        def run(draw):  # real prompts: the same each pass
          results = [speculative_generate(
              params, config, head_params, head_config, prompts, new_tokens, method=method,
              budget=budget, max_budget=args.max_budget, warmup=True, warn=lambda _: None)
              for prompts in groups]
          return Merged(results)
        return run

      cells = {"AR": cell("ar", 1), **{f"JetFlow {b}": cell("jetflow", b) for b in args.budgets},
               "auto, table absent": cell("jetflow", "auto"),
               "auto, table present": cell("jetflow", "auto")}
      reference = cells["AR"](0).tokens
      name = f"embedded b{batch} n{new_tokens}"
      out[name] = measure(name, cells, args.repeats, tables, reference)
      print(row(name, out[name]), flush=True)
  return out


class Merged:
  """Several runs' results read as one: tokens appended, walls added."""

  def __init__(self, results):
    self.tokens = [t for r in results for t in r.tokens]
    self.num_tokens = sum(r.num_tokens for r in results)
    self.wall_s = sum(r.wall_s for r in results)
    self.budgets = [b for r in results for b in r.budgets]


def controlled_part(args, tables: Tables, preset: str) -> dict:
  config = step_costs.PRESETS[preset].config
  params = jax.block_until_ready(with_kernel_layout(jax.jit(init_params, static_argnums=(0,))(
      config, jax.random.key(0)), decode_kernel_layout()))
  prompt = np.random.default_rng(0).integers(0, config.vocab_size, (1, 64)).tolist()
  drafter = ControlledDrafter(depth=15, calibrated=args.calibrated)
  out = {}
  for new_tokens in args.cpu_new_tokens:
    ar = generate(params, config, prompt, new_tokens, stop_tokens=())
    reference = [p + t for p, t in zip(prompt, ar.tokens)]
    for tau in args.taus:
      distribution = depth_distribution_for_tau(tau, drafter.depth)

      def cell(budget, auto_on=False):
        return lambda draw: decode_prompts(
            params, config, drafter, controlled_params(reference, distribution, seed=draw),
            prompt, new_tokens,
            tree_shape=TreeShape("top_n", args.max_budget if auto_on else budget, 7),
            stop_tokens=(), auto=auto_on, warmup=True)

      cells = {"AR": lambda draw: generate(params, config, prompt, new_tokens, stop_tokens=(),
                                           warmup=True),
               **{f"JetFlow {b}": cell(b) for b in args.budgets},
               "auto, table absent": cell(None, True), "auto, table present": cell(None, True)}
      name = f"{preset} tau {tau:g} n{new_tokens}"
      out[name] = measure(name, cells, args.repeats, tables, ar.tokens)
      print(row(name, out[name]), flush=True)
  return out


def decode_py_part(args, tables: Tables) -> dict:
  """decode.py, one process per prompt, after each other: the first finds no table."""
  tables.use(False, "decode_py")
  runs = []
  for prompt in tqdm.tqdm(PROMPTS, desc="decode.py"):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "decode.py"), "--prompt", prompt,
                           "--json"], capture_output=True, text=True, check=True)
    record = json.loads(done.stdout)
    runs.append({k: record[k] for k in ("speedup", "identical_to_ar", "budgets", "wall_s",
                                         "ar_wall_s", "compared_wall_s", "calibrate_s",
                                         "warmup_s")})
    runs[-1]["prompt"] = prompt
  speedups = [r["speedup"] for r in runs]
  return {"runs": runs, "median_speedup": statistics.median(speedups),
          "min_speedup": min(speedups), "identical_to_ar": all(r["identical_to_ar"] for r in runs)}


def row(name: str, r: dict) -> str:
  m = r["tokens_per_s"]
  cells = " | ".join(f"{v:.1f}" for v in m.values())
  ratios = " | ".join(f"{r[f'{k} / best']:.2f} ({r[f'{k} / best, paired']:.2f})"
                      for k in m if k.startswith("auto"))
  return f"| {name} | {cells} | {ratios} | {'yes' if r['identical_to_ar'] else 'NO'} |"


def ints(text: str) -> list[int]:
  return [int(t) for t in text.split(",") if t.strip()]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--parts", default="embedded,qwen3-0.6b,qwen3-1.7b,decode_py")
  parser.add_argument("--budgets", type=ints, default=[16, 64],
                      help="fixed JetFlow budgets (none: \"\", where AR is known to be best)")
  parser.add_argument("--max-budget", type=int, default=None,
                      help="the largest budget auto may choose (default: the largest of --budgets)")
  parser.add_argument("--batches", type=ints, default=[1, 8], help="embedded part's batches")
  # The embedded target's context is 1,024 positions: 2,048 new tokens would run past it.
  parser.add_argument("--new-tokens", type=ints, default=[32, 128, 512],
                      help="embedded part's new tokens")
  parser.add_argument("--cpu-new-tokens", type=ints, default=[32, 128],
                      help="new tokens of the Qwen3-shaped parts")
  parser.add_argument("--taus", type=lambda t: [float(x) for x in t.split(",")],
                      default=[2.0, 4.0, 8.0])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--calibrated", action="store_true",
                      help="the controlled drafter as sure as its acceptance warrants (a "
                           "well-trained head), not certain of every token")
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results",
                                                    "auto_budget.json"))
  args = parser.parse_args()
  if args.max_budget is None:
    if not args.budgets:
      parser.error("without --budgets, give --max-budget")
    args.max_budget = max(args.budgets)
  report = {"settings": vars(args)}
  with tempfile.TemporaryDirectory() as directory:
    tables = Tables(directory)
    for part in args.parts.split(","):
      print(f"\n{part}: tokens/s, median of {args.repeats} alternated passes "
            f"({', '.join(['AR', *(f'JetFlow {b}' for b in args.budgets)])}, auto absent, "
            "auto present; auto over the best of AR and the fixed budgets: of the medians "
            "(of each pass))", flush=True)
      if part == "embedded":
        report[part] = embedded_part(args, tables)
      elif part.startswith("qwen3-"):
        report[part] = controlled_part(args, tables, part)
      elif part == "decode_py":
        report[part] = decode_py_part(args, tables)
        print(json.dumps({k: v for k, v in report[part].items() if k != "runs"}), flush=True)
      else:
        parser.error(f"unknown part {part!r}")
  with open(args.out, "w") as f:
    json.dump(report, f, indent=1)
  print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
  main()
