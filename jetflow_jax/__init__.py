"""jetflow_jax: lossless speculative decoding for Qwen3 with a causal-parallel draft head."""

from jetflow_jax.checkpoint import load_qwen3
from jetflow_jax.config import Qwen3Config
from jetflow_jax.decoding import Generation, generate, speculative_generate
from jetflow_jax.errors import CheckpointError, ConfigError, InputError, JetflowError
from jetflow_jax.head import draft_logits
from jetflow_jax.head_checkpoint import load_head, save_hf_head
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.model import KVCache, qwen3_forward
from jetflow_jax.tree import DraftTree, build_tree, chain_tree

__all__ = [
    "CheckpointError", "ConfigError", "DraftTree", "HeadConfig", "InputError", "JetflowError",
    "Generation", "KVCache", "Qwen3Config", "build_tree", "chain_tree", "draft_logits", "generate",
    "load_head", "load_qwen3", "qwen3_forward", "save_hf_head", "speculative_generate",
]
