"""The engine behind one thread: requests in through a queue, token pieces out to asyncio.

The `Orchestrator` is not thread-safe, so one background thread owns it: it takes submitted
jobs from a thread-safe queue, steps the engine while anything runs, and posts each job's token
pieces and its end onto the event loop that submitted it (`call_soon_threadsafe`). Cancelling
is a flag the thread reads at its next step, so any thread may cancel.

Before it takes a request the thread warms up: it runs one small request through every program
a request can reach (each prompt bucket's prefill, with and without the prompt's
log-probabilities, and every step variant; with a budget ladder, every budget's step, timed
on the way unless the cost table has it), so no client waits for a compile. Requests that
arrive meanwhile wait their turn; `warming` says how far it is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import queue
import threading
import time
import traceback
import weakref
from typing import AsyncIterator, Callable

from jetflow_jax.decoding.state import bucket_length
from jetflow_jax.engine import Engine, Orchestrator, Request, Stream
from jetflow_jax.serve.metrics import Metrics


class Unavailable(Exception):
  """The service takes no requests: it is shutting down, or its engine failed."""

  status = 503


class TimedOut(Exception):
  """A request still queued or decoding when its deadline passed."""

  status = 504


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
        raise value
      if kind == "done":
        self.finish_reason, self.ended = value, True
        return
      yield value

  def cut(self, error: Exception) -> None:
    """From its event loop: ends the pieces now with `error` (raised), freeing the slot."""
    self.cancel()
    self._events.put_nowait(("error", error))

  def post(self, kind: str, value) -> None:
    """From the engine thread: ("tokens", piece), ("done", reason) or ("error", exception)."""
    try:
      self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, value))
    except RuntimeError:  # the loop has closed: nobody is listening any more
      pass


def warm_up_requests(engine: Engine) -> list[tuple[str, Request]]:
  """One request per program a request can reach, with what it compiles: each prompt bucket's
  prefill and insert, with and without the prompt's log-probabilities (echo), then each step
  variant (greedy, sampled, sampled and filtered; each with and without log-probabilities)."""
  plan, length = [], 1
  while length < engine.max_context:  # a prompt leaves room for one token
    bucket = bucket_length(length, engine.max_context)
    what = f"prompts of {length}-{min(bucket, engine.max_context - 1)} tokens"
    step = ", the greedy step" if length == 1 else ""
    plan += [(what + step, Request([0] * length, 1, stop_tokens=())),
             (f"{what} with their log-probabilities{step and step + ' with log-probabilities'}",
              Request([0] * length, 1, stop_tokens=(), logprobs=0, prompt_logprobs=True))]
    length = bucket + 1
  for what, sampling in (("the sampled step", dict(temperature=1.0)),
                         ("the sampled step with top-p", dict(temperature=1.0, top_p=0.5))):
    plan += [(what, Request([0], 1, stop_tokens=(), **sampling)),
             (f"{what}, with log-probabilities",
              Request([0], 1, stop_tokens=(), logprobs=0, **sampling))]
  return plan


class Service:
  """Runs `engine` in a background thread; `submit` from the event loop, `cancel` from anywhere.

  With `warm_up`, the thread first compiles every variant (see the module's docstring),
  reporting each to `log`; without, a request that needs a new program compiles it.

  Args:
    engine: the `Engine` it runs (only its thread touches it).
    metrics: the Prometheus metrics it updates.
    warm_up: compile every variant a request can reach before taking one.
    log: hears the warm-up's progress.
  """

  def __init__(self, engine: Engine, metrics: Metrics, warm_up: bool = True,
               log: Callable[[str], None] = print):
    self.engine, self.metrics, self.log = engine, metrics, log
    self.draining = False  # set on SIGTERM: new requests are refused, running ones go on
    self.error: str | None = None
    self.warming: str | None = "starting" if warm_up else None  # None once warm
    self._inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
    self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
    self._jobs: weakref.WeakSet[Job] = weakref.WeakSet()  # submitted; gone once unreferenced

  def start(self) -> None:
    """Starts the engine thread (warming up first, if asked); returns at once."""
    self._thread.start()

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
    """Whether it takes requests (running, not draining, not failed)."""
    return self._thread.is_alive() and not self.draining and self.error is None

  def submit(self, request: Request) -> Job:
    """Queues `request` from the event loop.

    Returns:
      Its job, whose events (tokens, done, error) arrive on the event loop.

    Raises:
      InputError: the request cannot fit a slot.
      Unavailable: the service takes no requests (shutting down, or the engine failed).
    """
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
        job.cut(Unavailable(message))

  def _run(self) -> None:
    jobs: list[Job] = []
    orchestrator = None
    try:
      warm_up = self.warming is not None
      if self.engine.ladder:
        self.warming = "measuring a step of each budget"
      orchestrator = Orchestrator(self.engine, log=self.log)
      self.warming = self.warming if warm_up else None
      if warm_up:
        self._warm_up(orchestrator)
      while self._admit(orchestrator, jobs):
        steps = orchestrator.num_steps
        start = time.perf_counter()
        orchestrator.step()
        if orchestrator.num_steps > steps:
          self.metrics.step_seconds.observe(time.perf_counter() - start)
          self.metrics.step_budget.observe(orchestrator.last_budget)
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
        job.post("error", Unavailable(self.error))
    finally:
      if orchestrator is not None:
        orchestrator.close()
      for job in jobs:
        job.post("done", "cancelled")
      while not self._inbox.empty():
        if (job := self._inbox.get()) is not None:
          job.post("done", "cancelled")

  def _warm_up(self, orchestrator: Orchestrator) -> None:
    """Runs `warm_up_requests` one at a time (a shutdown stops it between two)."""
    plan, start = warm_up_requests(self.engine), time.perf_counter()
    chooser = orchestrator.chooser  # learns nothing from these made-up requests
    record = None if chooser is None else dataclasses.replace(chooser.record)
    for done, (what, request) in enumerate(plan):
      if self.draining:
        return
      self.warming = f"compiling {done + 1} of {len(plan)} variants ({what})"
      began = time.perf_counter()
      orchestrator.generate([request])
      self.log(f"warming up {done + 1}/{len(plan)}: {what} "
               f"({time.perf_counter() - began:.1f} s)")
    if chooser is not None:
      chooser.record = record
    self.warming = None
    self.log(f"warm: {len(plan)} variants in {time.perf_counter() - start:.1f} s; taking requests")

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
