"""The FastAPI app: OpenAI routes over a `Service`, errors in OpenAI's shape, and its server.

Every request is validated before it reaches the engine (a 400 names what is wrong); each of its
choices (prompts x n, or best_of) is a job of its own in the engine. What costs nothing to check
goes first: the API key and the body's size (`guard.py`), then the lengths of token-id prompts;
text longer than the context could hold is refused on its head's tokens, never tokenized whole.
A client that goes away cancels its request, so its slots free for the next one; so does a
request past its deadline (`request_timeout`), answered with a 504 or an error event. Until the
engine has compiled every variant, /health answers 503 (warming up) while requests wait. A
shutdown signal keeps the socket open through a grace period (new requests: 503) while running
requests finish; those still running at its end get an error their client can read (the
server, `server.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import random
import sys
import time
from typing import AsyncIterator, Sequence

import numpy as np
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest

from jetflow_jax import compile_cache
from jetflow_jax.engine import Engine, Request
from jetflow_jax.errors import InputError
from jetflow_jax.serve.choices import Choice, Piece, TokenTexts
from jetflow_jax.serve.guard import LimitBody, RequireKey, default_max_request_bytes
from jetflow_jax.serve.metrics import CountRequests, Metrics
from jetflow_jax.serve.protocol import (ChatRequest, CompletionRequest, GenerationParams, Reply,
                                        error_body, usage)
from jetflow_jax.serve.service import Service, TimedOut, Unavailable
from jetflow_jax.serve.textstream import TextStream
from jetflow_jax.text import chat_text, detokenizer

WARM_UP_ENV = "JETFLOW_WARM_UP"  # 0: compile on demand instead of at start-up
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions; chat defaults to the slot's room
# Below this a temperature samples as greedy: float32 logits divided by a smaller one can
# overflow, and the distribution is the argmax to that precision anyway.
MIN_TEMPERATURE = 1e-5


class APIError(Exception):
  """A request refused with an HTTP status, in OpenAI's error shape."""

  def __init__(self, status: int, message: str, param: str | None = None,
               code: str | None = None):
    super().__init__(message)
    self.status, self.param, self.code = status, param, code


def error(status: int, message: str, param: str | None = None,
          code: str | None = None) -> Response:
  # ASCII JSON: a message quoting the client's input survives any code point in it.
  return Response(json.dumps(error_body(message, status, param, code)), status,
                  media_type="application/json")


def choice_seed(seed: int | None, j: int) -> int:
  """The seed of a prompt's `j`-th choice: the request's own for the first, one derived from it
  for the others (so each is its own draw, and a batch's first choices equal single requests);
  drawn at random without a seed."""
  if seed is None:
    return random.randrange(2**32)
  if j == 0 or not 0 <= seed < 2**32:  # the engine refuses a seed out of range, by name
    return seed
  return int(np.random.SeedSequence([seed, j]).generate_state(1)[0])


async def merged(choices: list[Choice]) -> AsyncIterator[tuple[int, Piece]]:
  """(index, piece) of every choice's pieces as they come; the first error ends it."""
  events: asyncio.Queue = asyncio.Queue()

  async def pump(index: int, choice: Choice) -> None:
    try:
      async for piece in choice.pieces():
        events.put_nowait((index, piece))
      events.put_nowait((index, None))
    except Exception as e:
      events.put_nowait((index, e))

  tasks = [asyncio.ensure_future(pump(i, c)) for i, c in enumerate(choices)]
  try:
    for _ in range(len(choices)):
      while (event := await events.get())[1] is not None:
        if isinstance(event[1], Exception):
          raise event[1]
        yield event
  finally:
    for task in tasks:
      task.cancel()


async def until_disconnected(request: HTTPRequest) -> None:
  while (await request.receive())["type"] != "http.disconnect":
    pass


async def unless_disconnected(request: HTTPRequest, work):
  """`work`'s result, or None if the client goes away first (`work` is then cancelled)."""
  task, watch = asyncio.ensure_future(work), asyncio.ensure_future(until_disconnected(request))
  try:
    done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
  finally:
    task.cancel()  # a no-op once done
    watch.cancel()
  return task.result() if task in done else None


