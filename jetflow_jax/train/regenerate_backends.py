"""What regenerates the prompts: the engine (continuous batching), or static batches through our
decode loop or transformers' `generate`.

A generator takes the jobs left to do and a seed, and yields groups of `(job, response ids)` as
they finish, in any order; `regenerate.regenerate` commits each group to the store. Every backend
ends a response the same way (`finish`): at its stop token, its `max_tokens`, or through the token
that completes its first stop string, so greedy backends write identical records.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Iterator, Sequence

from jetflow_jax.checkpoint import is_converted
from jetflow_jax.config import Qwen3Config
from jetflow_jax.decoding import speculative_generate
from jetflow_jax.decoding.policy import DEFAULT_BUDGET, DEFAULT_TOP_K
from jetflow_jax.engine import Orchestrator, Request, Stream, make_engine
from jetflow_jax.errors import InputError
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.mesh import DecodeMesh
from jetflow_jax.sampling import Sampler
from jetflow_jax.text import Decode, stop_end

CACHE_ROUNDING = 16  # cache sizes a regeneration run may compile for: few, and nearly tight


@dataclasses.dataclass(frozen=True)
class Job:
  """One record to regenerate: its prompt ids, its token limit and its stop strings."""

  rid: str
  index: int  # its place among the prompts (the store's source index)
  prompt: list[int]
  max_tokens: int
  stop: tuple[str, ...] = ()


Finished = list[tuple[Job, list[int]]]
Generator = Callable[[Sequence[Job], int], Iterator[Finished]]
# (prompts, max_new_tokens, seed) -> each prompt's response ids, its stop token included.
BatchFn = Callable[[list[list[int]], int, int], list[list[int]]]


def finish(job: Job, response: Sequence[int], decode: Decode | None) -> list[int]:
  """`response` cut to the job's `max_tokens` and through its first stop string."""
  response = list(response[:job.max_tokens])
  if job.stop:
    response = response[:stop_end(response, job.stop, decode) or len(response)]
  return response


def tight_cache_size(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> int:
  """The longest prompt plus `max_new_tokens`, rounded up to a multiple of CACHE_ROUNDING.

  Decoding reads the whole cache every step (on CPU, measured: a 512-slot cache decodes at
  half the speed of a 320-slot one), so regeneration, which runs for hours, sizes it to fit
  rather than to a power of two.
  """
  needed = max(len(p) for p in prompts) + max_new_tokens
  return -(-needed // CACHE_ROUNDING) * CACHE_ROUNDING


def engine_generator(target_params, target_config: Qwen3Config, head_params=None,
                     head_config: HeadConfig | None = None, *, method: str = "ar",
                     budget: int | str = DEFAULT_BUDGET, max_budget: int = 256,
                     top_k: int = DEFAULT_TOP_K, attention: str = "xla", slots: int = 16,
                     rounds_per_step: int = 4,
                     temperature: float = 0.0, decode: Decode | None = None,
                     mesh: DecodeMesh | None = None) -> Generator:
  """The continuous-batching engine: `slots` requests at a time (rounded up to a multiple of
  `mesh`'s data-parallel copies, which split them), each admitted as a slot frees up.

  A request's sampled tokens depend on its seed, `seed + job.index`, alone. A stream whose
  text holds a stop string is cancelled; the tokens it had are cut by `finish`.
  """
  ways = 1 if mesh is None else mesh.size("data")
  slots = -(-slots // ways) * ways

  def run(jobs, seed):
    context = tight_cache_size([j.prompt for j in jobs], max(j.max_tokens for j in jobs))
    engine = make_engine(target_params, target_config, head_params, head_config, method=method,
                         budget=budget, max_budget=max_budget, top_k=top_k, attention=attention,
                         num_slots=slots, max_context=context,
                         rounds_per_step=rounds_per_step, mesh=mesh, warn=lambda _: None)
    orchestrator = Orchestrator(engine)
    todo = iter(jobs)
    running: dict[Stream, Job] = {}
    while True:
      while len(orchestrator.waiting) < slots and (job := next(todo, None)) is not None:
        request = Request(job.prompt, job.max_tokens, temperature=temperature,
                          seed=(seed + job.index) % 2**32)
        running[orchestrator.submit(request)] = job
      busy = orchestrator.step()
      for stream, job in running.items():
        if (job.stop and stream.tokens and not stream.cancelled and not stream.finished
            and stop_end(stream.tokens, job.stop, decode) is not None):
          stream.cancel()
      done = [(stream, running.pop(stream)) for stream in list(running) if stream.finished]
      if done:
        yield [(job, finish(job, stream.tokens, decode)) for stream, job in done]
      if not busy and not running:
        return
  return run


def static_generator(generate_batch: BatchFn, batch_size: int,
                     decode: Decode | None = None) -> Generator:
  """Batches of `batch_size` jobs in the given order, each run to its longest `max_tokens`;
  every response is then cut to its own (`finish`)."""
  def run(jobs, seed):
    for start in range(0, len(jobs), batch_size):
      batch = jobs[start:start + batch_size]
      responses = generate_batch([j.prompt for j in batch], max(j.max_tokens for j in batch),
                                 seed + start)
      yield [(job, finish(job, response, decode))
             for job, response in zip(batch, responses, strict=True)]
  return run


def jax_batches(target_params, target_config: Qwen3Config, sampler: Sampler,
                mesh: DecodeMesh | None = None, head_params=None,
                head_config: HeadConfig | None = None, method: str = "ar",
                budget: int | str = DEFAULT_BUDGET, max_budget: int = 256,
                top_k: int = DEFAULT_TOP_K, attention: str = "xla") -> BatchFn:
  """Our jitted decode loop (`speculative_generate`), its cache sized to each batch; with
  `mesh` (a local mesh), the batch is split over its data-parallel copies of the target."""
  ways = 1 if mesh is None else mesh.size("data")
  widest = 0

  def generate_batch(prompts, max_new_tokens, seed):
    nonlocal widest
    widest = max(widest, -(-len(prompts) // ways) * ways)
    # A short (last) batch is padded to the widest so far so it reuses the compiled shapes.
    padded = list(prompts) + [prompts[-1]] * (widest - len(prompts))
    return speculative_generate(
        target_params, target_config, head_params, head_config, padded, max_new_tokens,
        method=method, budget=budget, max_budget=max_budget, top_k=top_k, attention=attention,
        sampler=sampler, seed=seed,
        cache_size=tight_cache_size(padded, max_new_tokens), warn=lambda _: None,
        mesh=mesh).tokens[:len(prompts)]
  return generate_batch


def torch_batches(checkpoint_dir: str, temperature: float) -> BatchFn:
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

  def generate_batch(prompts, max_new_tokens, seed):
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
