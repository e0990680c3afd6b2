"""The OpenAI shapes: request bodies (validated) and the bodies of answers, whole or streamed.

Types are as strict as OpenAI's (a boolean is not an integer, numbers are finite), and a field
this server does not act on is refused by name unless it holds the value that changes nothing
(`n: 1`, `echo: false`, ...): a client never gets an answer that silently ignored what it asked.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Annotated, Any

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool,
                      StrictInt, StrictStr)
from pydantic_core import PydanticCustomError

# The engine's `StopReason` (a str enum) -> OpenAI's finish_reason.
FINISH_REASONS = {"stop_token": "stop", "max_tokens": "length", "cache_full": "length"}


def encodable(text: str) -> str:
  """`text`, if it is Unicode a tokenizer can take (JSON can carry a lone UTF-16 surrogate)."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise PydanticCustomError(
        "unencodable", "not valid Unicode: a lone surrogate U+{code} at character {at}",
        {"code": f"{ord(text[e.start]):04X}", "at": e.start}) from None
  return text


Text = Annotated[StrictStr, AfterValidator(encodable)]
Temperature = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0, le=2)]
TopP = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0, le=1)]


def accepting_only(*values, later: bool = True):
  """A field this server does not implement, taken only at a value that changes nothing."""

  def check(value):
    if not any(type(value) is type(v) and value == v for v in values):
      shown = " or ".join("null" if v is None else repr(v).lower() if isinstance(v, bool)
                          else repr(v) for v in values)
      raise PydanticCustomError("unsupported", "{what}: only {shown} is accepted",
                                {"what": "not supported yet" if later else "not supported",
                                 "shown": shown})
    return value

  return Annotated[Any, BeforeValidator(check)]


class Strict(BaseModel):
  # Every field not declared is refused by name (see app.invalid), never dropped unread.
  model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
  include_usage: StrictBool = False


def stop_list(stop) -> list[str]:
  """`stop` as a list of non-empty strings (OpenAI takes one string or a list)."""
  stop = [stop] if isinstance(stop, str) else [] if stop is None else stop
  if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
    raise PydanticCustomError("stop_type", "must be a string or a list of strings")
  if any(not s for s in stop):
    raise PydanticCustomError("stop_empty", "stop strings must not be empty")
  return [encodable(s) for s in stop]


class GenerationParams(Strict):
  """What completions and chat share."""

  model: Text | None = None
  max_tokens: StrictInt | None = Field(None, ge=1)
  temperature: Temperature | None = None  # None: 1.0, OpenAI's default
  top_p: TopP | None = None
  seed: StrictInt | None = None  # None: one drawn per request
  stop: Annotated[list[str], BeforeValidator(stop_list)] = []
  stream: StrictBool | None = None
  stream_options: StreamOptions | None = None
  n: accepting_only(1, None) = None
  # Accepted at their neutral values, as clients send them by default.
  frequency_penalty: accepting_only(0, 0.0, None, later=False) = None
  presence_penalty: accepting_only(0, 0.0, None, later=False) = None
  logit_bias: accepting_only({}, None, later=False) = None
  user: Text | None = None  # the caller's end user, for their own tracking: nothing to do here


def prompt_ids_or_text(prompt) -> str | list[int]:
  """One prompt: text, or token ids; a list of prompts is refused until batching is served."""
  if isinstance(prompt, str):
    return encodable(prompt)
  if isinstance(prompt, list) and all(type(t) is int for t in prompt):
    return prompt
  if isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
    raise PydanticCustomError("unsupported", "not supported yet: a list of prompts (send one "
                              "request per prompt)")
  raise PydanticCustomError("prompt_type", "must be a string or a list of token ids")


class CompletionRequest(GenerationParams):
  prompt: Annotated[str | list[int], BeforeValidator(prompt_ids_or_text)]
  logprobs: accepting_only(None) = None
  echo: accepting_only(False, None) = None
  best_of: accepting_only(1, None) = None
  suffix: accepting_only(None, "", later=False) = None


def content_text(content) -> str:
  """A message's content: a string, or a list of text parts, joined."""
  if isinstance(content, str):
    return encodable(content)
  if isinstance(content, list) and all(isinstance(part, dict) for part in content):
    if all(part.keys() == {"type", "text"} and part["type"] == "text"
           and isinstance(part["text"], str) for part in content):
      return encodable("".join(part["text"] for part in content))
    raise PydanticCustomError("unsupported", "not supported: content parts other than text "
                              "(type text, with its text)")
  raise PydanticCustomError("content_type", "must be a string or a list of text parts")


class Message(Strict):
  role: Text
  content: Annotated[str, BeforeValidator(content_text)]


class ChatRequest(GenerationParams):
  messages: list[Message] = Field(min_length=1)
  max_completion_tokens: StrictInt | None = Field(None, ge=1)  # the newer name of max_tokens
  logprobs: accepting_only(False, None) = None
  top_logprobs: accepting_only(None) = None


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
