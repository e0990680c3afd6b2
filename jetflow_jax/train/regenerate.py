"""Regenerate responses with the target itself, so the head learns the target's own outputs.

  python -m jetflow_jax.train.regenerate --target /models/Qwen3-8B --prompts prompts.jsonl \
      --out regenerated.jsonl --max-new-tokens 2048 --batch-size 32

Resumable: records already in `--out` (by id) are skipped, and each finished
batch is appended and flushed, so an interrupted run loses at most one batch.
`--backend torch` decodes with transformers' `generate` instead (CPU, float32): on
the 2-core CI machines it decodes small targets about twice as fast as our JAX loop
at batch 64, where XLA's CPU matmuls are the bottleneck.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Callable, Sequence

import tqdm

from jetflow_jax import cli
from jetflow_jax.checkpoint import is_converted, load_qwen3
from jetflow_jax.config import Qwen3Config
from jetflow_jax.errors import InputError
from jetflow_jax.generate import generate
from jetflow_jax.sampling import Sampler, make_sampler
from jetflow_jax.train.data import prompt_ids, read_jsonl, record_id

CACHE_ROUNDING = 16  # cache sizes a regeneration run may compile for: few, and nearly tight
BACKENDS = ("jax", "torch")
# (prompts, seed) -> each prompt's response token ids, its stop token included.
BatchGenerator = Callable[[list[list[int]], int], list[list[int]]]


def finished_ids(out_path: str) -> set[str]:
  """Ids already written; a torn last line (killed mid-write) is dropped, not fatal."""
  if not os.path.isfile(out_path):
    return set()
  ids, keep = set(), 0
  with open(out_path) as f:
    lines = f.readlines()
  for line in lines:
    try:
      ids.add(str(json.loads(line)["id"]))
      keep += 1
    except (json.JSONDecodeError, KeyError):
      break
  if keep < len(lines):
    with open(out_path, "w") as f:
      f.writelines(lines[:keep])
  return ids


def tokenizer_if_needed(records: Sequence[dict[str, Any]], directory: str):
  """The tokenizer in `directory` when some record has text rather than `prompt_ids`."""
  if all("prompt_ids" in r for r in records):
    return None
  from jetflow_jax.text import load_tokenizer  # transformers is slow to import
  return load_tokenizer(directory)


def tight_cache_size(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> int:
  """The longest prompt plus `max_new_tokens`, rounded up to a multiple of CACHE_ROUNDING.

  Decoding reads the whole cache every step (on CPU, measured: a 512-slot cache decodes at
  half the speed of a 320-slot one), so regeneration, which runs for hours, sizes it to fit
  rather than to a power of two.
  """
  needed = max(len(p) for p in prompts) + max_new_tokens
  return -(-needed // CACHE_ROUNDING) * CACHE_ROUNDING


def jax_generator(target_params, target_config: Qwen3Config, max_new_tokens: int,
                  sampler: Sampler) -> BatchGenerator:
  """Our jitted decode loop, its cache sized to each batch."""
  def generate_batch(prompts, seed):
    return generate(target_params, target_config, prompts, max_new_tokens, sampler=sampler,
                    seed=seed, cache_size=tight_cache_size(prompts, max_new_tokens)).tokens
  return generate_batch


def torch_generator(checkpoint_dir: str, max_new_tokens: int,
                    temperature: float) -> BatchGenerator:
  """transformers' `generate` on the same HF checkpoint, float32, prompts left-padded."""
  if is_converted(checkpoint_dir) or not os.path.isfile(os.path.join(checkpoint_dir,
                                                                       "config.json")):
    raise InputError(f"the torch backend needs a Hugging Face checkpoint directory "
                     f"(config.json + safetensors); {checkpoint_dir} is not one")
  import torch
  from transformers import Qwen3ForCausalLM
  model = Qwen3ForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32).eval()
  eos = model.config.eos_token_id
  stop = [eos] if isinstance(eos, int) else list(eos)
  pad = model.config.pad_token_id if model.config.pad_token_id is not None else stop[0]

  def generate_batch(prompts, seed):
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
      ids[row, width - len(prompt):] = torch.tensor(prompt)
      mask[row, width - len(prompt):] = 1
    torch.manual_seed(seed)
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) \
        if temperature > 0 else dict(do_sample=False)
    with torch.no_grad():
      out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                           eos_token_id=stop, pad_token_id=pad, **sampling)
    responses = []
    for row in out[:, width:].tolist():
      end = next((i + 1 for i, token in enumerate(row) if token in stop), len(row))
      responses.append(row[:end])
    return responses
  return generate_batch


