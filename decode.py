"""Decode with a Qwen3 checkpoint, plainly (AR) or speculatively with a draft head.

  python decode.py --checkpoint DIR --prompt "Write a haiku" --max-new-tokens 64 --chat
  python decode.py --checkpoint DIR --head HEAD_DIR --prompt "def f(x):" --budget 64 --compare-ar
  python decode.py --checkpoint DIR --prompt-ids 1,2,3 --json
  python decode.py --checkpoint DIR --head HEAD --prompt "..." --mesh tp=4,ep=2
  # a mesh over several hosts: the same command on each, plus (unless SLURM, Open MPI or a TPU
  # pod tells JAX) --coordinator_address=HOST:PORT --num_processes=N --process_id=I
  python decode.py --memory_report --config configs/qwen3_32b.py --mesh tp=2 --batch-size 8 \
      --budget 256 --cache-size 8192 [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys



from jetflow_jax import cli, compile_cache, distributed
from jetflow_jax.decoding import StopReason, speculative_generate
from jetflow_jax.decoding.state import check_context_window
from jetflow_jax.errors import InputError
from jetflow_jax.mesh import parse_mesh
from jetflow_jax.pair import add_model_flags, max_budget, pair_from_flags
from jetflow_jax.sampling import make_sampler
from jetflow_jax.text import encode_prompt, load_tokenizer

DIM, PLAIN = "\033[2m", "\033[0m"


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  add_model_flags(parser)
  prompt = parser.add_mutually_exclusive_group()
  prompt.add_argument("--prompt", help="prompt text (needs tokenizer files in the checkpoint)")
  prompt.add_argument("--prompt-ids", help="comma-separated prompt token ids")
  prompt.add_argument("--prompts-file", help="one prompt per line (text)")
  parser.add_argument("--batch-size", type=int, default=1,
                      help="repeat the prompt this many times (ignored with --prompts-file)")
  parser.add_argument("--max-new-tokens", type=int, default=128)
  parser.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
  parser.add_argument("--json", action="store_true", help="print one JSON object, no streaming")
  parser.add_argument("--compare-ar", action="store_true",
                      help="also decode plainly and report the speedup and whether they agree "
                           "(AR against the method decoded again after it, both warm)")
  parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
  parser.add_argument("--sample-top-k", type=int, default=0, help="sampling top-k; 0 disables")
  parser.add_argument("--top-p", type=float, default=1.0, help="1.0 disables top-p")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--cache-size", type=int, default=None,
                      help="KV cache slots (default: fits prompt + max new tokens)")
  parser.add_argument("--allow-long-context", action="store_true",
                      help="run past the model's max_position_embeddings on purpose")
  parser.add_argument("--coordinator_address", help="HOST:PORT of process 0 (multi-process)")
  parser.add_argument("--num_processes", type=int, help="processes in the job (multi-process)")
  parser.add_argument("--process_id", type=int, help="this process's index (multi-process)")
  parser.add_argument("--memory_report", "--memory-report", action="store_true",
                      help="compile prefill and the rounds on abstract shapes for --config and "
                      "--mesh, print the per-device memory and exit")
  parser.add_argument("--config", help="with --memory_report: a training config file "
                      "(configs/NAME.py[:arg]) giving the target's and the head's shapes")
  return parser.parse_args(argv)


def parse_ids(text: str) -> list[int]:
  try:
    return [int(t) for t in text.split(",") if t.strip()]
  except ValueError:
    raise InputError(f"--prompt-ids must be comma-separated integers (got {text!r})") from None


def read_prompts(args, tokenizer_dir: str):
  """(prompt id lists, tokenizer or None) from whichever prompt flag was given."""
  if args.prompt_ids is not None:
    return [parse_ids(args.prompt_ids)] * args.batch_size, None
  tokenizer = load_tokenizer(tokenizer_dir)
  if args.prompts_file is not None:
    try:
      with open(args.prompts_file) as f:
        texts = [line.rstrip("\n") for line in f if line.strip()]
    except OSError as e:
      raise InputError(f"cannot read --prompts-file: {e}") from None
    if not texts:
      raise InputError(f"--prompts-file {args.prompts_file} holds no prompt")
  else:
    texts = [args.prompt] * args.batch_size
  return [encode_prompt(tokenizer, t, args.chat) for t in texts], tokenizer


def memory_report(args) -> None:
  from jetflow_jax import decode_memory
  if not args.config:
    raise InputError("--memory_report needs --config (a training config file: configs/NAME.py)")
  report = decode_memory.memory_report(
      args.config, parse_mesh(args.mesh), batch=args.batch_size,
      budget=max_budget(args) if args.budget == "auto" else args.budget,
      top_k=args.top_k, context=args.cache_size or 8192,
      dtype_name="bfloat16" if args.dtype == "auto" else args.dtype, checkpoint=args.checkpoint)
  print(json.dumps(report) if args.json else decode_memory.format_report(report))


def main(argv=None) -> None:
  args = parse_args(argv)

  def decode():
    if args.memory_report:
      return memory_report(args)
    # Before anything touches a device; on one plain host this does nothing.
    distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
    if not distributed.is_main_process():
      sys.stdout = open(os.devnull, "w")  # process 0 speaks for the job
    compile_cache.enable()  # a second run of the same shapes compiles nothing
    if args.prompt is None and args.prompt_ids is None and args.prompts_file is None:
      raise InputError("give a prompt: --prompt, --prompt-ids or --prompts-file")
    if args.batch_size < 1:
      raise InputError(f"--batch-size must be >= 1 (got {args.batch_size})")
    sampler = make_sampler(args.temperature, args.sample_top_k, args.top_p)
    pair = pair_from_flags(args)
    config, method = pair.config, pair.method
    # The embedded pair shows what its head buys on this prompt.
    compare_ar = args.compare_ar or (args.checkpoint is None and method != "ar")
    prompts, tokenizer = read_prompts(args, pair.checkpoint)
    if bad := [t for p in prompts for t in p if not 0 <= t < config.vocab_size]:
      raise InputError(f"prompt token ids out of range [0, {config.vocab_size}): {bad[:10]}")
    if not args.allow_long_context:
      check_context_window(config, prompts, args.max_new_tokens)
    if tokenizer:
      detokenize = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    else:  # ids, each after a space, so the continuation stays apart from the prompt
      detokenize = lambda ids: "".join(f" {t}" for t in ids)
    printed = [""]
    if not args.json:  # the prompt, dimmed on a terminal, then the continuation as it comes
      shown = (args.prompt if args.prompt is not None else
               detokenize(prompts[0]) if tokenizer else " ".join(map(str, prompts[0])))
      dim = sys.stdout.isatty()
      sys.stdout.write(f"{DIM}{shown}{PLAIN}" if dim else shown)
      sys.stdout.flush()

    def stream(tokens):
      text = detokenize(tokens[0])
      sys.stdout.write(text[len(printed[0]):])
      sys.stdout.flush()
      printed[0] = text

    run = lambda method, on_tokens=None: speculative_generate(
        pair.params, config, pair.head_params, pair.head_config, prompts, args.max_new_tokens,
        method=method, budget=args.budget, top_k=args.top_k, max_budget=max_budget(args),
        sampler=sampler, seed=args.seed,
        attention=pair.attention, cache_size=args.cache_size, on_tokens=on_tokens,
        warn=lambda line: print(line, file=sys.stderr), mesh=pair.mesh, warmup=True)
    result = run(method, None if args.json else stream)
    summary = {
        "method": method,
        "token_ids": result.tokens[0],
        "text": detokenize(result.tokens[0]) if tokenizer else None,
        "num_prompt_tokens": len(prompts[0]),
        "num_new_tokens": len(result.tokens[0]),
        "stop_reason": result.stop_reasons,
        "tau": round(result.tau, 4),
        "accepted_lengths": result.committed_per_round[0],
        "budget": args.budget,
        "budgets": result.budgets,  # with auto: the budget of every round
        "budget_reason": result.budget_reason,  # with auto: why the first round's
        "calibrate_s": round(result.calibrate_s, 4),
        "num_target_forwards": result.num_forwards,
        "compile_s": round(result.compile_s, 4),
        "warmup_s": round(result.warmup_s, 4),
        "wall_s": round(result.wall_s, 6),  # to the microsecond: ratios of them stay exact
        "tokens_per_s": round(result.num_tokens / result.wall_s, 2),
    }
    if len(prompts) > 1:
      summary["rows"] = [{"token_ids": t, "tau": round(result.row_tau(b), 4)}
                         for b, t in enumerate(result.tokens)]
    if compare_ar:
      ar = run("ar")
      # A process's first decode runs ~10-15% slower than later ones whatever the method (warm-up
      # included), so the speedup compares AR with the method decoded again after it.
      again = run(method)
      summary.update(ar_wall_s=round(ar.wall_s, 6), compared_wall_s=round(again.wall_s, 6),
                     speedup=round(ar.wall_s / again.wall_s, 3),
                     identical_to_ar=ar.tokens == result.tokens)
    if args.json:
      print(json.dumps(summary))
    elif distributed.is_main_process():  # its stderr too: one summary for the job
      chosen = collections.Counter(result.budgets)
      budgets = ("budget auto: " + ", ".join(f"{'AR' if n == 1 else n} x{k}"
                                             for n, k in sorted(chosen.items()))
                 + f" (first: {result.budget_reason}); " if chosen else "")
      line = (f"\n\n[{method}: {summary['num_new_tokens']} tokens, {budgets}"
              f"{result.num_forwards} target forwards, tau {summary['tau']}, "
              f"{summary['tokens_per_s']} tokens/s, compile {result.compile_s:.1f}s, "
              f"warm-up {result.warmup_s:.2f}s")
      if compare_ar:
        line += (f"; {summary['speedup']}x over AR, "
                 f"{'identical to' if summary['identical_to_ar'] else 'differs from'} AR")
      print(line + "]", file=sys.stderr)
    for row, (reason, tokens) in enumerate(zip(result.stop_reasons, result.tokens)):
      if reason == StopReason.CACHE_FULL:
        print(f"row {row} stopped after {len(tokens)} of {args.max_new_tokens} tokens: the KV "
              "cache is full (raise --cache-size)", file=sys.stderr)

  cli.run(decode)


if __name__ == "__main__":
  main()
