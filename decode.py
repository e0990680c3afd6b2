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
import json
import os
import sys


import jax

from jetflow_jax import cli, distributed, embedded, hub
from jetflow_jax.checkpoint import load_qwen3
from jetflow_jax.kernels.tree_attention import attention_for_backend
from jetflow_jax.mesh import DecodeMesh, parse_mesh
from jetflow_jax.errors import InputError
from jetflow_jax.generate import check_context_window
from jetflow_jax.head_checkpoint import load_head
from jetflow_jax.sampling import make_sampler
from jetflow_jax.speculative import METHODS, speculative_generate
from jetflow_jax.text import encode_prompt, load_tokenizer


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--checkpoint", help="target: directory or hub id (default: the embedded "
                      "model, with its JetFlow head)")
  parser.add_argument("--head", help="draft head: reference-layout directory or hub id, or a "
                      "training workdir")
  parser.add_argument("--method", choices=METHODS,
                      help="default: jetflow with a --head, ar without")
  parser.add_argument("--budget", type=int, default=64, help="tree nodes, root included")
  parser.add_argument("--top-k", type=int, default=7, help="tree candidates per depth")
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
                      help="also decode plainly and report the speedup and whether they agree")
  parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
  parser.add_argument("--sample-top-k", type=int, default=0, help="sampling top-k; 0 disables")
  parser.add_argument("--top-p", type=float, default=1.0, help="1.0 disables top-p")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--cache-size", type=int, default=None,
                      help="KV cache slots (default: fits prompt + max new tokens)")
  parser.add_argument("--allow-long-context", action="store_true",
                      help="run past the model's max_position_embeddings on purpose")
  parser.add_argument("--attention", default="xla", choices=("xla", "pallas"),
                      help="pallas: the backend's kernel (Triton on GPU, Mosaic on TPU, "
                      "interpreted on CPU)")
  parser.add_argument("--mesh", default="", help="devices to decode over, e.g. tp=4,ep=2 "
                      "(axes data, tp, ep; default: one device)")
  parser.add_argument("--coordinator_address", help="HOST:PORT of process 0 (multi-process)")
  parser.add_argument("--num_processes", type=int, help="processes in the job (multi-process)")
  parser.add_argument("--process_id", type=int, help="this process's index (multi-process)")
  parser.add_argument("--memory_report", "--memory-report", action="store_true",
                      help="compile prefill and the rounds on abstract shapes for --config and "
                      "--mesh, print the per-device memory and exit")
  parser.add_argument("--config", help="with --memory_report: a training config file "
                      "(configs/NAME.py[:arg]) giving the target's and the head's shapes")
  parser.add_argument("--dtype", default="auto",
                      help="auto (bfloat16 on GPU/TPU, float32 on CPU), float32 or bfloat16")
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
      args.config, parse_mesh(args.mesh), batch=args.batch_size, budget=args.budget,
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
    if args.prompt is None and args.prompt_ids is None and args.prompts_file is None:
      raise InputError("give a prompt: --prompt, --prompt-ids or --prompts-file")
    if args.batch_size < 1:
      raise InputError(f"--batch-size must be >= 1 (got {args.batch_size})")
    sampler = make_sampler(args.temperature, args.sample_top_k, args.top_p)
    dtype = cli.parse_dtype(args.dtype)
    checkpoint, head, compare_ar = args.checkpoint, args.head, args.compare_ar
    if checkpoint is None:  # the embedded pair, and what its head buys on this prompt
      checkpoint, head = embedded.default_target(), head or embedded.default_head("jetflow")
      compare_ar = compare_ar or head is not None
    method = args.method or ("jetflow" if head else "ar")
    checkpoint, head = hub.resolve(checkpoint), head and hub.resolve(head)
    attention = attention_for_backend(args.attention, jax.default_backend())
    mesh = DecodeMesh.create(**parse_mesh(args.mesh)) if args.mesh else None
    config, params = load_qwen3(checkpoint, dtype, None if mesh is None else mesh.param_shardings)
    head_config, head_params = load_head(head, dtype) if head else (None, None)
    prompts, tokenizer = read_prompts(args, checkpoint)
    if bad := [t for p in prompts for t in p if not 0 <= t < config.vocab_size]:
      raise InputError(f"prompt token ids out of range [0, {config.vocab_size}): {bad[:10]}")
    if not args.allow_long_context:
      check_context_window(config, prompts, args.max_new_tokens)
    detokenize = ((lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer
                  else (lambda ids: " ".join(map(str, ids))))
    printed = [""]

    def stream(tokens):
      text = detokenize(tokens[0])
      sys.stdout.write(text[len(printed[0]):])
      sys.stdout.flush()
      printed[0] = text

    run = lambda method, on_tokens=None: speculative_generate(
        params, config, head_params, head_config, prompts, args.max_new_tokens, method=method,
        budget=args.budget, top_k=args.top_k, sampler=sampler, seed=args.seed,
        attention=attention, cache_size=args.cache_size, on_tokens=on_tokens,
        warn=lambda line: print(line, file=sys.stderr), mesh=mesh)
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
        "num_target_forwards": result.num_target_forwards,
        "compile_s": round(result.compile_s, 4),
        "wall_s": round(result.wall_s, 4),
        "tokens_per_s": round(result.num_tokens / result.wall_s, 2),
    }
    if len(prompts) > 1:
      summary["rows"] = [{"token_ids": t, "tau": round(result.row_tau(b), 4)}
                         for b, t in enumerate(result.tokens)]
    if compare_ar:
      ar = run("ar")
      summary.update(ar_wall_s=round(ar.wall_s, 4), speedup=round(ar.wall_s / result.wall_s, 3),
                     identical_to_ar=ar.tokens == result.tokens)
    if args.json:
      print(json.dumps(summary))
    else:
      line = (f"\n\n[{method}: {summary['num_new_tokens']} tokens, "
              f"{result.num_target_forwards} target forwards, tau {summary['tau']}, "
              f"{summary['tokens_per_s']} tokens/s, compile {result.compile_s:.1f}s")
      if compare_ar:
        line += (f"; {summary['speedup']}x over AR, "
                 f"{'identical to' if summary['identical_to_ar'] else 'differs from'} AR")
      print(line + "]", file=sys.stderr)
    for row, (reason, tokens) in enumerate(zip(result.stop_reasons, result.tokens)):
      if reason == "cache_full":
        print(f"row {row} stopped after {len(tokens)} of {args.max_new_tokens} tokens: the KV "
              "cache is full (raise --cache-size)", file=sys.stderr)

  cli.run(decode)


if __name__ == "__main__":
  main()
