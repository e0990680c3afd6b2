"""Continuous batching: an engine of fixed slots (`engine.py`) and the host loop around it
(`loop.py`), over the one round of `jetflow_jax.decoding`. Every request's tokens are what
`speculative_generate` gives for it alone: greedy token for token, sampled from the target's
exact distribution, reproducible from its seed."""

from jetflow_jax.engine.engine import Engine, Request, make_engine
from jetflow_jax.engine.loop import Orchestrator, Stream
from jetflow_jax.engine.state import EngineState, StepOutput

__all__ = ["Engine", "EngineState", "Orchestrator", "Request", "StepOutput", "Stream",
           "make_engine"]
