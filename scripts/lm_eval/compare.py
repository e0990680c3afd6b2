"""lm_eval's scores through the server against the same scores computed from the target directly.

  python scripts/lm_eval/compare.py OUTPUT_DIR   # lm_eval's --output_path (with --log_samples)

Direct: transformers' Qwen3ForCausalLM on the embedded target in float32, the requests formed as
lm_eval forms them (its context / continuation split, its greedy stop at `until`). Prints both
scores per task and, per item, the loglikelihoods (within 1e-3 per token) and generations (equal);
exits 1 if anything differs.
"""

from __future__ import annotations

import glob
import json
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from jetflow_jax import embedded  # noqa: E402
from jetflow_jax.text import load_tokenizer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TOLERANCE = 1e-3  # per token
UNTIL, MAX_GEN_TOKS = "\n", 16  # as jetflow_gen.yaml


def read_jsonl(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


class Target:
  """The embedded target in float32, and its tokenizer, as lm_eval's huggingface backend uses it."""

  def __init__(self):
    from transformers import Qwen3ForCausalLM
    self.tokenizer = load_tokenizer(embedded.default_target())
    self.model = Qwen3ForCausalLM.from_pretrained(embedded.default_target(),
                                                  dtype=torch.float32).eval()

  def encode(self, text: str) -> list[int]:
    return self.tokenizer(text, add_special_tokens=False).input_ids

  def log_softmax(self, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
      logits = self.model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()

  def loglikelihood(self, context: str, continuation: str) -> tuple[float, int]:
    """Sum of the continuation's log-probabilities, and its token count, with the tokens lm_eval
    sends: its `_encode_pair` moves the context's trailing spaces to the continuation, takes the
    continuation's tokens from the whole's encoding and puts them after the context's own (which
    differ from the whole's prefix where a token spans the boundary)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
      context, continuation = context[:-spaces], context[-spaces:] + continuation
    start = len(context_ids := self.encode(context))
    ids = context_ids + self.encode(context + continuation)[start:]
    rows = self.log_softmax(ids)
    return float(sum(rows[t - 1, ids[t]] for t in range(start, len(ids)))), len(ids) - start

  def greedy(self, context: str) -> str:
    """Greedy tokens until the end-of-text token or MAX_GEN_TOKS, cut before UNTIL."""
    ids, new = self.encode(context), []
    eos = self.model.config.eos_token_id
    for _ in range(MAX_GEN_TOKS):
      token = int(np.argmax(self.log_softmax(ids + new)[-1]))
      if token == eos:
        break
      new.append(token)
    text = self.tokenizer.decode(new, skip_special_tokens=True)
    return text.split(UNTIL)[0]


def lm_eval_output(directory: str) -> tuple[dict, dict]:
  """lm_eval's results (per task) and its samples (per task, by doc_id)."""
  results_path = max(glob.glob(os.path.join(directory, "**", "results_*.json"), recursive=True),
                     key=os.path.getmtime)
  with open(results_path) as f:
    results = json.load(f)["results"]
  samples = {}
  for task in ("jetflow_mc", "jetflow_gen"):
    path = max(glob.glob(os.path.join(directory, "**", f"samples_{task}_*.jsonl"),
                         recursive=True), key=os.path.getmtime)
    samples[task] = {s["doc_id"]: s for s in read_jsonl(path)}
  return results, samples


def main() -> int:
  results, samples = lm_eval_output(sys.argv[1])
  target, problems = Target(), []

  correct = []
  for i, item in enumerate(read_jsonl(os.path.join(HERE, "mc.jsonl"))):
    scored = [target.loglikelihood(item["question"], choice) for choice in item["choices"]]
    served = [float(resp[0]) for resp in samples["jetflow_mc"][i]["filtered_resps"]]
    for (direct, count), ll in zip(scored, served):
      if abs(direct - ll) > TOLERANCE * count:
        problems.append(f"jetflow_mc item {i}: loglikelihood {ll} through the server, "
                        f"{direct} directly")
    correct.append(int(np.argmax([s for s, _ in scored])) == item["answer"])
  direct_scores = {"jetflow_mc": ("acc,none", float(np.mean(correct)))}

  matches = []
  for i, item in enumerate(read_jsonl(os.path.join(HERE, "gen.jsonl"))):
    direct, served = target.greedy(item["prompt"]), samples["jetflow_gen"][i]["filtered_resps"][0]
    if direct != served:
      problems.append(f"jetflow_gen item {i}: {served!r} through the server, {direct!r} directly")
    matches.append(direct == item["target"])
  direct_scores["jetflow_gen"] = ("exact_match,none", float(np.mean(matches)))

  print("| task | metric | lm_eval through the server | directly from the target |\n"
        "|---|---|---|---|")
  for task, (metric, direct) in direct_scores.items():
    served = results[task][metric]
    print(f"| {task} | {metric.split(',')[0]} | {served:.4f} | {direct:.4f} |")
    if abs(served - direct) > 1e-9:
      problems.append(f"{task}: {metric} {served} through the server, {direct} directly")
  for problem in problems:
    print(f"DIFFERS: {problem}")
  print("scores and every item agree" if not problems else f"{len(problems)} differences")
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main())