def regenerate(records: Sequence[dict[str, Any]], out_path: str, generate_batch: BatchGenerator,
               *, tokenizer=None, batch_size: int, max_prompt_len: int, seed: int = 0) -> int:
  """Appends `{"id", "prompt_ids", "response_ids"[, "response"]}` lines for unfinished records.

  `generate_batch` is `jax_generator(...)` or `torch_generator(...)`. Returns the number
  of records regenerated by this call.
  """
  done = finished_ids(out_path)
  pending = []
  for index, record in enumerate(records):
    rid = record_id(record, index)
    if rid not in done:
      ids = prompt_ids(record, tokenizer, f"record {rid}")
      if 0 < len(ids) <= max_prompt_len:
        pending.append((rid, ids))
  # Similar lengths together: fewer padded slots and fewer prompt buckets to compile.
  pending.sort(key=lambda item: len(item[1]))
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  with open(out_path, "a") as out, tqdm.tqdm(total=len(done) + len(pending), initial=len(done),
                                             desc="regenerate", unit="prompt") as bar:
    for start in range(0, len(pending), batch_size):
      batch = pending[start:start + batch_size]
      # Pad the last batch to full size so it reuses the compiled shapes.
      prompts = [ids for _, ids in batch] + [batch[-1][1]] * (batch_size - len(batch))
      for (rid, ids), response in zip(batch, generate_batch(prompts, seed + start)):
        line = {"id": rid, "prompt_ids": ids, "response_ids": response}
        if tokenizer is not None:
          line["response"] = tokenizer.decode(response, skip_special_tokens=True)
        out.write(json.dumps(line) + "\n")
      out.flush()
      bar.update(len(batch))
  return len(pending)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--target", required=True, help="target checkpoint directory")
  parser.add_argument("--prompts", required=True, help="JSONL of prompts / conversations")
  parser.add_argument("--out", required=True, help="JSONL to append regenerated records to")
  parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --target)")
  parser.add_argument("--max-new-tokens", type=int, default=2048)
  parser.add_argument("--max-prompt-len", type=int, default=1024)
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--temperature", type=float, default=0.0)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--dtype", default="bfloat16", help="jax backend only (torch: float32)")
  parser.add_argument("--backend", default="jax", choices=BACKENDS)
  parser.add_argument("--threads", type=int, default=0, help="torch backend: CPU threads "
                      "(0: torch's default)")
  args = parser.parse_args(argv)

  def run():
    if args.batch_size < 1:
      raise InputError(f"--batch-size must be >= 1 (got {args.batch_size})")
    records = list(read_jsonl(args.prompts))
    tokenizer = tokenizer_if_needed(records, args.tokenizer or args.target)
    if args.backend == "torch":
      import torch
      if args.threads:
        torch.set_num_threads(args.threads)
      generate_batch = torch_generator(args.target, args.max_new_tokens, args.temperature)
    else:
      config, params = load_qwen3(args.target, cli.parse_dtype(args.dtype))
      generate_batch = jax_generator(params, config, args.max_new_tokens,
                                     make_sampler(args.temperature))
    count = regenerate(records, args.out, generate_batch, tokenizer=tokenizer,
                       batch_size=args.batch_size, max_prompt_len=args.max_prompt_len,
                       seed=args.seed)
    print(f"regenerated {count} records into {args.out}")

  cli.run(run)


if __name__ == "__main__":
  main()
