"""The FastAPI app: OpenAI routes over a `Service`, errors in OpenAI's shape, and its server.

Every request is validated before it reaches the engine (a 400 names what is wrong); a client
that goes away cancels its request, so its slot frees for the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from typing import AsyncIterator

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest

from jetflow_jax.engine import Engine, Request
from jetflow_jax.errors import InputError
from jetflow_jax.serve.metrics import CountRequests, Metrics
from jetflow_jax.serve.protocol import (FINISH_REASONS, ChatRequest, CompletionRequest,
                                        GenerationParams, Reply, error_body, usage)
from jetflow_jax.serve.service import Job, Service, Unavailable
from jetflow_jax.serve.textstream import TextStream
from jetflow_jax.text import detokenizer, encode_chat

GRACE_S = 20  # after a shutdown signal, running requests get this long before they are cancelled
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions; chat defaults to the slot's room


class APIError(Exception):
  """A request refused with an HTTP status, in OpenAI's error shape."""

  def __init__(self, status: int, message: str, param: str | None = None,
               code: str | None = None):
    super().__init__(message)
    self.status, self.param, self.code = status, param, code


def error(status: int, message: str, param: str | None = None,
          code: str | None = None) -> JSONResponse:
  return JSONResponse(error_body(message, status, param, code), status_code=status)


async def answer(job: Job, text: TextStream) -> AsyncIterator[tuple[str, str | None]]:
  """(new text, None) as the tokens come, then (last text, finish reason).

  It may end before the job does (a stop string): the caller cancels the job once answered.
  """
  async for piece in job.pieces():
    new = text.push(piece)
    if text.stopped:
      yield new, "stop"
      return
    if new:
      yield new, None
  if job.finish_reason == "cancelled":
    raise Unavailable("the request was cancelled: the server is shutting down")
  new = text.push([], final=True)
  yield new, "stop" if text.stopped else FINISH_REASONS[job.finish_reason]


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


def create_app(engine: Engine, tokenizer, model_name: str) -> FastAPI:
  """The OpenAI-compatible app serving `engine` as `model_name`; it runs the engine while up."""
  metrics = Metrics()
  service = Service(engine, metrics)

  @contextlib.asynccontextmanager
  async def lifespan(_):
    await asyncio.to_thread(service.start)
    yield
    service.stop()

  app = FastAPI(title="jetflow_jax", lifespan=lifespan)
  app.state.service = service
  app.add_middleware(CountRequests, metrics=metrics)
  decode = detokenizer(tokenizer)

  @app.exception_handler(RequestValidationError)
  async def invalid(_, e: RequestValidationError):
    first = e.errors()[0]
    if first["type"] == "json_invalid":
      return error(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}")
    where = lambda err: ".".join(str(part) for part in err["loc"][1:])
    return error(400, "; ".join(f"{where(err) or 'body'}: {err['msg']}" for err in e.errors()),
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
  async def unavailable(_, e: Unavailable):
    return error(503, str(e))

  @app.exception_handler(Exception)
  async def internal(_, e: Exception):
    return error(500, f"internal error: {type(e).__name__}: {e}")

  @app.get("/health")
  async def health():
    if not service.available:
      raise Unavailable(service.error or "the server is shutting down")
    return {"status": "ok"}

  @app.get("/metrics")
  async def prometheus():
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                        "owned_by": "jetflow_jax"}]}

  @app.post("/v1/completions")
  async def completions(body: CompletionRequest, request: HTTPRequest):
    check_model(body)
    prompt = (body.prompt if isinstance(body.prompt, list) else await asyncio.to_thread(
        tokenizer.encode, body.prompt, add_special_tokens=False))
    return await respond(request, body, prompt, Reply(model_name, chat=False),
                         body.max_tokens or DEFAULT_MAX_TOKENS)

  @app.post("/v1/chat/completions")
  async def chat(body: ChatRequest, request: HTTPRequest):
    check_model(body)
    if not getattr(tokenizer, "chat_template", None):
      raise APIError(400, f"the tokenizer of {model_name} has no chat template; use "
                     "/v1/completions with a prompt instead", param="messages")
    prompt = await asyncio.to_thread(encode_chat, tokenizer,
                                     [m.model_dump() for m in body.messages])
    room = max(engine.max_context - len(prompt), 1)  # too long a prompt: check names its length
    return await respond(request, body, prompt, Reply(model_name, chat=True),
                         body.max_completion_tokens or body.max_tokens or room)

  def check_model(body: GenerationParams) -> None:
    if body.model not in (None, model_name):
      raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                     f"{model_name!r}", param="model", code="model_not_found")

  async def respond(request: HTTPRequest, body: GenerationParams, prompt: list[int],
                    reply: Reply, max_tokens: int):
    text = TextStream(decode, body.stop)
    counts = lambda: usage(len(prompt), len(text.output_tokens))
    with_usage = body.stream_options is not None and body.stream_options.include_usage
    job = service.submit(Request(
        prompt, max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=random.randrange(2**32) if body.seed is None else body.seed))
    # Once answered, or once the client has gone, the job is cancelled: its slot frees at once
    # (a no-op if it has finished).
    if body.stream:
      return StreamingResponse(stream(job, text, reply, counts if with_usage else None),
                               media_type="text/event-stream",
                               background=BackgroundTask(job.cancel))

    async def collect() -> str:
      async for _, reason in answer(job, text):
        pass
      return reason

    try:
      reason = await unless_disconnected(request, collect())
    finally:
      job.cancel()
    if reason is None:
      return Response(status_code=499)  # the client closed the request
    return reply.whole(text.text, reason, text.output_tokens, counts())

  return app


async def stream(job: Job, text: TextStream, reply: Reply, counts) -> AsyncIterator[str]:
  """Server-sent events: chunks as text is safe to send, the usage if asked, then [DONE].

  Starlette cancels this generator when the client disconnects, then runs the response's
  background task, which cancels the job.
  """
  event = lambda body: f"data: {json.dumps(body)}\n\n"
  if reply.chat:
    yield event(reply.chunk("", role=True))
  try:
    async for new, reason in answer(job, text):
      yield event(reply.chunk(new, reason))
  except Unavailable as e:
    yield event(error_body(str(e), 503))
    return
  if counts is not None:
    yield event(reply.usage_chunk(counts()))
  yield "data: [DONE]\n\n"


class Server(uvicorn.Server):
  """uvicorn for an app of `create_app`: a shutdown signal first turns new requests away (503),
  then running ones have GRACE_S seconds to finish before they are cancelled."""

  def __init__(self, app: FastAPI, host: str, port: int):
    super().__init__(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                    timeout_graceful_shutdown=GRACE_S))
    self.service: Service = app.state.service

  def handle_exit(self, sig, frame) -> None:
    self.service.draining = True
    super().handle_exit(sig, frame)

