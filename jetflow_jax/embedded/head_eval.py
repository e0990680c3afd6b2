"""Held-out agreement of an embedded head with its target: the heads' quality bar.

The target continues snippets of the held-out standard-library files (never trained
on, by the target or the heads); at sampled response positions the head's top-1 guess
at every depth is compared with the target's own top-1. The same on fresh snippets of
the training files (another seed than the heads' prompts) separates what the heads
overfit from what is new to both models; HumanEval prompts are where the benchmark runs.

  python -m jetflow_jax.embedded.head_eval --head runs/embedded/head_jetflow \
      --head runs/embedded/head_dflash [--save-quality] [--save-acceptance]
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from jetflow_jax import cli, embedded
from jetflow_jax.decoding import generate
from jetflow_jax.embedded import evaluation
from jetflow_jax.embedded.prompts import snippet_prompts
from jetflow_jax.head_acceptance import ACCEPTANCE_FILE, measure_acceptance
from jetflow_jax.head import training_hidden
from jetflow_jax.model import forward, lm_logits
from jetflow_jax.train.data import to_row
from jetflow_jax.train.step import LossConfig, make_loss_fn

SEQ_LEN = 304  # configs/embedded.py: 48 prompt tokens + 256 new ones


def continuations(target_params, target_config, prompts, max_new_tokens: int) -> list[dict]:
  """The target's greedy continuations of `prompts`, as training-style records."""
  responses = generate(target_params, target_config, prompts, max_new_tokens).tokens
  return [{"prompt_ids": p, "response_ids": r} for p, r in zip(prompts, responses)]


def snippet_records(target_params, target_config, tokenizer, count: int,
                    heldout: bool = True) -> list[dict]:
  """Continuations of `count` held-out (or fresh training-file) snippets, as the heads saw."""
  # Seed 0 drew the heads' training prompts; 1 and 2 draw others.
  prompts = snippet_prompts(tokenizer, count, prompt_tokens=48, seed=1 if heldout else 2,
                            heldout=heldout)
  return continuations(target_params, target_config, prompts, SEQ_LEN - 48)


def humaneval_records(target_params, target_config, tokenizer, count: int) -> list[dict]:
  """128-token continuations of the first `count` HumanEval prompts, as the benchmark runs them.

  Each prompt keeps its last SEQ_LEN - 128 tokens, so prompt and continuation fit one row.
  """
  prompts = [tokenizer.encode(text, add_special_tokens=False)[-(SEQ_LEN - 128):]
             for text in evaluation.humaneval_prompts()[:count]]
  return continuations(target_params, target_config, prompts, 128)


def agreement_by_depth(head_params, head_config, target_params, target_config,
                       records: list[dict], num_anchors: int = 96, batch_size: int = 4):
  """Top-1 agreement with the target per depth, averaged over batches of `records`."""
  loss_fn = jax.jit(make_loss_fn(head_config, target_config, LossConfig(num_anchors=num_anchors)))
  per_batch = []
  for start in range(0, len(records) - batch_size + 1, batch_size):
    rows = [to_row(r, SEQ_LEN) for r in records[start:start + batch_size]]
    tokens_bt = jnp.asarray(np.stack([r["tokens"] for r in rows]))
    loss_mask_bt = jnp.asarray(np.stack([r["loss_mask"] for r in rows]))
    _, aux = loss_fn(head_params, target_params, tokens_bt, loss_mask_bt, jax.random.key(start))
    per_batch.append(np.asarray(aux["agreement_k"]))
  return np.mean(per_batch, axis=0)


def _latest_earlier_occurrence(tokens: list[int]) -> list[int | None]:
  """For each position, the latest earlier position holding the same token (None: first one)."""
  last_seen, found = {}, []
  for a, token in enumerate(tokens):
    found.append(last_seen.get(token))
    last_seen[token] = a
  return found


def copy_rule_agreement_by_depth(records: list[dict], depth: int) -> np.ndarray:
  """Per-depth agreement of a rule with no head: repeat what followed the anchor last time.

  At anchor a, j is the latest earlier position holding the same token; the rule guesses
  that the text repeats with period a - j, so depth k gets token j + 1 + (k - 1) % (a - j).
  No earlier occurrence counts as a miss. Every response anchor with a next response token is
  scored, against the continuation itself (the target's greedy top-1).
  """
  hits_k, counts_k = np.zeros(depth), np.zeros(depth)
  for record in records:
    tokens = list(record["prompt_ids"]) + list(record["response_ids"])
    earlier = _latest_earlier_occurrence(tokens)
    for a in range(len(record["prompt_ids"]), len(tokens)):
      j = earlier[a]
      for k in range(1, min(depth, len(tokens) - 1 - a) + 1):
        counts_k[k - 1] += 1
        if j is not None:
          hits_k[k - 1] += tokens[j + 1 + (k - 1) % (a - j)] == tokens[a + k]
  return hits_k / np.maximum(counts_k, 1)


def copy_rule_next_tokens(record: dict) -> np.ndarray:
  """The copy rule's depth-1 guess at every response anchor with a next token (-1: no guess)."""
  tokens = list(record["prompt_ids"]) + list(record["response_ids"])
  earlier = _latest_earlier_occurrence(tokens)
  return np.asarray([-1 if earlier[a] is None else tokens[earlier[a] + 1]
                     for a in range(len(record["prompt_ids"]), len(tokens) - 1)], np.int64)


