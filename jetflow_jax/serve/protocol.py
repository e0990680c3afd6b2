"""The OpenAI shapes: request bodies (validated) and the bodies of answers, whole or streamed."""

from __future__ import annotations

import dataclasses
import time
import uuid

from pydantic import BaseModel, Field, field_validator

FINISH_REASONS = {"stop_token": "stop", "max_tokens": "length"}


class StreamOptions(BaseModel):
  include_usage: bool = False


class GenerationParams(BaseModel):
  """What completions and chat share; unknown fields are ignored, as OpenAI's server does."""

  model: str | None = None
  max_tokens: int | None = Field(None, ge=1)
  temperature: float | None = Field(None, ge=0)  # None: 1.0, OpenAI's default
  top_p: float | None = Field(None, gt=0, le=1)
  seed: int | None = None  # None: one drawn per request
  stop: str | list[str] | None = Field(None, validate_default=True)  # a list once validated
  n: int = 1
  stream: bool = False
  stream_options: StreamOptions | None = None

  @field_validator("n")
  @classmethod
  def _one_choice(cls, n: int) -> int:
    if n != 1:
      raise ValueError(f"only n=1 is supported (got {n})")
    return n

  @field_validator("stop")
  @classmethod
  def _stop_list(cls, stop: str | list[str] | None) -> list[str]:
    stop = [stop] if isinstance(stop, str) else stop or []
    if any(not s for s in stop):
      raise ValueError("stop strings must not be empty")
    return stop


class CompletionRequest(GenerationParams):
  prompt: str | list[int]  # text, or token ids


class Message(BaseModel):
  role: str
  content: str


class ChatRequest(GenerationParams):
  messages: list[Message] = Field(min_length=1)
  max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


def error_body(message: str, status: int, param: str | None = None,
               code: str | None = None) -> dict:
  kind = "invalid_request_error" if status < 500 else "server_error"
  return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclasses.dataclass
class Reply:
  """The bodies of one answer, a completion or a chat message: whole, or chunk by chunk."""

  model: str
  chat: bool
  id: str = dataclasses.field(init=False)
  created: int = dataclasses.field(default_factory=lambda: int(time.time()))

  def __post_init__(self):
    self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

  def whole(self, text: str, finish_reason: str, token_ids: list[int], counts: dict) -> dict:
    """The non-streamed answer; `token_ids` (not OpenAI's) are the tokens the text came from."""
    content = ({"message": {"role": "assistant", "content": text}} if self.chat
               else {"text": text, "logprobs": None})
    choice = {"index": 0, **content, "finish_reason": finish_reason, "token_ids": token_ids}
    return self._body("chat.completion" if self.chat else "text_completion", [choice],
                      usage=counts)

  def chunk(self, text: str, finish_reason: str | None = None, role: bool = False) -> dict:
    """One streamed piece of text; `role` opens a chat stream, `finish_reason` ends it."""
    if self.chat:
      delta = {"role": "assistant", "content": text} if role else {"content": text} if text else {}
      content = {"delta": delta}
    else:
      content = {"text": text, "logprobs": None}
    return self._body(self._chunk_object, [{"index": 0, **content,
                                            "finish_reason": finish_reason}])

  def usage_chunk(self, counts: dict) -> dict:
    """The last chunk when the client asked for `stream_options.include_usage`."""
    return self._body(self._chunk_object, [], usage=counts)

  @property
  def _chunk_object(self) -> str:
    return "chat.completion.chunk" if self.chat else "text_completion"

  def _body(self, kind: str, choices: list[dict], **extra) -> dict:
    return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
            "choices": choices, **extra}
