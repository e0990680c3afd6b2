"""Export a draft head as vLLM speculators' format or the reference layout.

  python -m jetflow_jax.export_head --head HEAD --format speculators --out DIR \
      [--verifier PATH_OR_ID] [--dtype bfloat16|float32]
  python -m jetflow_jax.export_head --head runs/quick --format reference --out DIR
  python -m jetflow_jax.export_head --head runs/quick --format speculators \
      --speculators-type dflash --verifier Qwen/Qwen3-8B --out DIR   # a causal head, for vLLM

HEAD is any head jetflow_jax loads: a reference-layout or speculators directory, a training
workdir, a hub id. A bidirectional head becomes speculators' `dflash` type, a causal one its
`jetspec` type, naming the verifier (default: the one a speculators head names, the embedded
target for an embedded head); `--speculators-type dflash` writes a causal head as the dflash
type with its layers marked causal, the type vLLM serves today. `decode.py --head DIR` reads
every one of these back.
"""

from __future__ import annotations

import argparse

from jetflow_jax import cli
from jetflow_jax.head_checkpoint import FORMATS, export_head
from jetflow_jax.speculators_format import MODEL_CLASSES, TYPES


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--head", required=True, help="the head to export (directory or hub id)")
  parser.add_argument("--format", required=True, choices=FORMATS)
  parser.add_argument("--out", required=True, help="directory to write")
  parser.add_argument("--verifier", help="the target the head drafts for, as vLLM will load it "
                      "(hub id or directory); its config.json, when at hand, is checked")
  parser.add_argument("--dtype", default="bfloat16", choices=sorted(cli.DTYPES))
  parser.add_argument("--speculators-type", choices=sorted(MODEL_CLASSES),
                      help="default: dflash for a bidirectional head, jetspec for a causal one; "
                      "dflash for a causal head marks its layers causal (vLLM serves dflash)")
  return parser.parse_args(argv)


def main(argv=None) -> None:
  args = parse_args(argv)
  config, verifier = export_head(args.head, args.format, args.out, args.verifier,
                                 cli.parse_dtype(args.dtype), args.speculators_type)
  kind = (f"speculators {args.speculators_type or TYPES[config.causal]}"
          if args.format == "speculators" else "reference-layout")
  vocab = (f"draft vocabulary {config.draft_vocab_size} of {config.vocab_size}"
           if config.draft_vocab_size else f"vocabulary {config.vocab_size}")
  print(f"wrote {args.out}: {kind} head ({'causal' if config.causal else 'bidirectional'}, "
        f"{config.num_layers} layers, taps {list(config.target_layer_ids)}, block "
        f"{config.block_size}, {vocab}, {args.dtype})")
  if verifier is not None:
    read = "checked against its config.json" if verifier.was_read else "its config.json not at hand"
    print(f"verifier: {verifier.name_or_path} ({read})")


if __name__ == "__main__":
  cli.run(main)
