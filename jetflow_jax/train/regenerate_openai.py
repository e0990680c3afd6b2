"""Regeneration through OpenAI-compatible servers (`--backend openai`): ours
(`python -m jetflow_jax.serve`), vLLM, or any other serving the target.

Each job is one `/v1/completions` request with the prompt as token ids, sent from a pool of
`concurrency` threads over the servers in turn; connection errors, 429 and 5xx are retried
with exponential backoff, each retry on the next server. A response's token ids are kept
where the server returns them (ours always does; vLLM with `return_token_ids`, asked for by
default), then cut as every backend cuts (`regenerate_backends.finish`), so greedy records
equal the engine's. A server that returns text only has it tokenized with the target's
tokenizer: `FromText` marks those responses (stop strings are cut out of the text then, as
the server did, and the end token is missing).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import random
import time
from typing import Callable, Sequence

from jetflow_jax.errors import InputError
from jetflow_jax.text import Decode
from jetflow_jax.train.regenerate_backends import Generator, Job, finish

MAX_ATTEMPTS = 8
BACKOFF_CAP_S = 60.0


class FromText(list):
  """Response ids tokenized from a server's text: not necessarily the target's own tokens."""


def openai_generator(urls: Sequence[str], *, model: str, load_tokenizer: Callable,
                     concurrency: int = 16, temperature: float = 0.0,
                     decode: Decode | None = None, request_token_ids: bool = True,
                     backoff_s: float = 1.0, timeout_s: float = 3600.0) -> Generator:
  """Jobs as completions requests to `urls` (`http://HOST:PORT`, `/v1` optional).

  `load_tokenizer()` returns the target's tokenizer (called once a server returns text only).
  Sampled requests carry the seed `seed + job.index`, as the engine gives each request.
  """
  import openai
  if not urls:
    raise InputError("the openai backend needs --server URL[,URL...]")
  if concurrency < 1:
    raise InputError(f"--concurrency must be >= 1 (got {concurrency})")
  clients = [openai.OpenAI(base_url=url.rstrip("/").removesuffix("/v1") + "/v1", api_key="none",
                           max_retries=0, timeout=timeout_s) for url in urls]
  extra = {"return_token_ids": True} if request_token_ids else {}
  tokenizer = functools.cache(load_tokenizer)
  logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request

  def complete(number: int, job: Job, seed: int) -> list[int]:
    """One job's response, retried over the servers in turn."""
    for attempt in range(MAX_ATTEMPTS):
      try:
        choice = clients[(number + attempt) % len(clients)].completions.create(
            model=model, prompt=job.prompt, max_tokens=job.max_tokens, temperature=temperature,
            top_p=1.0, seed=(seed + job.index) % 2**32, stop=list(job.stop) or None,
            extra_body=extra).choices[0]
        break
      except (openai.APIConnectionError, openai.APIStatusError) as e:
        status = getattr(e, "status_code", None)
        if status is not None and status != 429 and status < 500:
          raise InputError(f"record {job.rid}: the server refused the request ({e})") from None
        if attempt == MAX_ATTEMPTS - 1:
          raise
        # Full jitter: many threads retrying a busy server do not come back all at once.
        time.sleep(random.uniform(0, min(BACKOFF_CAP_S, backoff_s * 2**attempt)))
    ids = (choice.model_extra or {}).get("token_ids")
    if ids is None:
      return FromText(tokenizer().encode(choice.text, add_special_tokens=False))
    return finish(job, ids, decode)

  def run(jobs, seed):
    pool = concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="openai")
    todo, running = iter(enumerate(jobs)), {}
    try:
      while True:
        while len(running) < 2 * concurrency and (item := next(todo, None)) is not None:
          running[pool.submit(complete, *item, seed)] = item[1]
        if not running:
          return
        done, _ = concurrent.futures.wait(running, return_when="FIRST_COMPLETED")
        yield [(running.pop(future), future.result()) for future in done]
    finally:  # an interrupt (or an error) waits for no request still out
      pool.shutdown(wait=False, cancel_futures=True)
  return run
