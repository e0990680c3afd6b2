"""Regenerate responses with the target itself, so the head learns the target's own outputs.

  python -m jetflow_jax.train.regenerate --target /models/Qwen3-8B --prompts prompts.jsonl \
      --out STORE --max_new_tokens 2048 --slots 32 [--head HEAD_DIR --method jetflow]
  # N processes (one per host): add --coordinator_address=HOST:PORT --num_processes=N
  # --process_id=I to each; on SLURM, Open MPI or a TPU pod JAX finds them by itself.

The responses go into a token store (`store.py`). Process p of N regenerates prompts p,
p + N, p + 2N, ... into shard p of N, on all of its local devices (data-parallel copies of
the target, each split over `--mesh tp=T` devices when it does not fit on one); training
reads the shards together. A record may carry its own `max_tokens` (at most --max_new_tokens)
and `stop` strings (one or a list): a response ends at the target's stop token, its
`max_tokens`, or through the token that completes a stop string in its text
(`regenerate_backends.finish`), whichever backend made it.

Backends (`regenerate_backends.py`): `jax`, the continuous-batching engine (`--slots`
requests at a time, a new one admitted as soon as one finishes; with `--head`, speculative,
greedy output identical to AR); `jax_static`, our decode loop on sorted batches of
`--batch_size`, each run to its longest `max_tokens`; `torch`, transformers' `generate`
in static batches (CPU, float32: on the 2-core CI machines it decoded small targets about
twice as fast as the static JAX loop at batch 64, where XLA's CPU matmuls are the bottleneck).

`openai` (`regenerate_openai.py`) sends the prompts to OpenAI-compatible servers
(`--server URL[,URL...]`, `--concurrency` requests at once); the ids of records whose tokens
came from a server's text, not its token ids, are listed in the shard's `token_sources.jsonl`.

Resumable per shard: finished records are committed as they come (the engine's out of
order), records already in the shard (by id) are skipped, and the shard is marked complete
once its share is done, so an interrupted run loses only the responses in flight.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Sequence

import jax
import tqdm

from jetflow_jax import cli
from jetflow_jax.decoding.policy import DEFAULT_BUDGET, DEFAULT_TOP_K
from jetflow_jax.errors import InputError
from jetflow_jax.kernels.tree_attention import attention_for_backend
from jetflow_jax.mesh import DecodeMesh, parse_mesh
from jetflow_jax.text import detokenizer
from jetflow_jax.train.data import prompt_ids, record_id
from jetflow_jax.train.regenerate_backends import Generator, Job
from jetflow_jax.train.regenerate_openai import FromText
from jetflow_jax.train.store import ShardWriter

BACKENDS = ("jax", "jax_static", "torch")  # on this process's devices; the CLI adds openai
TOKEN_SOURCES = "token_sources.jsonl"  # per shard: {"id", "token_source": "text"} lines


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
  """The tokenizer in `directory` when some record has text rather than `prompt_ids`, or stop
  strings."""
  if all("prompt_ids" in r and not r.get("stop") for r in records):
    return None
  from jetflow_jax.text import load_tokenizer  # transformers is slow to import
  return load_tokenizer(directory)


def job_for(record: dict[str, Any], index: int, tokenizer, max_new_tokens: int) -> Job:
  """A record's prompt ids, token limit (its own `max_tokens`, at most `max_new_tokens`: the
  longest sizes every slot's cache) and stop strings; bad values raise InputError."""
  rid = record_id(record, index)
  max_tokens = record.get("max_tokens", max_new_tokens)
  if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
    raise InputError(f"record {rid}: max_tokens must be a positive integer (got {max_tokens!r})")
  stop = record.get("stop") or ()
  stop = (stop,) if isinstance(stop, str) else tuple(stop)
  if not all(isinstance(s, str) and s for s in stop):
    raise InputError(f"record {rid}: stop must be a string or a list of non-empty strings")
  return Job(rid, index, prompt_ids(record, tokenizer, f"record {rid}"),
             min(max_tokens, max_new_tokens), stop)


