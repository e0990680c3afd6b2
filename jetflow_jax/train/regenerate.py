"""Regenerate responses with the target itself, so the head learns the target's own outputs.

  python -m jetflow_jax.train.regenerate --target /models/Qwen3-8B --prompts prompts.jsonl \
      --out STORE --max_new_tokens 2048 --batch_size 32
  # N processes (one per host): add --coordinator_address=HOST:PORT --num_processes=N
  # --process_id=I to each; on SLURM, Open MPI or a TPU pod JAX finds them by itself.

The responses go into a token store (`store.py`). Process p of N regenerates prompts p,
p + N, p + 2N, ... into shard p of N, on all of its local devices (data-parallel copies of
the target, which must fit on one device); training reads the shards together.
Resumable per shard: every finished batch is committed, records already in the shard (by
id) are skipped, and the shard is marked complete once its share is done, so an
interrupted run loses at most one batch. `--backend torch` decodes with transformers'
`generate` instead (CPU, float32): on the 2-core CI machines it decodes small targets about
twice as fast as our JAX loop at batch 64, where XLA's CPU matmuls are the bottleneck.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import jax
import tqdm

from jetflow_jax import cli
from jetflow_jax.checkpoint import is_converted
from jetflow_jax.config import Qwen3Config
from jetflow_jax.errors import InputError
from jetflow_jax.generate import generate
from jetflow_jax.mesh import DecodeMesh, parse_mesh
from jetflow_jax.sampling import Sampler
from jetflow_jax.train.data import prompt_ids, record_id
from jetflow_jax.train.store import ShardWriter

CACHE_ROUNDING = 16  # cache sizes a regeneration run may compile for: few, and nearly tight
BACKENDS = ("jax", "torch")
# (prompts, seed) -> each prompt's response token ids, its stop token included.
BatchGenerator = Callable[[list[list[int]], int], list[list[int]]]


def local_mesh(model_axes: str = "") -> DecodeMesh:
  """This process's devices: copies of the target over `data`, each copy split over the
  `model_axes` (`tp=T[,ep=E]`, for a target that does not fit on one device)."""
  sizes = parse_mesh(model_axes)
  if "data" in sizes:
    raise InputError(f"the regeneration mesh {model_axes!r} names data: data-parallel copies "
                     "fill this process's devices by themselves; give tp and ep only")
  devices = jax.local_devices()
  per_copy = sizes.get("tp", 1) * sizes.get("ep", 1)
  if len(devices) % per_copy:
    raise InputError(f"the regeneration mesh {model_axes!r} needs {per_copy} devices a copy; "
                     f"this process has {len(devices)}, not a multiple of it")
  return DecodeMesh.create(data=len(devices) // per_copy, devices=devices, **sizes)


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
                  sampler: Sampler, mesh: DecodeMesh | None = None) -> BatchGenerator:
  """Our jitted decode loop, its cache sized to each batch; with `mesh` (a local mesh), the
  batch is split over its data-parallel copies of the target."""
  ways = 1 if mesh is None else mesh.size("data")
  widest = 0

  def generate_batch(prompts, seed):
    nonlocal widest
    widest = max(widest, -(-len(prompts) // ways) * ways)
    # A short (last) batch is padded to the widest so far so it reuses the compiled shapes.
    padded = list(prompts) + [prompts[-1]] * (widest - len(prompts))
    return generate(target_params, target_config, padded, max_new_tokens, sampler=sampler,
                    seed=seed, cache_size=tight_cache_size(padded, max_new_tokens),
                    mesh=mesh).tokens[:len(prompts)]
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


def regenerate(records: Sequence[dict[str, Any]], store_dir: str,
               make_generator: Callable[[], BatchGenerator], *, tokenizer=None, batch_size: int,
               max_prompt_len: int, seed: int = 0, shard: int = 0, num_shards: int = 1) -> int:
  """Regenerates this shard's share of `records` (every `num_shards`-th from `shard`) into
  shard `shard` of the store at `store_dir`; returns how many this call regenerated.

  `make_generator()` returns `jax_generator(...)` or `torch_generator(...)`; it is called
  only when something is left to regenerate (a finished shard loads no target). Prompts
  longer than `max_prompt_len` tokens are skipped.
  """
  if os.path.isfile(store_dir):
    raise InputError(f"the regeneration output must be a token store directory; {store_dir} is "
                     "a file (a JSONL from an older version? train.py converts those itself)")
  writer = ShardWriter(store_dir, shard, num_shards)
  pending, skipped = [], 0
  for index in range(shard, len(records), num_shards):
    rid = record_id(records[index], index)
    if rid not in writer.done_ids:
      ids = prompt_ids(records[index], tokenizer, f"record {rid}")
      if 0 < len(ids) <= max_prompt_len:
        pending.append((rid, index, ids))
      else:
        skipped += 1
  # Similar lengths together: fewer padded slots and fewer prompt buckets to compile.
  pending.sort(key=lambda item: len(item[2]))
  generate_batch = make_generator() if pending else None
  done = len(writer.done_ids)
  description = "regenerate" + (f" (shard {shard + 1}/{num_shards})" if num_shards > 1 else "")
  with tqdm.tqdm(total=done + len(pending), initial=done, desc=description, unit="prompt") as bar:
    for start in range(0, len(pending), batch_size):
      batch = pending[start:start + batch_size]
      responses = generate_batch([ids for _, _, ids in batch], seed + start)
      writer.append((rid, index, ids, response)
                    for (rid, index, ids), response in zip(batch, responses, strict=True))
      bar.update(len(batch))
  writer.finish()
  writer.close()
  if skipped:
    print(f"regenerate: skipped {skipped} prompts that are empty or longer than {max_prompt_len} "
          "tokens", flush=True)
  return len(pending)


def _define_flags() -> None:
  from absl import flags
  flags.DEFINE_string("target", None, "target checkpoint directory")
  flags.DEFINE_string("prompts", None, "JSONL of prompts / conversations")
  flags.DEFINE_string("out", None, "token store directory to regenerate into (resumable)")
  flags.DEFINE_string("tokenizer", None, "tokenizer directory (default: --target)")
  flags.DEFINE_integer("max_new_tokens", 2048, "tokens per response at most")
  flags.DEFINE_integer("max_prompt_len", 1024, "longer prompts are skipped")
  flags.DEFINE_integer("batch_size", 16, "prompts per batch (per process)")
  flags.DEFINE_float("temperature", 0.0, "0 is greedy")
  flags.DEFINE_integer("seed", 0, "sampling seed")
  flags.DEFINE_string("dtype", "auto", "jax backend: auto (bfloat16 on GPU/TPU, float32 on "
                      "CPU), float32 or bfloat16; torch runs float32")
  flags.DEFINE_enum("backend", "jax", BACKENDS, "jax: our decode loop; torch: transformers")
  flags.DEFINE_integer("threads", 0, "torch backend: CPU threads (0: torch's default)")
  flags.DEFINE_string("mesh", "", "jax backend: tp=T[,ep=E] splits each copy of the target over "
                      "T x E of this process's devices (a target too big for one); copies "
                      "fill the rest")
  for name in ("target", "prompts", "out"):
    flags.mark_flag_as_required(name)


def main(argv) -> None:
  del argv
  from absl import flags

  from jetflow_jax import distributed
  from jetflow_jax.checkpoint import load_qwen3
  from jetflow_jax.sampling import make_sampler
  from jetflow_jax.train.data import read_jsonl
  f = flags.FLAGS

  def run():
    distributed.initialize_from_flags()
    if f.batch_size < 1:
      raise InputError(f"--batch_size must be >= 1 (got {f.batch_size})")
    records = list(read_jsonl(f.prompts))
    tokenizer = tokenizer_if_needed(records, f.tokenizer or f.target)
    dtype = cli.parse_dtype(f.dtype)

    def make_generator():
      if f.backend == "torch":
        import torch
        if f.threads:
          torch.set_num_threads(f.threads)
        return torch_generator(f.target, f.max_new_tokens, f.temperature)
      mesh = local_mesh(f.mesh)
      config, params = load_qwen3(f.target, dtype, mesh.param_shardings)
      return jax_generator(params, config, f.max_new_tokens, make_sampler(f.temperature), mesh)

    count = regenerate(records, f.out, make_generator, tokenizer=tokenizer,
                       batch_size=f.batch_size, max_prompt_len=f.max_prompt_len, seed=f.seed,
                       shard=jax.process_index(), num_shards=jax.process_count())
    print(f"regenerated {count} records into {f.out}")

  cli.run(run)


if __name__ == "__main__":
  from absl import app

  from jetflow_jax import distributed
  _define_flags()
  distributed.define_flags()
  app.run(main)