def agreement_split_by_copy_rule(records: list[dict], head_next_tokens: list) -> dict:
  """Depth-1 agreement of a head where the copy rule is right and where it is not.

  `head_next_tokens[i]` holds the head's depth-1 guesses at record i's response anchors (as
  `copy_rule_next_tokens` orders them). A head that had learned to find the earlier
  occurrence would agree nearly always where the copy rule is right.
  """
  right, head_hits = [], []
  for record, guesses in zip(records, head_next_tokens):
    tokens = list(record["prompt_ids"]) + list(record["response_ids"])
    truth = np.asarray(tokens[len(record["prompt_ids"]) + 1:], np.int64)  # after each anchor
    right.append(copy_rule_next_tokens(record) == truth)
    head_hits.append(np.asarray(guesses) == truth)
  right, head_hits = np.concatenate(right), np.concatenate(head_hits)
  return {"copy_rule_right_share": float(right.mean()),
          "where_copy_rule_right": float(head_hits[right].mean()) if right.any() else 0.0,
          "where_copy_rule_wrong": float(head_hits[~right].mean()) if (~right).any() else 0.0}


@functools.partial(jax.jit, static_argnames=("head_config", "target_config"))
def _depth1_argmax(head_params, head_config, target_params, target_config, tokens_bt,
                   anchors_ba):
  _, _, taps_btld = forward(target_params, target_config, tokens_bt,
                            tap_layers=head_config.target_layer_ids)
  hidden_bakd = training_hidden(head_params, head_config, target_params, target_config,
                                taps_btld, tokens_bt, anchors_ba)
  return jnp.argmax(lm_logits(target_params, target_config, hidden_bakd[:, :, 0]), -1)


def depth1_guesses(head_params, head_config, target_params, target_config,
                   records: list[dict]) -> list[np.ndarray]:
  """The head's top-1 depth-1 guess at every response anchor of each record (one at a time)."""
  out = []
  for record in records:
    # Padded to one shape (one compilation): later rows change nothing before them.
    row = to_row(record, SEQ_LEN)["tokens"]
    length = len(record["prompt_ids"]) + len(record["response_ids"])
    anchors = np.arange(len(record["prompt_ids"]), length - 1)
    padded = np.pad(anchors, (0, SEQ_LEN - len(anchors)), mode="edge")
    guesses = _depth1_argmax(head_params, head_config, target_params, target_config,
                             jnp.asarray(row[None]), jnp.asarray(padded[None]))
    out.append(np.asarray(guesses[0])[:len(anchors)])
  return out


def _report(who: str, split: str, agreement_k) -> list[float]:
  """Prints one agreement line; returns the values rounded for quality.json."""
  print(f"{who}: {split} top-1 agreement by depth " + " ".join(f"{a:.2f}" for a in agreement_k))
  return [round(float(a), 4) for a in agreement_k]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--head", action="append", required=True,
                      help="head directory or train.py workdir (repeatable)")
  parser.add_argument("--target", default=None, help="default: the embedded target")
  parser.add_argument("--count", type=int, default=64, help="prompts per split (held-out "
                      "files, fresh training-file snippets, HumanEval)")
  parser.add_argument("--save-quality", action="store_true",
                      help="write each head's results to HEAD/quality.json")
  parser.add_argument("--save-acceptance", action="store_true",
                      help=f"measure what each head's rounds commit and predict at every tree "
                           f"budget on the held-out split, kept in HEAD/{ACCEPTANCE_FILE} (the "
                           f"prior of --budget auto)")
  args = parser.parse_args(argv)

  def run():
    from transformers import AutoTokenizer
    from jetflow_jax.checkpoint import load_qwen3
    from jetflow_jax.head_checkpoint import load_head
    target_dir = args.target or embedded.default_target()
    target_config, target_params = load_qwen3(target_dir)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    records = {split: snippet_records(target_params, target_config, tokenizer, args.count,
                                      heldout=split == "heldout")
               for split in ("heldout", "heldin")}
    records["humaneval"] = humaneval_records(target_params, target_config, tokenizer, args.count)
    heads = {path: load_head(path) for path in args.head}
    depth = max(head_config.depth for head_config, _ in heads.values())
    copy_rule = {split: _report("copy rule (no head)", split,
                                copy_rule_agreement_by_depth(split_records, depth))
                 for split, split_records in records.items()}
    for head, (head_config, head_params) in heads.items():
      quality = {"num_snippets": args.count}
      quality.update({f"copy_rule_{split}_agreement_k": agreement_k[:head_config.depth]
                      for split, agreement_k in copy_rule.items()})
      for split, split_records in records.items():
        quality[f"{split}_agreement_k"] = _report(
            head, split, agreement_by_depth(head_params, head_config, target_params,
                                            target_config, split_records))
        split_by_copy = agreement_split_by_copy_rule(split_records, depth1_guesses(
            head_params, head_config, target_params, target_config, split_records))
        print(f"{head}: {split} depth-1 agreement where the copy rule is right "
              f"{split_by_copy['where_copy_rule_right']:.2f} (share "
              f"{split_by_copy['copy_rule_right_share']:.2f}), where it is wrong "
              f"{split_by_copy['where_copy_rule_wrong']:.2f}")
        quality[f"{split}_depth1_by_copy_rule"] = {k: round(v, 4)
                                                   for k, v in split_by_copy.items()}
      if args.save_quality:
        with open(os.path.join(head, "quality.json"), "w") as f:
          json.dump(quality, f, indent=1)
      if args.save_acceptance:
        acceptance = measure_acceptance(
            head_params, head_config, target_params, target_config,
            [(r["prompt_ids"], r["response_ids"]) for r in records["heldout"]])
        acceptance.save(head)
        print(f"{head}: held-out, {acceptance.summary()}; kept in {ACCEPTANCE_FILE}")

  cli.run(run)


if __name__ == "__main__":
  main()