def regenerate(records: Sequence[dict[str, Any]], store_dir: str,
               make_generator: Callable[[], Generator], *, tokenizer=None, max_new_tokens: int,
               max_prompt_len: int, seed: int = 0, shard: int = 0, num_shards: int = 1) -> int:
  """Regenerates this shard's share of `records` (every `num_shards`-th from `shard`) into
  shard `shard` of the store at `store_dir`; returns how many this call regenerated.

  `make_generator()` returns a generator of `regenerate_backends`; it is called only when
  something is left to regenerate (a finished shard loads no target). Every group of records
  it finishes is committed at once. Prompts longer than `max_prompt_len` tokens are skipped.
  Rerunning the same call resumes the shard where it stopped.

  Raises:
    InputError: `store_dir` is a file, or a record is malformed (named by its id).
  """
  if os.path.isfile(store_dir):
    raise InputError(f"the regeneration output must be a token store directory; {store_dir} is "
                     "a file (a JSONL from an older version? train.py converts those itself)")
  writer = ShardWriter(store_dir, shard, num_shards)
  pending, skipped = [], 0
  for index in range(shard, len(records), num_shards):
    if record_id(records[index], index) not in writer.done_ids:
      job = job_for(records[index], index, tokenizer, max_new_tokens)
      if 0 < len(job.prompt) <= max_prompt_len:
        pending.append(job)
      else:
        skipped += 1
  # Similar lengths together: fewer padded rows and fewer prompt buckets to compile.
  pending.sort(key=lambda job: len(job.prompt))
  groups = make_generator()(pending, seed) if pending else ()
  done = len(writer.done_ids)
  description = "regenerate" + (f" (shard {shard + 1}/{num_shards})" if num_shards > 1 else "")
  with tqdm.tqdm(total=done + len(pending), initial=done, desc=description, unit="prompt") as bar:
    for finished in groups:
      # Marked before the commit: a committed record never lacks its mark.
      if from_text := [job.rid for job, response in finished if isinstance(response, FromText)]:
        with open(os.path.join(writer.path, TOKEN_SOURCES), "a") as f:
          f.writelines(json.dumps({"id": rid, "token_source": "text"}) + "\n" for rid in from_text)
      writer.append((job.rid, job.index, job.prompt, response) for job, response in finished)
      bar.update(len(finished))
  writer.finish()
  writer.close()
  if skipped:
    print(f"regenerate: skipped {skipped} prompts that are empty or longer than {max_prompt_len} "
          "tokens", flush=True)
  return len(pending)


def _define_flags() -> None:
  from absl import flags

  from jetflow_jax.pair import define_absl_model_flags
  define_absl_model_flags(mesh_help="jax backends: tp=T[,ep=E] splits each copy of the target "
                          "over T x E of this process's devices (a target too big for one); "
                          "copies fill the rest")
  flags.DEFINE_alias("target", "checkpoint")
  flags.DEFINE_string("prompts", None, "JSONL of prompts / conversations")
  flags.DEFINE_string("out", None, "token store directory to regenerate into (resumable)")
  flags.DEFINE_string("tokenizer", None, "tokenizer directory (default: --target)")
  flags.DEFINE_integer("max_new_tokens", 2048, "tokens per response at most (a record's own "
                       "max_tokens may ask for fewer)")
  flags.DEFINE_integer("max_prompt_len", 1024, "longer prompts are skipped")
  flags.DEFINE_enum("backend", "jax", (*BACKENDS, "openai"), "jax: the continuous-batching "
                    "engine; jax_static: our decode loop on static batches; torch: "
                    "transformers; openai: OpenAI-compatible servers (--server)")
  flags.DEFINE_integer("slots", 16, "jax backend: requests decoded at once (per process)")
  flags.DEFINE_integer("batch_size", 16, "jax_static and torch backends: prompts per batch "
                       "(per process)")
  flags.DEFINE_float("temperature", 0.0, "0 is greedy")
  flags.DEFINE_integer("seed", 0, "sampling seed")
  flags.DEFINE_integer("threads", 0, "torch backend: CPU threads (0: torch's default)")
  flags.DEFINE_list("server", [], "openai backend: server URLs (http://HOST:PORT[/v1]); "
                    "requests go to each in turn")
  flags.DEFINE_integer("concurrency", 16, "openai backend: requests in flight (per process)")
  flags.DEFINE_string("model", None, "openai backend: the served model's name")
  flags.DEFINE_bool("request_token_ids", True, "openai backend: ask for the response's token "
                    "ids (return_token_ids, as vLLM and our server take it); without them the "
                    "text is tokenized")
  for name in ("checkpoint", "prompts", "out"):
    flags.mark_flag_as_required(name)


