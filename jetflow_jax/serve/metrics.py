"""The server's Prometheus metrics, in a registry of its own (servers can share a process)."""

from __future__ import annotations

import functools

import jax
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from jetflow_jax.decoding.budget import LADDER
from jetflow_jax.engine import Stream

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
# JAX records this once per program it lowers, whether XLA then compiles it or the persistent
# cache has it: a jit call that finds its program already in memory records nothing.
LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_lowered = [0]


@functools.cache
def count_compiles() -> None:
  """Counts every program JAX lowers in this process from now on (once per process: JAX's
  listeners cannot be removed)."""

  def listen(event: str, duration: float, **_) -> None:
    if event == LOWERING_EVENT:
      _lowered[0] += 1

  jax.monitoring.register_event_duration_secs_listener(listen)


def compiles() -> int:
  """Programs lowered in this process since `count_compiles` was first called."""
  return _lowered[0]


class Compiles:
  """The process's compile count, read when scraped."""

  def collect(self):
    yield CounterMetricFamily("jetflow_compiles", "programs JAX compiled (or loaded from the "
                              "persistent cache) in this process; one a request adds is one it "
                              "waited for", value=compiles())


class Metrics:
  """Requests by endpoint and status, timeouts, tokens, tau, the queue, the slots, step times and
  compiles."""

  def __init__(self):
    self.registry = CollectorRegistry()
    r = self.registry
    self.requests = Counter("jetflow_requests", "HTTP requests by endpoint and status",
                            ["endpoint", "status"], registry=r)
    self.prompt_tokens = Counter("jetflow_prompt_tokens", "prompt tokens of finished requests",
                                 registry=r)
    self.completion_tokens = Counter("jetflow_completion_tokens",
                                     "tokens generated for finished requests", registry=r)
    self.rounds = Counter("jetflow_rounds", "speculative rounds finished requests took part in",
                          registry=r)
    self.tau = Gauge("jetflow_tau", "tokens committed per round (mean accepted length), over "
                     "finished requests", registry=r)
    self.queue_depth = Gauge("jetflow_queue_depth", "requests waiting for a slot", registry=r)
    self.active_slots = Gauge("jetflow_active_slots", "slots holding a request", registry=r)
    self.timeouts = Counter("jetflow_request_timeouts", "requests ended by --request-timeout, "
                            "queued or decoding", registry=r)
    self.step_seconds = Histogram(
        "jetflow_step_seconds", "one engine step (rounds_per_step rounds) as the host loop sees it",
        buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0), registry=r)
    self.step_budget = Histogram(
        "jetflow_step_budget", "tree nodes a slot's rounds verified in one engine step (1: AR), "
        "as chosen step by step with --budget auto", buckets=LADDER, registry=r)
    count_compiles()
    r.register(Compiles())
    self._round_tokens = self._rounds = 0

  def finished(self, stream: Stream) -> None:
    """Counts a request the engine is done with (finished or cancelled)."""
    self.prompt_tokens.inc(len(stream.request.prompt))
    self.completion_tokens.inc(len(stream.tokens))
    self.rounds.inc(stream.rounds)
    # The first token comes from the prefill, not from a round.
    self._round_tokens += max(len(stream.tokens) - 1, 0)
    self._rounds += stream.rounds
    if self._rounds:
      self.tau.set(self._round_tokens / self._rounds)

  def render(self) -> bytes:
    return generate_latest(self.registry)


class CountRequests:
  """ASGI middleware counting responses by endpoint and status (streams pass straight through)."""

  def __init__(self, app, metrics: Metrics):
    self.app, self.metrics = app, metrics

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"

    async def counted(message):
      if message["type"] == "http.response.start":
        self.metrics.requests.labels(endpoint, str(message["status"])).inc()
      await send(message)

    await self.app(scope, receive, counted)
