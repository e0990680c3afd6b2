"""The uvicorn server of an app of `create_app`, and how it shuts down.

A shutdown signal keeps the socket open through a grace period (new requests: 503) while
running requests finish; those still running at its end get an error their client can read.
"""

from __future__ import annotations

import asyncio
import math
import os
import time

import uvicorn
from fastapi import FastAPI

from jetflow_jax.errors import InputError
from jetflow_jax.serve.service import Service

GRACE_S = 20  # after a shutdown signal, running requests get this long before they are cut
GRACE_ENV = "JETFLOW_SHUTDOWN_GRACE_S"  # overrides GRACE_S (seconds)
CUT_S = 5  # how long requests cut at the grace's end get to send their error


def grace_seconds() -> float:
  """The shutdown grace: GRACE_S, or $JETFLOW_SHUTDOWN_GRACE_S if set."""
  value = os.environ.get(GRACE_ENV)
  if value is None:
    return GRACE_S
  try:
    seconds = float(value)
    if not 0 <= seconds < math.inf:
      raise ValueError(value)
  except ValueError:
    raise InputError(f"{GRACE_ENV} must be a number of seconds >= 0 (got {value!r})") from None
  return seconds


class Server(uvicorn.Server):
  """uvicorn for an app of `create_app`: a shutdown signal turns new requests away (503) while
  it still listens, lets running ones finish for `grace_s` seconds, then cuts those left with
  an error (a 503, or an error event ending the stream) and closes.

  Args:
    app: the app `create_app` made.
    host: the address to listen on.
    port: the port.
    grace_s: the shutdown grace; None reads $JETFLOW_SHUTDOWN_GRACE_S (default 20 s).

  Raises:
    InputError: a $JETFLOW_SHUTDOWN_GRACE_S that is not a number of seconds >= 0.
  """

  def __init__(self, app: FastAPI, host: str, port: int, grace_s: float | None = None):
    super().__init__(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                    timeout_graceful_shutdown=CUT_S))
    self.service: Service = app.state.service
    self.grace_s = grace_seconds() if grace_s is None else grace_s

  def handle_exit(self, sig, frame) -> None:
    self.service.draining = True
    super().handle_exit(sig, frame)

  async def shutdown(self, sockets=None) -> None:
    await self._drain()
    await super().shutdown(sockets)  # stops listening, closes idle connections, ends the app

  async def _drain(self) -> None:
    """Returns once no request runs; cuts the ones still running after the grace."""
    self.service.draining = True
    running = lambda: self.server_state.tasks and not self.force_exit
    deadline = time.monotonic() + self.grace_s
    while running() and time.monotonic() < deadline:
      await asyncio.sleep(0.05)
    if running():
      self.service.cut(f"the server is shutting down: the request did not finish within the "
                       f"{self.grace_s:g} s grace")
      deadline = time.monotonic() + CUT_S
      while running() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