def create_app(engine: Engine, tokenizer, model_name: str | Sequence[str], *,
               warm_up: bool | None = None, api_keys: Sequence[str] = (),
               max_request_bytes: int | None = None,
               request_timeout: float | None = None) -> FastAPI:
  """The OpenAI-compatible app serving `engine` as `model_name` (or each of several names, the
  first one in answers); it runs the engine while up.

  With `warm_up` (default: $JETFLOW_WARM_UP, on unless 0), the engine compiles every variant a
  request can reach before it takes one (progress on stderr); JAX's persistent compilation
  cache (`compile_cache`) keeps them for the next start. With `api_keys`, /v1 routes need one
  of them as a bearer token (401). A body over `max_request_bytes` (default:
  `guard.default_max_request_bytes` of the engine's context) is a 413. A request not done
  `request_timeout` seconds after it arrived is ended (504, or an error event) and its slots
  freed.

  Args:
    engine: the `Engine` to serve (`make_engine`).
    tokenizer: the target's transformers tokenizer (text prompts, chat, stop strings), or None
      for token ids only.
    model_name: the name `/v1/models` lists, or several names.
    warm_up: compile every variant before taking requests; None reads $JETFLOW_WARM_UP.
    api_keys: bearer tokens the /v1 routes accept; () for none needed.
    max_request_bytes: the largest request body; None for the default.
    request_timeout: seconds a request may take; None for no limit.

  Returns:
    The FastAPI app (`Server` runs it).
  """
  compile_cache.enable()
  names = [model_name] if isinstance(model_name, str) else list(model_name)
  served = ", ".join(map(repr, names))
  metrics = Metrics()
  service = Service(engine, metrics, warm_up_default() if warm_up is None else warm_up,
                    log=lambda line: print(line, file=sys.stderr, flush=True))
  texts = TokenTexts(tokenizer)

  @contextlib.asynccontextmanager
  async def lifespan(_):
    service.start()
    yield
    service.stop()

  app = FastAPI(title="jetflow_jax", lifespan=lifespan)
  app.state.service = service
  # Added innermost first: counting sees every refusal, the key is checked before any body.
  app.add_middleware(LimitBody, max_bytes=max_request_bytes
                     or default_max_request_bytes(engine.max_context))
  if api_keys:
    app.add_middleware(RequireKey, keys=api_keys)
  app.add_middleware(CountRequests, metrics=metrics)
  decode = detokenizer(tokenizer)
  # A text of more characters than this holds more tokens than the context, whatever its
  # tokens: only this much of it is tokenized to show it (byte-level vocabularies spell a
  # token with a character per byte, so its length bounds its text's).
  max_chars = engine.max_context * max(map(len, tokenizer.get_vocab()))

  @app.exception_handler(RequestValidationError)
  async def invalid(_, e: RequestValidationError):
    first = e.errors()[0]
    if first["type"] == "json_invalid":
      return error(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}")
    where = lambda err: ".".join(str(part) for part in err["loc"][1:])
    problem = lambda err: ("not supported by this server" if err["type"] == "extra_forbidden"
                           else err["msg"])
    return error(400, "; ".join(f"{where(err) or 'body'}: {problem(err)}" for err in e.errors()),
                 param=where(first) or None)

  @app.exception_handler(HTTPException)
  async def http_error(_, e: HTTPException):
    return error(e.status_code, str(e.detail))

  @app.exception_handler(APIError)
  async def api_error(_, e: APIError):
    return error(e.status, str(e), e.param, e.code)

  @app.exception_handler(InputError)
  async def input_error(_, e: InputError):
    return error(400, str(e))

  @app.exception_handler(Unavailable)
  @app.exception_handler(TimedOut)
  async def unavailable(_, e: Unavailable | TimedOut):
    return error(e.status, str(e))

  @app.exception_handler(Exception)
  async def internal(_, e: Exception):
    return error(500, f"internal error: {type(e).__name__}: {e}")

  @app.get("/health")
  async def health():
    if not service.available:
      raise Unavailable(service.error or "the server is shutting down")
    if service.warming is not None:
      raise Unavailable(f"warming up: {service.warming}")
    return {"status": "ok"}

  @app.get("/metrics")
  async def prometheus():
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                        "owned_by": "jetflow_jax"} for name in names]}

  @app.post("/v1/completions")
  async def completions(body: CompletionRequest, request: HTTPRequest):
    deadline = due()
    check(body)
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    for p in body.prompt:  # token ids too long for a slot: refused before any text is encoded
      if isinstance(p, list):
        engine.check(Request(p, max(max_tokens, 1)))
    prompts = [p if isinstance(p, list) else await tokenized("prompt", p) for p in body.prompt]
    echoes = ([p if isinstance(p, str) else decode(p) for p in body.prompt] if body.echo
              else [None] * len(prompts))
    return await respond(
        request, body, Reply(names[0], chat=False), prompts, max_tokens, deadline,
        echoes=echoes, logprobs=body.logprobs, best_of=body.best_of)

  @app.post("/v1/chat/completions")
  async def chat(body: ChatRequest, request: HTTPRequest):
    deadline = due()
    check(body)
    if not getattr(tokenizer, "chat_template", None):
      raise APIError(400, f"the tokenizer of {names[0]} has no chat template; use "
                     "/v1/completions with a prompt instead", param="messages")
    text = await in_thread("messages", chat_text, tokenizer,
                           [{"role": m.role, "content": m.content} for m in body.messages])
    prompt = await tokenized("messages", text)
    room = max(engine.max_context - len(prompt), 1)  # too long a prompt: check names its length
    return await respond(request, body, Reply(names[0], chat=True), [prompt],
                         body.max_completion_tokens or body.max_tokens or room, deadline,
                         logprobs=(body.top_logprobs or 0) if body.logprobs else None)

  def due() -> float | None:
    """When a request arriving now must be done (monotonic seconds), None without a timeout."""
    return None if request_timeout is None else time.monotonic() + request_timeout

  async def tokenized(field: str, text: str) -> list[int]:
    """Token ids of a request's text; one too long for the context is refused on its head's."""
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    if len(text) > max_chars:
      head = await in_thread(field, encode, text[:max_chars])
      if len(head) >= engine.max_context:
        raise APIError(400, f"{field}: a prompt of more than {len(head)} tokens (its first "
                       f"{max_chars} characters) exceeds the engine's context of "
                       f"{engine.max_context} tokens per slot", param=field)
    return await in_thread(field, encode, text)

  async def in_thread(field: str, encode, *args):
    """`encode(*args)` off the event loop; what the tokenizer (or chat template) refuses is a
    400."""
    try:
      return await asyncio.to_thread(encode, *args)
    except Exception as e:  # the tokenizer's own errors are of any type: TypeError, jinja's
      raise APIError(400, f"{field}: the tokenizer cannot encode it ({type(e).__name__}: {e})",
                     param=field) from None

  def check(body: GenerationParams) -> None:
    """The model, and what spans fields (`refusal`)."""
    if body.model is not None and body.model not in names:
      raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                     f"{served}", param="model", code="model_not_found")
    if refused := body.refusal():
      raise APIError(400, refused[1], param=refused[0])

  async def respond(request: HTTPRequest, body: GenerationParams, reply: Reply,
                    prompts: list[list[int]], max_tokens: int, deadline: float | None, *,
                    echoes: list[str | None] | None = None, logprobs: int | None = None,
                    best_of: int | None = None):
    """Every prompt's choices through the engine, whole or streamed, cut at `deadline`.
    `max_tokens` 0 runs one token and drops it (echo: the prompt alone); `logprobs`
    alternatives per token (None: no log-probabilities); `best_of` > n ranks that many by mean
    log-probability."""
    n = body.n or 1
    best_of = best_of or n
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    if temperature < MIN_TEMPERATURE or top_p == 0:  # a nucleus of mass 0 is the top token
      temperature, top_p = 0.0, 1.0
    echoes = echoes or [None] * len(prompts)
    # best_of ranks by the log-probabilities, asked for or not.
    asked = logprobs if logprobs is not None or best_of == n else 0
    requests = [Request(prompt, max(max_tokens, 1), temperature=temperature, top_p=top_p,
                        seed=choice_seed(body.seed, j), logprobs=asked,
                        prompt_logprobs=echo is not None and logprobs is not None)
                for prompt, echo in zip(prompts, echoes) for j in range(best_of)]
    for r in requests:  # all or none: InputError (400) before any runs
      engine.check(r)
    jobs = [service.submit(r) for r in requests]
    choices = [Choice(job, TextStream(decode, body.stop), texts, echo=echoes[k // best_of],
                      prompt_only=max_tokens == 0, logprobs=logprobs is not None)
               for k, job in enumerate(jobs)]
    counts = lambda: usage(sum(map(len, prompts)), sum(len(c.tokens) for c in choices))

    def expire() -> None:
      running = [job for job in jobs if not job.ended]
      if running:
        metrics.timeouts.inc()
      for job in running:
        job.cut(TimedOut(f"the request did not finish within the server's request timeout of "
                         f"{request_timeout:g} s (--request-timeout)"))

    timer = (None if deadline is None else
             asyncio.get_running_loop().call_later(max(deadline - time.monotonic(), 0), expire))

    def cancel() -> None:
      if timer is not None:
        timer.cancel()
      for job in jobs:
        job.cancel()

    # Once answered, or once the client has gone, the jobs are cancelled: their slots free at
    # once (a no-op for those that have finished).
    if body.stream:
      with_usage = body.stream_options is not None and body.stream_options.include_usage
      return StreamingResponse(stream(choices, reply, counts if with_usage else None),
                               media_type="text/event-stream", background=BackgroundTask(cancel))

    async def collect() -> bool:
      async for _ in merged(choices):
        pass
      return True

    try:
      done = await unless_disconnected(request, collect())
    finally:
      cancel()
    if done is None:
      return Response(status_code=499)  # the client closed the request
    kept = choices
    if best_of > n:  # each prompt's n best by mean log-probability, best first
      kept = [c for i in range(0, len(choices), best_of)
              for c in sorted(choices[i:i + best_of], key=lambda c: c.mean_logprob,
                              reverse=True)[:n]]
    return reply.whole([reply.choice(i, c.text, c.finish_reason, c.tokens,
                                     c.logprobs if c.show_logprobs else None)
                        for i, c in enumerate(kept)], counts())

  return app


async def stream(choices: list[Choice], reply: Reply, counts) -> AsyncIterator[str]:
  """Server-sent events: each choice's chunks as its text is safe to send (with its tokens'
  log-probabilities, if asked), the usage if asked, then [DONE].

  Starlette cancels this generator when the client disconnects, then runs the response's
  background task, which cancels the jobs.
  """
  event = lambda body: f"data: {json.dumps(body)}\n\n"
  if reply.chat:
    for index in range(len(choices)):
      yield event(reply.chunk(index, "", role=True))
  try:
    async for index, piece in merged(choices):
      shown = piece.logprobs if choices[index].show_logprobs else None
      yield event(reply.chunk(index, piece.text, piece.finish_reason, logprobs=shown))
  except (Unavailable, TimedOut) as e:  # an error event, then the stream's usual end: clients
    # read both (the openai client raises the error)
    yield event(error_body(str(e), e.status))
    yield "data: [DONE]\n\n"
    return
  if counts is not None:
    yield event(reply.usage_chunk(counts()))
  yield "data: [DONE]\n\n"


def warm_up_default() -> bool:
  """Whether a server warms up: $JETFLOW_WARM_UP (1 or 0), on if unset."""
  value = os.environ.get(WARM_UP_ENV, "1")
  if value not in ("0", "1"):
    raise InputError(f"{WARM_UP_ENV} must be 1 (compile every variant at start-up) or 0 "
                     f"(compile on demand) (got {value!r})")
  return value == "1"
