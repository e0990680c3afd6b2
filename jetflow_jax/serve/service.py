"""The engine behind one thread: requests in through a queue, token pieces out to asyncio.

The `Orchestrator` is not thread-safe, so one background thread owns it: it takes submitted
jobs from a thread-safe queue, steps the engine while anything runs, and posts each job's token
pieces and its end onto the event loop that submitted it (`call_soon_threadsafe`). Cancelling
is a flag the thread reads at its next step, so any thread may cancel.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
import time
import traceback
import weakref
from typing import AsyncIterator

from jetflow_jax.engine import Engine, Orchestrator, Request, Stream
from jetflow_jax.serve.metrics import Metrics


class Unavailable(Exception):
  """The service takes no requests: it is shutting down, or its engine failed."""


class Job:
  """One request in the service: its pieces arrive on the loop that submitted it."""

  def __init__(self, request: Request, loop: asyncio.AbstractEventLoop):
    self.request, self._loop = request, loop
    self._events: asyncio.Queue = asyncio.Queue()
    self.stream: Stream | None = None  # set by the engine thread once submitted
    self.cancelled = False
    self.ended = False  # its pieces have ended (finished, failed or cut)
    self.finish_reason: str | None = None  # "stop_token", "max_tokens" or "cancelled"

  def cancel(self) -> None:
    """Frees the request's slot at the engine's next step (a no-op once it has finished)."""
    self.cancelled = True
    if self.stream is not None:
      self.stream.cancel()

  async def pieces(self) -> AsyncIterator[list[int]]:
    """Token pieces as the engine makes them; `finish_reason` is set once they end."""
    while True:
      kind, value = await self._events.get()
      if kind == "error":
        self.ended = True
        raise Unavailable(value)
      if kind == "done":
        self.finish_reason, self.ended = value, True
        return
      yield value

  def cut(self, message: str) -> None:
    """From its event loop: ends the pieces now with Unavailable(`message`), freeing the slot."""
    self.cancel()
    self._events.put_nowait(("error", message))

  def post(self, kind: str, value) -> None:
    """From the engine thread: ("tokens", piece), ("done", reason) or ("error", message)."""
    try:
      self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, value))
    except RuntimeError:  # the loop has closed: nobody is listening any more
      pass


class Service:
  """Runs `engine` in a background thread; `submit` from the event loop, `cancel` from anywhere."""

  def __init__(self, engine: Engine, metrics: Metrics):
    self.engine, self.metrics = engine, metrics
    self.draining = False  # set on SIGTERM: new requests are refused, running ones go on
    self.error: str | None = None
    self._inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
    self._ready = threading.Event()
    self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
    self._jobs: weakref.WeakSet[Job] = weakref.WeakSet()  # submitted; gone once unreferenced

  def start(self) -> None:
    """Starts the engine thread; returns once its first step has compiled."""
    self._thread.start()
    self._ready.wait()
    if self.error:
      raise RuntimeError(f"the engine failed to start: {self.error}")

  def stop(self) -> None:
    """Cancels every request and ends the engine thread, after the step it is in.

    It is joined however long that takes: a process that exits while the thread is inside XLA
    aborts instead of exiting cleanly.
    """
    self.draining = True
    self._inbox.put(None)
    self._thread.join()

  @property
  def available(self) -> bool:
    return self._thread.is_alive() and not self.draining and self.error is None

  def submit(self, request: Request) -> Job:
    """Queues `request`; InputError now if it cannot fit, Unavailable if none are taken."""
    if not self.available:
      raise Unavailable(self.error or "the server is shutting down")
    self.engine.check(request)
    job = Job(request, asyncio.get_running_loop())
    self._jobs.add(job)
    self._inbox.put(job)
    return job

  def cut(self, message: str) -> None:
    """From the event loop: ends every job still running with `message` (a shutdown's end)."""
    for job in list(self._jobs):
      if not job.ended:
        job.cut(message)

  def _run(self) -> None:
    orchestrator = Orchestrator(self.engine)
    jobs: list[Job] = []
    try:
      # Compile the first prompt bucket and the greedy step before the first client waits.
      orchestrator.generate([Request([0], 1, stop_tokens=())])
      self._ready.set()
      while self._admit(orchestrator, jobs):
        steps = orchestrator.num_steps
        start = time.perf_counter()
        orchestrator.step()
        if orchestrator.num_steps > steps:
          self.metrics.step_seconds.observe(time.perf_counter() - start)
        for job in [j for j in jobs if j.stream.finished]:
          jobs.remove(job)
          self.metrics.finished(job.stream)
          job.post("done", job.stream.finish_reason)
        self.metrics.queue_depth.set(len(orchestrator.waiting))
        self.metrics.active_slots.set(sum(s is not None for s in orchestrator.slots))
    except Exception as e:  # the engine is unusable: fail every request, refuse new ones
      traceback.print_exc()
      self.error = f"the engine failed: {type(e).__name__}: {e}"
      for job in jobs:
        job.post("error", self.error)
    finally:
      self._ready.set()
      for job in jobs:
        job.post("done", "cancelled")
      while not self._inbox.empty():
        if (job := self._inbox.get()) is not None:
          job.post("done", "cancelled")

  def _admit(self, orchestrator: Orchestrator, jobs: list[Job]) -> bool:
    """Submits queued jobs (waiting for one while idle); False once the service stops."""
    taken = [self._inbox.get()] if not orchestrator.busy else []
    while not self._inbox.empty():
      taken.append(self._inbox.get())
    for job in filter(None, taken):
      job.stream = orchestrator.submit(job.request, functools.partial(job.post, "tokens"))
      if job.cancelled:  # cancelled before the thread saw it
        job.stream.cancel()
      jobs.append(job)
    return None not in taken
