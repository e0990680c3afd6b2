"""Decoding: one round (draft, build the tree, verify, choose, commit) over a state of rows,
and its two drivers: the device loop for batches (`generate`, `speculative_generate`,
`decode_prompts`) and the continuous-batching engine (`jetflow_jax.engine`).

Files: `state.py` (the rows and why they stop), `prefill.py`, `round.py`, `loop.py` (the device
loop and its host driver), `policy.py` (method -> drafter, tree, head), `api.py`, `budget.py`
(which tree budget a round should verify: expected tokens per budget, calibration, costs).
"""

from jetflow_jax.decoding.api import generate, speculative_generate
from jetflow_jax.decoding.loop import Generation, decode_prompts
from jetflow_jax.decoding.policy import METHODS, SPECULATIVE, drafter_for, tree_shape_for
from jetflow_jax.decoding.round import RoundSpec, TreeShape
from jetflow_jax.decoding.state import DecodeState, StopReason

__all__ = ["DecodeState", "Generation", "METHODS", "RoundSpec", "SPECULATIVE", "StopReason",
           "TreeShape", "decode_prompts", "drafter_for", "generate", "speculative_generate",
           "tree_shape_for"]
