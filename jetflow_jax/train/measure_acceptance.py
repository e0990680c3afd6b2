"""Measure a draft head's acceptance on held-out prompts and keep it beside the head.

  python -m jetflow_jax.train.measure_acceptance --head HEAD_DIR --checkpoint TARGET \
      --prompts held_out.jsonl [--count 64 --max-new-tokens 256]

The target continues each prompt greedily; `head_acceptance.measure_acceptance` reads, at every
tree budget, what the head's greedy rounds commit and what its drafts predict on those
continuations, and `acceptance.json` in the head's directory keeps it: `--budget auto` starts a
target the head never drafted for from it. For a head trained here (`train.py` writes the
exported head to WORKDIR/hf_head) or brought from elsewhere (JetSpec, speculators): give prompts
it did not train on.
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
from jetflow_jax.head_acceptance import ACCEPTANCE_FILE, measure_acceptance
from jetflow_jax.head_checkpoint import load_head, workdir_head_config
from jetflow_jax.train.data import prompt_ids, read_jsonl, record_id
from jetflow_jax.train.regenerate import tokenizer_if_needed

GENERATE_BATCH = 8  # prompts the target continues at once


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
    records = list(itertools.islice(read_jsonl(args.prompts), args.count))
    if not records:
      raise InputError(f"{args.prompts} holds no prompt")
    target = embedded.default_target() if args.checkpoint is None else hub.resolve(
        args.checkpoint)
    head_dir = os.path.abspath(os.path.expanduser(hub.resolve(args.head)))
    target_config, target_params = load_qwen3(target)
    head_config, head_params = load_head(head_dir)
    head_config.validate_for(target_config)
    tokenizer = tokenizer_if_needed(records, target)
    prompts = [prompt_ids(r, tokenizer, f"{args.prompts}: record {record_id(r, i)}")
               for i, r in enumerate(records)]
    continuations = []
    for start in tqdm.trange(0, len(prompts), GENERATE_BATCH, desc="target's continuations",
                             unit="batch"):
      chunk = prompts[start:start + GENERATE_BATCH]
      continuations += zip(chunk, generate(target_params, target_config, chunk,
                                           args.max_new_tokens).tokens)
    try:
      acceptance = measure_acceptance(head_params, head_config, target_params, target_config,
                                      continuations)
    except ValueError as e:
      raise InputError(f"{e}: raise --max-new-tokens or give prompts the target answers at "
                       "length") from None
    # A workdir's exported head is what leaves with the acceptance; the workdir is what
    # decode.py --head WORKDIR reads.
    exported = os.path.join(head_dir, "hf_head")
    written = [head_dir] + ([exported] if workdir_head_config(head_dir) is not None
                            and os.path.isdir(exported) else [])
    for directory in written:
      acceptance.save(directory)
    print(f"{args.head}: {acceptance.summary()}\nwritten: "
          + ", ".join(os.path.join(d, ACCEPTANCE_FILE) for d in written))

  cli.run(run)


if __name__ == "__main__":
  main()
