"""The OpenAI shapes: request bodies (validated) and the bodies of answers, whole or streamed.

Types are as strict as OpenAI's (a boolean is not an integer, numbers are finite), and a field
this server does not act on is refused by name unless it holds the value that changes nothing
(`frequency_penalty: 0`, `suffix: ""`, ...): a client never gets an answer that silently
ignored what it asked.
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
MAX_CHOICES = 128  # n and best_of, as OpenAI bounds n


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


def accepting_only(*values):
  """A field this server does not implement, taken only at a value that changes nothing."""

  def check(value):
    if not any(type(value) is type(v) and value == v for v in values):
      shown = " or ".join("null" if v is None else repr(v).lower() if isinstance(v, bool)
                          else repr(v) for v in values)
      raise PydanticCustomError("unsupported", "not supported: only {shown} is accepted",
                                {"shown": shown})
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
  """What completions and chat share; `refusal` checks what spans fields."""

  model: Text | None = None
  max_tokens: StrictInt | None = Field(None, ge=1)
  temperature: Temperature | None = None  # None: 1.0, OpenAI's default
  top_p: TopP | None = None
  seed: StrictInt | None = None  # None: one drawn per request
  stop: Annotated[list[str], BeforeValidator(stop_list)] = []
  stream: StrictBool | None = None
  stream_options: StreamOptions | None = None
  n: StrictInt | None = Field(None, ge=1, le=MAX_CHOICES)  # choices per prompt
  # Accepted at their neutral values, as clients send them by default.
  frequency_penalty: accepting_only(0, 0.0, None) = None
  presence_penalty: accepting_only(0, 0.0, None) = None
  logit_bias: accepting_only({}, None) = None
  user: Text | None = None  # the caller's end user, for their own tracking: nothing to do here
  return_token_ids: StrictBool | None = None  # vLLM's ask for token_ids: ours always come

  def refusal(self) -> tuple[str, str] | None:
    """(field, message) of a combination of values refused, None if there is none."""
    if self.stream_options is not None and not self.stream:
      return "stream_options", "stream_options: only allowed when stream is true"
    return None


def prompt_list(prompt) -> list[str | list[int]]:
  """The prompts of a request: one (text or token ids), or a batch of them (a list of either)."""
  one = lambda p: isinstance(p, str) or (isinstance(p, list) and all(type(t) is int for t in p))
  if one(prompt):
    return [encodable(prompt) if isinstance(prompt, str) else prompt]
  if isinstance(prompt, list) and all(map(one, prompt)):
    return [encodable(p) if isinstance(p, str) else p for p in prompt]
  raise PydanticCustomError("prompt_type", "must be a string or a list of token ids, or a list "
                            "of those (a batch)")


class CompletionRequest(GenerationParams):
  prompt: Annotated[list[str | list[int]], BeforeValidator(prompt_list)]  # each prompt
  max_tokens: StrictInt | None = Field(None, ge=0)  # 0 only with echo: the prompt alone
  logprobs: StrictInt | None = Field(None, ge=0, le=5)  # alternatives per token, as OpenAI's
  echo: StrictBool | None = None
  best_of: StrictInt | None = Field(None, ge=1, le=MAX_CHOICES)
  suffix: accepting_only(None, "") = None

  def refusal(self) -> tuple[str, str] | None:
    n, best_of = self.n or 1, self.best_of or self.n or 1
    if self.max_tokens == 0 and not self.echo:
      return "max_tokens", "max_tokens: 0 is only allowed with echo (the prompt alone)"
    if best_of < n:
      return "best_of", f"best_of: must be >= n (got best_of {best_of}, n {n})"
    if best_of > n and self.stream:
      return "best_of", "best_of: cannot be streamed (best_of > n with stream true)"
    return super().refusal()


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
  logprobs: StrictBool | None = None
  top_logprobs: StrictInt | None = Field(None, ge=0, le=20)  # alternatives per token

  def refusal(self) -> tuple[str, str] | None:
    if self.top_logprobs is not None and not self.logprobs:
      return "top_logprobs", "top_logprobs: only allowed when logprobs is true"
    return super().refusal()


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


def error_body(message: str, status: int, param: str | None = None,
               code: str | None = None) -> dict:
  kind = "invalid_request_error" if status < 500 else "server_error"
  return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclasses.dataclass
class TokenLogprob:
  """One token of an answer as log-probabilities show it."""

  token: str
  bytes: bytes
  logprob: float | None  # None: a prompt's first token, which nothing predicts
  top: list[tuple[str, bytes, float]] | None  # the likeliest (token, bytes, logprob), in order
  offset: int  # where its text starts in the choice's text


def completion_logprobs(tokens: list[TokenLogprob]) -> dict:
  """OpenAI's legacy shape: parallel lists. Each dict of alternatives holds the chosen token too
  (OpenAI: up to logprobs + 1 of them), with its own log-probability."""

  def alternatives(t: TokenLogprob) -> dict | None:
    if t.top is None:
      return None
    top = {}
    for token, _, logprob in t.top:
      top.setdefault(token, logprob)
    top[t.token] = t.logprob  # so a greedy token's logprob is exactly the largest
    return top

  return {"tokens": [t.token for t in tokens], "token_logprobs": [t.logprob for t in tokens],
          "top_logprobs": [alternatives(t) for t in tokens],
          "text_offset": [t.offset for t in tokens]}


def chat_logprobs(tokens: list[TokenLogprob]) -> dict:
  """The chat shape: per token its string, log-probability, bytes and alternatives."""
  entry = lambda token, raw, logprob: {"token": token, "logprob": logprob, "bytes": list(raw)}
  return {"content": [{**entry(t.token, t.bytes, t.logprob),
                       "top_logprobs": [entry(*top) for top in t.top or []]} for t in tokens]}


@dataclasses.dataclass
class Reply:
  """The bodies of one answer, a completion or a chat message: whole, or chunk by chunk."""

  model: str
  chat: bool
  id: str = dataclasses.field(init=False)
  created: int = dataclasses.field(default_factory=lambda: int(time.time()))

  def __post_init__(self):
    self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

  def choice(self, index: int, text: str, finish_reason: str, token_ids: list[int],
             logprobs: list[TokenLogprob] | None = None) -> dict:
    """One choice of the non-streamed answer; `token_ids` (not OpenAI's) are the generated
    tokens the text came from."""
    content = ({"message": {"role": "assistant", "content": text}} if self.chat
               else {"text": text})
    return {"index": index, **content, "logprobs": self._logprobs(logprobs),
            "finish_reason": finish_reason, "token_ids": token_ids}

  def whole(self, choices: list[dict], counts: dict) -> dict:
    """The non-streamed answer."""
    return self._body("chat.completion" if self.chat else "text_completion", choices,
                      usage=counts)

  def chunk(self, index: int, text: str, finish_reason: str | None = None, role: bool = False,
            logprobs: list[TokenLogprob] | None = None) -> dict:
    """One streamed piece of choice `index`; `role` opens a chat stream, `finish_reason` ends
    it; `logprobs` are its tokens' (None: not asked for)."""
    if self.chat:
      delta = {"role": "assistant", "content": text} if role else {"content": text} if text else {}
      content = {"delta": delta}
    else:
      content = {"text": text}
    return self._body(self._chunk_object, [{"index": index, **content,
                                            "logprobs": self._logprobs(logprobs),
                                            "finish_reason": finish_reason}])

  def usage_chunk(self, counts: dict) -> dict:
    """The last chunk when the client asked for `stream_options.include_usage`."""
    return self._body(self._chunk_object, [], usage=counts)

  def _logprobs(self, tokens: list[TokenLogprob] | None) -> dict | None:
    if tokens is None:
      return None
    return chat_logprobs(tokens) if self.chat else completion_logprobs(tokens)

  @property
  def _chunk_object(self) -> str:
    return "chat.completion.chunk" if self.chat else "text_completion"

  def _body(self, kind: str, choices: list[dict], **extra) -> dict:
    return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
            "choices": choices, **extra}
