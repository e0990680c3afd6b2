"""An independent PyTorch draft head written from the method description (not from our JAX code).

Built from transformers' Qwen3 pieces; its parameter names are the reference
checkpoint layout, so loading our exported safetensors into it with
`strict=True` also checks the export's names and shapes.
"""

import torch
from transformers.models.qwen3.modeling_qwen3 import (Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding,
                                                      apply_rotary_pos_emb)


class OracleAttention(torch.nn.Module):

  def __init__(self, config):
    super().__init__()
    self.heads, self.kv_heads, self.head_dim = (config.num_attention_heads,
                                                config.num_key_value_heads, config.head_dim)
    hidden = config.hidden_size
    self.q_proj = torch.nn.Linear(hidden, self.heads * self.head_dim, bias=False)
    self.k_proj = torch.nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
    self.v_proj = torch.nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
    self.o_proj = torch.nn.Linear(self.heads * self.head_dim, hidden, bias=False)
    self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
    self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

  def forward(self, block, context, cos_sin_block, cos_sin_all, mask):
    batch, length, _ = block.shape
    split = lambda x, heads: x.view(batch, -1, heads, self.head_dim).transpose(1, 2)
    q = self.q_norm(split(self.q_proj(block), self.heads))
    # Context keys/values come from the fused target features, through this layer's projections.
    k = self.k_norm(split(torch.cat([self.k_proj(context), self.k_proj(block)], 1), self.kv_heads))
    v = split(torch.cat([self.v_proj(context), self.v_proj(block)], 1), self.kv_heads)
    q, _ = apply_rotary_pos_emb(q, q, *cos_sin_block)
    _, k = apply_rotary_pos_emb(k, k, *cos_sin_all)
    group = self.heads // self.kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2)) / self.head_dim**0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.softmax(scores, -1) @ v
    return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class OracleLayer(torch.nn.Module):

  def __init__(self, config):
    super().__init__()
    self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    self.self_attn = OracleAttention(config)
    self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    self.mlp = Qwen3MLP(config)

  def forward(self, x, context, cos_sin_block, cos_sin_all, mask):
    x = x + self.self_attn(self.input_layernorm(x), context, cos_sin_block, cos_sin_all, mask)
    return x + self.mlp(self.post_attention_layernorm(x))


class OracleHead(torch.nn.Module):
  """`config` is a transformers Qwen3Config of the head's layers; `num_taps` target taps."""

  def __init__(self, config, num_taps, causal):
    super().__init__()
    self.causal = causal
    self.fc = torch.nn.Linear(num_taps * config.hidden_size, config.hidden_size, bias=False)
    self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    self.layers = torch.nn.ModuleList(OracleLayer(config) for _ in range(config.num_hidden_layers))
    self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    self.rotary = Qwen3RotaryEmbedding(config)

  def forward(self, taps, block_embeddings):
    """taps `[B, C, n_taps * D]` of the C context tokens; block embeddings `[B, blk, D]`."""
    context = self.hidden_norm(self.fc(taps))
    num_context, block = taps.shape[1], block_embeddings.shape[1]
    positions = torch.arange(num_context + block)[None]
    cos_sin_all = self.rotary(block_embeddings, positions)
    cos_sin_block = tuple(t[:, num_context:] for t in cos_sin_all)
    in_block = (torch.tril(torch.ones(block, block, dtype=torch.bool)) if self.causal
                else torch.ones(block, block, dtype=torch.bool))
    mask = torch.cat([torch.ones(block, num_context, dtype=torch.bool), in_block], 1)
    x = block_embeddings
    for layer in self.layers:
      x = layer(x, context, cos_sin_block, cos_sin_all, mask)
    return self.norm(x)
