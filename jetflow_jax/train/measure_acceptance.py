"""Measure a draft head's acceptance on held-out prompts and keep it beside the head.

  python -m jetflow_jax.train.measure_acceptance --head HEAD_DIR --checkpoint TARGET \
      --prompts held_out.jsonl [--count 64 --max-new-tokens 256]

The target continues each prompt greedily; `head_acceptance.measure_acceptance` reads, at every
tree budget, what the head's greedy rounds commit and what its drafts predict on those
continuations, and `acceptance.json` in the head's directory keeps it: `--budget auto` starts a
target the head never drafted for from it. For a head trained here (`train.py` writes the
exported head to WORKDIR/hf_head) or brought from elsewhere (JetSpec, speculators): give prompts
it did not train on. `train.py --config.eval.prompts=held_out.jsonl` does the same at the end of
a run (`held_out_acceptance`).
"""

from __future__ import annotations

import argparse
import itertools
import os

import tqdm

from jetflow_jax import cli, embedded, hub
from jetflow_jax.checkpoint import load_qwen3
from jetflow_jax.decoding import generate
from jetflow_jax.errors import InputError
from jetflow_jax.head_acceptance import ACCEPTANCE_FILE, HeadAcceptance, measure_acceptance
from jetflow_jax.head_checkpoint import load_head, workdir_head_config
from jetflow_jax.train.data import prompt_ids, read_jsonl, record_id
from jetflow_jax.train.regenerate import tokenizer_if_needed

GENERATE_BATCH = 8  # prompts the target continues at once


def held_out_prompts(path: str, count: int, tokenizer_dir: str) -> list[list[int]]:
  """The token ids of the first `count` prompts of `path` (the `data.prompts` format)."""
  records = list(itertools.islice(read_jsonl(path), count))
  if not records:
    raise InputError(f"{path} holds no prompt")
  tokenizer = tokenizer_if_needed(records, tokenizer_dir)
  return [prompt_ids(r, tokenizer, f"{path}: record {record_id(r, i)}")
          for i, r in enumerate(records)]


def held_out_acceptance(head_params, head_config, target_params, target_config,
                        prompts: list[list[int]], max_new_tokens: int) -> HeadAcceptance:
  """The head's `HeadAcceptance` on the target's greedy continuations of `prompts`.

  Args:
    prompts: token ids of prompts the head did not train on (`held_out_prompts`).
    max_new_tokens: tokens of each continuation; the anchors lie along them.

  Raises:
    InputError: no continuation long enough for one anchor of the head's full depth.
  """
  continuations = []
  for start in tqdm.trange(0, len(prompts), GENERATE_BATCH, desc="target's continuations",
                           unit="batch"):
    chunk = prompts[start:start + GENERATE_BATCH]
    continuations += zip(chunk, generate(target_params, target_config, chunk,
                                         max_new_tokens).tokens)
  try:
    return measure_acceptance(head_params, head_config, target_params, target_config,
                              continuations)
  except ValueError as e:
    raise InputError(f"{e}: give more new tokens (--max-new-tokens, eval.max_new_tokens) or "
                     "prompts the target answers at length") from None


def save_beside_head(acceptance: HeadAcceptance, head_dir: str) -> list[str]:
  """Writes `acceptance.json` into `head_dir` and, for a training workdir, its exported
  `hf_head/` (what leaves with the head; the workdir is what decode.py --head WORKDIR reads).
  Returns the files written."""
  exported = os.path.join(head_dir, "hf_head")
  written = [head_dir] + ([exported] if workdir_head_config(head_dir) is not None
                          and os.path.isdir(exported) else [])
  for directory in written:
    acceptance.save(directory)
  return [os.path.join(d, ACCEPTANCE_FILE) for d in written]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
      description="Measure what a draft head's rounds commit and predict at every tree budget "
                  f"on held-out prompts; kept as {ACCEPTANCE_FILE} beside the head, where "
                  "--budget auto reads it as its prior on a target it never drafted for.")
  parser.add_argument("--head", required=True,
                      help="head directory, training workdir or hub id (written into)")
  parser.add_argument("--checkpoint", default=None,
                      help="target: directory or hub id (default: the embedded model)")
  parser.add_argument("--prompts", required=True,
                      help="JSONL of prompts the head did not train on, one 'prompt', "
                           "'messages' or 'prompt_ids' per line (train.py's data.prompts format)")
  parser.add_argument("--count", type=int, default=64, help="prompts used, from the first")
  parser.add_argument("--max-new-tokens", type=int, default=256,
                      help="tokens of each greedy continuation")
  args = parser.parse_args(argv)

  def run():
    if args.count < 1 or args.max_new_tokens < 1:
      raise InputError("--count and --max-new-tokens must be positive")
    target = embedded.default_target() if args.checkpoint is None else hub.resolve(
        args.checkpoint)
    prompts = held_out_prompts(args.prompts, args.count, target)
    head_dir = os.path.abspath(os.path.expanduser(hub.resolve(args.head)))
    target_config, target_params = load_qwen3(target)
    head_config, head_params = load_head(head_dir)
    head_config.validate_for(target_config)
    acceptance = held_out_acceptance(head_params, head_config, target_params, target_config,
                                     prompts, args.max_new_tokens)
    written = save_beside_head(acceptance, head_dir)
    print(f"{args.head}: {acceptance.summary()}\nwritten: " + ", ".join(written))

  cli.run(run)


if __name__ == "__main__":
  main()
