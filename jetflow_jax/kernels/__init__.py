"""Attention kernels beyond plain masked attention: tree-verify attention over a read-only cache,
and the head's packed-anchor training attention."""

from jetflow_jax.kernels.train_attention import train_attention
from jetflow_jax.kernels.tree_attention import tree_attention, tree_attention_xla

__all__ = ["train_attention", "tree_attention", "tree_attention_xla"]