def make_generator(backend: str, load_target: Callable, *, checkpoint: str, width: int,
                   temperature: float = 0.0, mesh_axes: str = "", tokenizer=None,
                   head: tuple = (None, None), method: str | None = None,
                   budget: int | str = DEFAULT_BUDGET, max_budget: int = 256,
                   top_k: int = DEFAULT_TOP_K, attention: str = "xla") -> Generator:
  """The generator of `backend` (one of BACKENDS), its target loaded now.

  `width`: the engine's slots, or a static batch's prompts. `load_target(shardings)` returns
  the target's (config, params) placed by `shardings` (see `checkpoint.load_qwen3`); torch
  reads the HF `checkpoint` itself. `tokenizer` turns responses into text for stop strings.
  `head`: (HeadConfig, params) to regenerate speculatively with `method` (default jetflow with
  a head, ar without), its tree as `policy.tree_shape_for` and `speculative_generate` take
  them (`budget` a node count or "auto", up to `max_budget`).
  """
  from jetflow_jax.sampling import make_sampler
  from jetflow_jax.train import regenerate_backends as backends
  if backend not in BACKENDS:
    raise InputError(f"unknown regeneration backend {backend!r}; choose from {BACKENDS}")
  decode = detokenizer(tokenizer)
  if backend == "torch":
    return backends.static_generator(backends.torch_batches(checkpoint, temperature), width,
                                     decode)
  mesh = local_mesh(mesh_axes)
  config, params = load_target(mesh.param_shardings)
  head_config, head_params = head
  tree = dict(method=method or ("jetflow" if head_config else "ar"), budget=budget,
              max_budget=max_budget, top_k=top_k,
              attention=attention_for_backend(attention, jax.default_backend()))
  if backend == "jax":
    return backends.engine_generator(params, config, head_params, head_config, slots=width,
                                     temperature=temperature, decode=decode, mesh=mesh, **tree)
  batches = backends.jax_batches(params, config, make_sampler(temperature), mesh, head_params,
                                 head_config, **tree)
  return backends.static_generator(batches, width, decode)


def main(argv) -> None:
  del argv
  from absl import flags

  from jetflow_jax import distributed
  from jetflow_jax.checkpoint import load_qwen3
  from jetflow_jax.head_checkpoint import load_head
  from jetflow_jax.pair import max_budget, parse_budget
  from jetflow_jax.train.data import read_jsonl
  from jetflow_jax.train.regenerate_openai import openai_generator
  f = flags.FLAGS

  def run():
    distributed.initialize_from_flags()
    if min(f.slots, f.batch_size) < 1:
      raise InputError(f"--slots and --batch_size must be >= 1 (got {f.slots}, {f.batch_size})")
    records = list(read_jsonl(f.prompts))
    tokenizer = tokenizer_if_needed(records, f.tokenizer or f.checkpoint)
    dtype = cli.parse_dtype(f.dtype)

    def generator():
      if f.backend == "openai":
        from jetflow_jax.text import load_tokenizer
        if not f.model:
          raise InputError("the openai backend needs --model (the served model's name)")
        return openai_generator(
            f.server, model=f.model, concurrency=f.concurrency, temperature=f.temperature,
            load_tokenizer=lambda: tokenizer or load_tokenizer(f.tokenizer or f.checkpoint),
            decode=detokenizer(tokenizer),
            request_token_ids=f.request_token_ids)
      if f.backend == "torch" and f.threads:
        import torch
        torch.set_num_threads(f.threads)
      return make_generator(
          f.backend, lambda shardings: load_qwen3(f.checkpoint, dtype, shardings),
          checkpoint=f.checkpoint, width=f.slots if f.backend == "jax" else f.batch_size,
          temperature=f.temperature, mesh_axes=f.mesh, tokenizer=tokenizer,
          head=load_head(f.head, dtype) if f.head else (None, None), method=f.method,
          budget=parse_budget(f.budget), max_budget=max_budget(f), top_k=f.top_k,
          attention=f.attention)

    count = regenerate(records, f.out, generator, tokenizer=tokenizer,
                       max_new_tokens=f.max_new_tokens, max_prompt_len=f.max_prompt_len,
                       seed=f.seed, shard=jax.process_index(), num_shards=jax.process_count())
    print(f"regenerated {count} records into {f.out}")

  cli.run(run)


if __name__ == "__main__":
  from absl import app

  from jetflow_jax import distributed
  _define_flags()
  distributed.define_flags()
  app.run(main)
