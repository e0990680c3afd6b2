"""A byte-level BPE tokenizer for the embedded model, trained on the corpus's training files."""

from __future__ import annotations

import argparse
import os
import time

from jetflow_jax.embedded import corpus

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"  # reserved for the draft head's MASK rows; never in the text
VOCAB_SIZE = 8192


def train_tokenizer(out_dir: str, vocab_size: int = VOCAB_SIZE):
  """Trains the BPE on the training files and saves `tokenizer.json` + `tokenizer_config.json`."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  train_files, _ = corpus.split_files()
  bpe = Tokenizer(models.BPE())
  bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN, MASK_TOKEN],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=True)
  bpe.train_from_iterator((corpus.read_source(f) for f in train_files), trainer,
                          length=len(train_files))
  tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS_TOKEN,
                                      pad_token=EOS_TOKEN,
                                      additional_special_tokens=[MASK_TOKEN])
  tokenizer.save_pretrained(out_dir)
  return tokenizer


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", required=True, help="directory for the tokenizer files")
  parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
  args = parser.parse_args()
  start = time.perf_counter()
  tokenizer = train_tokenizer(args.out, args.vocab_size)
  print(f"vocab {len(tokenizer)} written to {os.path.abspath(args.out)} "
        f"in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  main()
