"""The host loop: a queue of requests, admission as slots free up, streaming, cancellation.

Each `Orchestrator.step()` frees the slots of cancelled requests, admits waiting requests into
free slots (`prefill` + `insert`), dispatches one engine step, and only then reads back the
previous step's new tokens (a few hundred ints): the device runs the step just dispatched while
the host streams, so the host's Python overlaps the rounds instead of adding to them. With a
budget ladder, each step's budget is chosen just before it is dispatched (`engine.budgets`),
from what the steps read back so far.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Iterable, Sequence

import jax
import numpy as np

from jetflow_jax.decoding.state import StopReason
from jetflow_jax.engine.budgets import engine_chooser, step_seconds
from jetflow_jax.engine.engine import Engine, Request
from jetflow_jax.engine.state import StepOutput
from jetflow_jax.sampling import sampling_flags


@dataclasses.dataclass(eq=False)
class Stream:
  """One submitted request: its tokens so far, and how it ended (None while it runs).

  `Orchestrator.submit` returns it and fills it as the request runs.

  Attributes:
    request: the `Request`.
    stop_tokens: its stop ids.
    on_tokens: called with each new piece of tokens.
    tokens: the tokens so far.
    finish_reason: the `StopReason` it ended with; None while it runs.
    rounds: speculative rounds it took part in (the prefill's token excluded).
    cancelled: `cancel()` was called.
    logprobs: with `request.logprobs`, each token's log-probability under the target.
    top_logprobs: and its `request.logprobs` likeliest (token, log-probability) pairs.
    prompt_logprobs: with `request.prompt_logprobs`, the same for the prompt's tokens (None
      for the first).
    prompt_top_logprobs: their likeliest pairs.
  """

  request: Request
  stop_tokens: tuple[int, ...]
  on_tokens: Callable[[list[int]], None] | None = None  # called with each new piece
  tokens: list[int] = dataclasses.field(default_factory=list)
  finish_reason: StopReason | None = None
  rounds: int = 0  # speculative rounds it took part in (the prefill's token excluded)
  cancelled: bool = False
  # With `request.logprobs`: each token's log-probability under the target, and its
  # `request.logprobs` likeliest (token, log-probability) pairs.
  logprobs: list[float] = dataclasses.field(default_factory=list)
  top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
  # With `request.prompt_logprobs`, the same for the prompt's tokens (None for the first).
  prompt_logprobs: list[float | None] = dataclasses.field(default_factory=list)
  prompt_top_logprobs: list[list[tuple[int, float]] | None] = dataclasses.field(
      default_factory=list)

  @property
  def finished(self) -> bool:
    """Whether it has ended."""
    return self.finish_reason is not None

  def cancel(self) -> None:
    """Stops the request at the loop's next step; its slot goes to a waiting request."""
    self.cancelled = True


