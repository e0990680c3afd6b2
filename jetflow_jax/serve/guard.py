"""What a request must pass before any route reads it: an API key (/v1 routes) and a body size.

Both are pure ASGI middleware that look at headers and count bytes, so a refused request costs
no JSON parsing and no tokenizing. A refusal is sent at once; what the client still sends of its
body is then read and dropped (for DRAIN_S at most), so that a client that reads its answer only
once it has sent everything gets the answer, not a reset connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import json
import os
from typing import Sequence

from jetflow_jax.serve.protocol import error_body

KEY_ENVS = ("JETFLOW_API_KEY", "VLLM_API_KEY")  # the first one set is the key
# A token of text JSON-escapes to ~6 bytes per non-ASCII character, a token id to <= 8 bytes:
# 64 a token leaves room for a prompt filling the context several times over (a batch).
REQUEST_BYTES_PER_TOKEN = 64
MIN_REQUEST_BYTES = 1 << 20  # nginx's default client_max_body_size
DRAIN_S = 5  # how long a refused request's body is read and dropped (nginx's lingering_timeout)


def default_max_request_bytes(max_context: int) -> int:
  """The bound on a request body when --max-request-bytes is not given."""
  return max(MIN_REQUEST_BYTES, REQUEST_BYTES_PER_TOKEN * max_context)


def key_from_env() -> str | None:
  """The API key of $JETFLOW_API_KEY, else of $VLLM_API_KEY (empty counts as unset)."""
  return next((os.environ[name] for name in KEY_ENVS if os.environ.get(name)), None)


def is_loopback(host: str) -> bool:
  """Whether binding `host` serves this machine only."""
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:  # a host name: it may resolve to any interface
    return False


def header(scope: dict, name: bytes) -> bytes | None:
  """A request header's value (the first, if repeated), None if absent."""
  return next((value for key, value in scope["headers"] if key == name), None)


async def refuse(receive, send, status: int, message: str, code: str,
                 headers: Sequence[tuple[bytes, bytes]] = (), body_left: bool = True) -> None:
  """Answers with an OpenAI-shaped error body; with `body_left`, the response ends only once the
  request's body has (or DRAIN_S have passed)."""
  body = json.dumps(error_body(message, status, code=code)).encode()
  await send({"type": "http.response.start", "status": status,
              "headers": [(b"content-type", b"application/json"),
                          (b"content-length", str(len(body)).encode()), *headers]})
  await send({"type": "http.response.body", "body": body, "more_body": body_left})
  if body_left:
    # uvicorn stops reading once a response has ended, and closes the connection if the client
    # asked to: the kernel would then reset it under a client still sending.
    with contextlib.suppress(asyncio.TimeoutError):
      await asyncio.wait_for(drain(receive), DRAIN_S)
    await send({"type": "http.response.body", "body": b""})


async def drain(receive) -> None:
  """Reads the rest of a request's body, dropping it."""
  while (message := await receive())["type"] == "http.request" and message.get("more_body"):
    pass


def digest(key: bytes) -> bytes:
  # Digests are compared, not keys: equal lengths, so the time says nothing of a key's length.
  return hashlib.sha256(key).digest()


class RequireKey:
  """ASGI middleware: a /v1 route answers 401 unless `Authorization: Bearer KEY` names one of
  `keys`; other routes (/health, /metrics) stay open, as vLLM's."""

  def __init__(self, app, keys: Sequence[str]):
    self.app = app
    self._digests = [digest(key.encode()) for key in keys]

  def admits(self, authorization: bytes | None) -> bool:
    """Whether an Authorization header's value holds one of the keys (in constant time)."""
    scheme, _, token = (authorization or b"").strip().partition(b" ")
    given = digest(token.strip())
    matches = [hmac.compare_digest(given, known) for known in self._digests]  # all compared
    return scheme.lower() == b"bearer" and any(matches)

  async def __call__(self, scope, receive, send):
    path = scope.get("path", "")
    if scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/")):
      authorization = header(scope, b"authorization")
      if not self.admits(authorization):
        problem = ("invalid API key" if authorization is not None
                   else "this server requires an API key")
        return await refuse(receive, send, 401, f"{problem}: send it as the header "
                            "'Authorization: Bearer KEY'", "invalid_api_key",
                            [(b"www-authenticate", b"Bearer")])
    await self.app(scope, receive, send)


class LimitBody:
  """ASGI middleware: a request body over `max_bytes` is answered 413 before any route reads
  it: at once when its Content-Length says so, else once the chunks read so far pass it."""

  def __init__(self, app, max_bytes: int):
    self.app, self.max_bytes = app, max_bytes

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    length = header(scope, b"content-length")
    if length is not None and length.isdigit() and int(length) > self.max_bytes:
      return await self.too_large(receive, send, f"its Content-Length is {int(length)} bytes")
    body, more = bytearray(), True
    while more:
      message = await receive()
      if message["type"] == "http.disconnect":  # gone before its body came: nobody to answer
        return
      body += message.get("body", b"")
      more = message.get("more_body", False)
      if len(body) > self.max_bytes:
        return await self.too_large(receive, send, f"more than {self.max_bytes} bytes came",
                                    body_left=more)
    read = False

    async def replay():  # the body in one message, then whatever the connection says next
      nonlocal read
      if read:
        return await receive()
      read = True
      return {"type": "http.request", "body": bytes(body), "more_body": False}

    await self.app(scope, replay, send)

  async def too_large(self, receive, send, why: str, body_left: bool = True) -> None:
    await refuse(receive, send, 413, f"the request body is too large ({why}); this server "
                 f"takes at most {self.max_bytes} bytes (--max-request-bytes)",
                 "request_too_large", body_left=body_left)
