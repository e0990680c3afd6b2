"""Shared fixtures: tiny random Qwen3 checkpoints written with transformers (the oracle)."""

import os

# Four host devices let the sharding tests build a real mesh on CPU; set before jax loads.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines with --budget auto measure their step costs each time, and keep no table.
os.environ.setdefault("JETFLOW_COST_TABLES", "")

import copy
import glob
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from jetflow_jax.decoding.loop import compiled
from jetflow_jax.text import bundled_qwen3_tokenizer_dir

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
            rope_theta=10000.0)
TINY_MOE = dict(TINY, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2,
                norm_topk_prob=True)


def randomize_(model: torch.nn.Module, seed: int) -> None:
  """Weights of O(1) activations, so parity is tested on logits that are not all ~0."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if p.ndim == 1:  # RMSNorm scales
        p.copy_(0.5 + torch.rand(p.shape, generator=gen))
      else:
        fan_in = p.shape[-1] if "embed" not in name else 1
        p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)


def make_hf_model(moe: bool = False, seed: int = 0, **overrides):
  from transformers import (Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                            Qwen3MoeForCausalLM)
  fields = dict(TINY_MOE if moe else TINY, **overrides)
  config_cls, model_cls = ((Qwen3MoeConfig, Qwen3MoeForCausalLM) if moe
                           else (Qwen3Config, Qwen3ForCausalLM))
  torch.manual_seed(seed)
  model = model_cls(config_cls(**fields)).eval()
  randomize_(model, seed)
  if model.config.tie_word_embeddings:
    model.tie_weights()
  return model


@pytest.fixture
def make_checkpoint(tmp_path):
  """Factory: writes a tiny random HF Qwen3 checkpoint, returns (directory, torch model)."""
  counter = iter(range(1000))

  def make(moe=False, seed=0, dtype=torch.float32, max_shard_size=None, tokenizer=False,
           **overrides):
    model = make_hf_model(moe=moe, seed=seed, **overrides)
    directory = str(tmp_path / f"ckpt{next(counter)}")
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    with torch.no_grad():  # round the oracle's weights as the file stores them (not its buffers)
      for p in model.parameters():
        p.copy_(p.to(dtype).float())
    copy.deepcopy(model).to(dtype).save_pretrained(directory, **kwargs)
    if tokenizer:
      for path in glob.glob(os.path.join(bundled_qwen3_tokenizer_dir(), "*")):
        shutil.copy(path, directory)
    return directory, model

  return make


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# CLI subprocesses see one CPU device, like a user's shell (this process asks for four).
CLI_ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def run_cli(*args, timeout=900):
  """Runs `python ARGS...` from the repository root; returns the CompletedProcess."""
  return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout, env=CLI_ENV)


@pytest.fixture
def rng():
  return np.random.default_rng(0)


@pytest.fixture(autouse=True)
def room_for_executables():
  """A worker runs hundreds of tests in one process and keeps what they compiled: past half the
  memory maps Linux allows it, let go of the executables, before the next compile fails for
  want of one (a worker crash in XLA:CPU's compiler or cache reader)."""
  yield
  compiled.release_if_crowded(share=0.5)
