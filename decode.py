"""Decode with a Qwen3 checkpoint (HF directory or converted by jetflow_jax.convert).

  python decode.py --checkpoint DIR --prompt "Write a haiku" --max-new-tokens 64 --chat
  python decode.py --checkpoint DIR --prompt-ids 1,2,3 --json
"""

from __future__ import annotations

import argparse
import json
import sys

from jetflow_jax import cli
from jetflow_jax.checkpoint import load_qwen3
from jetflow_jax.errors import InputError
from jetflow_jax.generate import generate
from jetflow_jax.sampling import make_sampler
from jetflow_jax.text import encode_prompt, load_tokenizer


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--checkpoint", required=True, help="checkpoint directory")
  prompt = parser.add_mutually_exclusive_group(required=True)
  prompt.add_argument("--prompt", help="prompt text (needs tokenizer files in the checkpoint)")
  prompt.add_argument("--prompt-ids", help="comma-separated prompt token ids")
  parser.add_argument("--max-new-tokens", type=int, default=128)
  parser.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
  parser.add_argument("--json", action="store_true", help="print one JSON object, no streaming")
  parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
  parser.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
  parser.add_argument("--top-p", type=float, default=1.0, help="1.0 disables top-p")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--cache-size", type=int, default=None,
                      help="KV cache slots (default: fits prompt + max new tokens)")
  parser.add_argument("--dtype", default="bfloat16", help="float32 or bfloat16")
  return parser.parse_args(argv)


def parse_ids(text: str) -> list[int]:
  try:
    return [int(t) for t in text.split(",") if t.strip()]
  except ValueError:
    raise InputError(f"--prompt-ids must be comma-separated integers (got {text!r})") from None


def main(argv=None) -> None:
  args = parse_args(argv)

  def decode():
    sampler = make_sampler(args.temperature, args.top_k, args.top_p)
    config, params = load_qwen3(args.checkpoint, cli.parse_dtype(args.dtype))
    tokenizer = None
    if args.prompt is not None:
      tokenizer = load_tokenizer(args.checkpoint)
      prompt_ids = encode_prompt(tokenizer, args.prompt, args.chat)
    else:
      prompt_ids = parse_ids(args.prompt_ids)
    if bad := [t for t in prompt_ids if not 0 <= t < config.vocab_size]:
      raise InputError(f"prompt token ids out of range [0, {config.vocab_size}): {bad[:10]}")

    printed = [""]

    def stream(tokens):
      text = tokenizer.decode(tokens[0], skip_special_tokens=True) if tokenizer else " ".join(
          map(str, tokens[0]))
      sys.stdout.write(text[len(printed[0]):])
      sys.stdout.flush()
      printed[0] = text

    result = generate(params, config, [prompt_ids], args.max_new_tokens, sampler=sampler,
                      seed=args.seed, cache_size=args.cache_size,
                      on_tokens=None if args.json else stream)
    tokens = result.tokens[0]
    text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer else None
    summary = {
        "token_ids": tokens,
        "text": text,
        "num_prompt_tokens": len(prompt_ids),
        "num_new_tokens": len(tokens),
        "num_target_forwards": result.num_forwards,
        "compile_s": round(result.compile_s, 4),
        "wall_s": round(result.wall_s, 4),
        "tokens_per_s": round(len(tokens) / result.wall_s, 2),
    }
    if args.json:
      print(json.dumps(summary))
    else:
      print(f"\n\n[{len(tokens)} tokens, {result.num_forwards} target forwards, "
            f"{summary['tokens_per_s']} tokens/s, compile {result.compile_s:.1f}s]",
            file=sys.stderr)

  cli.run(decode)


if __name__ == "__main__":
  main()
