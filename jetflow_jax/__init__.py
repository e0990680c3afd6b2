"""jetflow_jax: lossless speculative decoding for Qwen3 with a causal-parallel draft head."""

from jetflow_jax.checkpoint import load_qwen3
from jetflow_jax.config import Qwen3Config
from jetflow_jax.errors import CheckpointError, ConfigError, InputError, JetflowError
from jetflow_jax.model import KVCache, qwen3_forward

__all__ = [
    "CheckpointError", "ConfigError", "InputError", "JetflowError", "KVCache", "Qwen3Config",
    "load_qwen3", "qwen3_forward",
]
