"""Compare AR, DFlash (chain), DDTree and JetFlow on one prompt set, measured in one run.

  python -m jetflow_jax.bench                               # embedded pair, HumanEval, all cells
  python -m jetflow_jax.bench --limit 2 --budgets 16        # a quick check
  python -m jetflow_jax.bench --methods ar,ddtree,jetflow --trees paper   # as the paper ran it
  python -m jetflow_jax.bench --checkpoint Qwen3-8B --head jetflow-head --dflash-head dflash-head \
      --dataset jsonl:math500.jsonl --chat --max-new-tokens 1024

Writes results.json, results.md and results.png (tau and speedup against budget) to --out.
"""

from __future__ import annotations

import argparse
import sys

import tqdm

from jetflow_jax import cli, compile_cache
from jetflow_jax.bench import report
from jetflow_jax.bench.datasets import DATASETS, load_prompts
from jetflow_jax.bench.run import (parse_trees, run_benchmark, runs_per_benchmark,
                                   transformers_peer)
from jetflow_jax.decoding.policy import METHODS, head_kind
from jetflow_jax.errors import InputError
from jetflow_jax.pair import add_model_flags, load_head_for, load_pair
from jetflow_jax.text import encode_prompt, load_tokenizer


def parse_args(argv=None):
  parser = argparse.ArgumentParser(prog="python -m jetflow_jax.bench",
                                   description=__doc__.strip().splitlines()[0])
  add_model_flags(parser, method=False, mesh_help=None)  # --head: the causal (JetFlow) head
  parser.add_argument("--dflash-head", help="bidirectional head for dflash and ddtree "
                      "(default: the embedded one)")
  parser.add_argument("--dataset", default="humaneval", help=" | ".join(DATASETS))
  parser.add_argument("--limit", type=int, default=0, help="first N prompts only")
  parser.add_argument("--methods", default="ar,dflash,ddtree,jetflow")
  parser.add_argument("--budgets", default="16,32,64,128,256,auto",
                      help="tree budgets; auto chooses each round's on the ladder up to the "
                      "largest of them")
  parser.add_argument("--temperatures", default="0,1")
  parser.add_argument("--max-new-tokens", type=int, default=128)
  parser.add_argument("--top-k", default="7", help="candidate children per depth for the trees; "
                      "a comma-separated list runs each")
  parser.add_argument("--trees", default="top_n", help="tree builders for ddtree and jetflow, "
                      "comma-separated: top_n (exact top-N, ours), accum (the reference "
                      "JetFlow's best-first heap), wide (top_n at top-k N - 1, as DDTree runs "
                      "it); METHOD:TREE for one method; paper = top_n,ddtree:wide,jetflow:accum")
  parser.add_argument("--chat", action="store_true", help="chat-template the prompts")
  parser.add_argument("--no-peer", action="store_true", help="skip transformers' generate")
  parser.add_argument("--out", default="bench/results/latest")
  return parser.parse_args(argv)


def parse_list(text: str, kind, flag: str):
  try:
    return [kind(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise InputError(f"{flag} must be a comma-separated list (got {text!r})") from None


def main(argv=None):
  args = parse_args(argv)

  def bench():
    compile_cache.enable()
    methods = parse_list(args.methods, str, "--methods")
    if unknown := [m for m in methods if m not in METHODS]:
      raise InputError(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    budgets = parse_list(args.budgets, lambda x: x if x == "auto" else int(x), "--budgets")
    top_ks = parse_list(args.top_k, int, "--top-k")
    trees = parse_trees(args.trees)
    temperatures = parse_list(args.temperatures, float, "--temperatures")
    pair = load_pair(args.checkpoint, method="ar", dtype=args.dtype, attention=args.attention)
    checkpoint, config, params = pair.checkpoint, pair.config, pair.params
    given = {"jetflow": args.head, "dflash": args.dflash_head}
    heads = {m: load_head_for(m, given[head_kind(m)], args.checkpoint is None, args.dtype)
             for m in methods if m != "ar"}
    raw_prompts = load_prompts(args.dataset)[:args.limit or None]
    if not raw_prompts:
      raise InputError(f"dataset {args.dataset} holds no prompt")
    tokenizer = None
    if any(isinstance(p, str) for p in raw_prompts):
      tokenizer = load_tokenizer(checkpoint)
    prompts = [encode_prompt(tokenizer, p, args.chat) if isinstance(p, str) else p
               for p in raw_prompts]

    total = runs_per_benchmark(methods, budgets, top_ks, temperatures, len(prompts), trees)
    with tqdm.tqdm(total=total, desc="bench", unit="decode") as bar:
      cells, greedy_ar_tokens = run_benchmark(
          params, config, heads, prompts, methods=methods, budgets=budgets,
          temperatures=temperatures, max_new_tokens=args.max_new_tokens, top_ks=top_ks,
          trees=trees, attention=pair.attention, on_run=lambda: bar.update())
    peer = None
    greedy_ar = next((c for c in cells if c.method == "ar" and c.temperature == 0), None)
    if not args.no_peer and greedy_ar is not None:
      peer_tokens, peer_wall = transformers_peer(checkpoint, prompts, args.max_new_tokens,
                                                 config.eos_token_ids)
      peer = {"tokens_per_s": sum(map(len, peer_tokens)) / peer_wall,
              "speedup": greedy_ar.wall_s / peer_wall,
              "identical_to_ar": peer_tokens == greedy_ar_tokens}
    settings = dict(vars(args), checkpoint=checkpoint, num_prompts=len(prompts),
                    title=f"{args.dataset}, {len(prompts)} prompts, {args.max_new_tokens} tokens")
    paths = report.write(args.out, cells, settings, peer)
    print(report.markdown_table(cells, peer))
    print("wrote " + ", ".join(paths.values()), file=sys.stderr)

  cli.run(bench)


if __name__ == "__main__":
  main()
