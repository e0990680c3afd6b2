"""Attention kernels beyond plain masked attention: tree-verify attention over a read-only cache."""

from jetflow_jax.kernels.tree_attention import tree_attention, tree_attention_xla

__all__ = ["tree_attention", "tree_attention_xla"]