class Orchestrator:
  """Runs requests through an `Engine`: submit any time, call `step()` (or `run()`).

  An engine with a budget ladder needs each budget's step time: `seconds_l` (one per ladder
  budget), else `budgets.step_seconds` reads them from the cost table or measures them now
  (compiling every step variant; `log` hears how long it took). `schedule` (ladder budgets,
  one step each, in turn) replaces the choice.

  Args:
    engine: the `Engine` it drives.
    seconds_l: with a ladder, each budget's step time; None reads or measures them.
    schedule: with a ladder, budgets to run in turn, one step each, instead of choosing.
    log: hears how long measuring the step times took.
  """

  def __init__(self, engine: Engine, *, seconds_l: Sequence[float] | None = None,
               schedule: Sequence[int] | None = None, log: Callable[[str], None] | None = None):
    self.engine = engine
    self.state = engine.init_state()
    self.waiting: collections.deque[Stream] = collections.deque()
    self.slots: list[Stream | None] = [None] * engine.num_slots
    self._pending: tuple[StepOutput, list[Stream | None], int] | None = None
    self.num_steps = 0
    self.chooser = None
    if engine.ladder:
      if seconds_l is None:
        seconds_l = (np.ones(len(engine.ladder)) if schedule is not None
                     else step_seconds(engine, log=log))
      self.chooser = engine_chooser(engine, seconds_l, schedule)
    # Nodes a round of the last dispatched step verified per slot.
    shape = engine.tree_shape
    self.last_budget = {"root": 1, "chain": engine.drafter.depth + 1}.get(shape.kind,
                                                                         shape.budget)

  def submit(self, request: Request,
             on_tokens: Callable[[list[int]], None] | None = None) -> Stream:
    """Queues `request`; its stream fills as it runs.

    Args:
      request: the `Request`.
      on_tokens: called with each new piece of its tokens.

    Returns:
      Its `Stream`.

    Raises:
      InputError: the request cannot fit a slot (`Engine.check`).
    """
    stream = Stream(request, self.engine.check(request), on_tokens)
    self.waiting.append(stream)
    return stream

  @property
  def busy(self) -> bool:
    """Whether anything is waiting, running or unread."""
    return bool(self.waiting) or any(self.slots) or self._pending is not None

  def step(self) -> bool:
    """One turn of the loop; False once nothing is waiting, running or unread."""
    for slot, stream in enumerate(self.slots):
      if stream is not None and stream.cancelled:
        self._finish(stream, StopReason.CANCELLED)
    for stream in [s for s in self.waiting if s.cancelled]:
      self.waiting.remove(stream)
      self._finish(stream, StopReason.CANCELLED)
    for slot in range(len(self.slots)):
      if self.slots[slot] is None and self.waiting:
        stream = self.waiting.popleft()
        prefix = self.engine.prefill(stream.request)
        if stream.request.prompt_logprobs:
          self._prompt_logprobs(stream, prefix)
        self.state = self.engine.insert(self.state, prefix, slot)
        self.slots[slot] = stream
        if self.chooser is not None:
          self.chooser.reset(slot, stream.request.max_tokens)
    pending, self._pending = self._pending, None
    if any(self.slots):
      running = [s.request for s in self.slots if s is not None]
      budget, taps = None, True
      if self.chooser is not None:
        busy_b = [s is not None for s in self.slots]
        remaining_b = [0 if s is None else s.request.max_tokens - len(s.tokens)
                       for s in self.slots]
        budget = self.last_budget = self.chooser.choose(busy_b, remaining_b)
        taps = budget > 1 or self.chooser.drafting(busy_b)
      self.state, output = self.engine.step(
          self.state, budget, **sampling_flags([r.sampler for r in running]),
          logprobs=any(r.logprobs is not None for r in running), taps=taps)
      self._pending = (output, list(self.slots), budget)
      self.num_steps += 1
    if pending is not None:
      self._deliver(*pending)
    return self.busy

  def run(self) -> None:
    """Steps until every submitted request has finished."""
    while self.step():
      pass

  def close(self) -> None:
    """Keeps what the budget chooser learnt about the drafter (`budgets.HeadRecord`)."""
    if self.chooser is not None:
      self.chooser.close()

  def generate(self, requests: Iterable[Request]) -> list[Stream]:
    """Submits `requests`, runs them all, returns their streams in order."""
    streams = [self.submit(r) for r in requests]
    self.run()
    return streams

  def _deliver(self, output: StepOutput, owners: list[Stream | None], budget: int | None) -> None:
    """A step's new tokens to the streams that held the slots when it was dispatched."""
    output = jax.device_get(output)
    if self.chooser is not None:
      self.chooser.record_step(budget, output, [o is not None and o is s
                                                for o, s in zip(owners, self.slots)])
    new_bw, num_new_b, stop_b, rounds_b = (output.new_bw, output.num_new_b, output.stop_b,
                                           output.rounds_b)
    for slot, stream in enumerate(owners):
      if stream is None or stream.finished:
        continue
      if count := num_new_b[slot]:
        piece = new_bw[slot, :count].tolist()
        if (top := stream.request.logprobs) is not None:
          stream.logprobs.extend(output.logprobs_bw[slot, :count].tolist())
          stream.top_logprobs.extend(pairs(output.top_ids_bwx[slot, :count, :top],
                                           output.top_logprobs_bwx[slot, :count, :top]))
        stream.tokens.extend(piece)
        if stream.on_tokens is not None:
          stream.on_tokens(piece)
      stream.rounds = int(rounds_b[slot])
      if reason := StopReason.of_code(int(stop_b[slot])):
        self._finish(stream, reason)

  def _prompt_logprobs(self, stream: Stream, prefix) -> None:
    """The prompt's log-probabilities, read off its prefill (a wait, for the requests asking)."""
    length, top = len(stream.request.prompt), stream.request.logprobs or 0
    # Whole rows, cut here: slicing on device compiles a program per prompt length.
    logprobs, ids, values = jax.device_get(
        (prefix.logprobs_bs, prefix.top_ids_bsx, prefix.top_logprobs_bsx))
    stream.prompt_logprobs = [None] + logprobs[0, 1:length].tolist()
    stream.prompt_top_logprobs = [None] + pairs(ids[0, 1:length, :top], values[0, 1:length, :top])

  def _finish(self, stream: Stream, reason: StopReason) -> None:
    """Ends `stream`; its slot, if it holds one, is evicted and free for the next request."""
    stream.finish_reason = reason
    if stream in self.slots:
      slot = self.slots.index(stream)
      self.state = self.engine.evict(self.state, slot)
      self.slots[slot] = None


def pairs(ids_wx, logprobs_wx) -> list[list[tuple[int, float]]]:
  """Per position, its (token, log-probability) pairs, likeliest first."""
  return [list(zip(i, v)) for i, v in zip(ids_wx.tolist(), logprobs_wx.tolist())]
