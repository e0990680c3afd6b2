"""Loading a target straight onto a mesh: every leaf equals the plain load, and only the blocks
the devices hold are read from the safetensors files (each once)."""

import jax
import numpy as np
import pytest
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jetflow_jax
from jetflow_jax import hf_params
from jetflow_jax.train.sharding import make_mesh, param_sharding


def by_largest_axis(mesh):
  return lambda config, abstract: param_sharding(mesh, abstract)


def by_last_axis(mesh):
  """Splits every leaf's last axis over `fsdp` where it divides: non-leading blocks of HF rows."""
  def spec(leaf):
    axes = [None] * leaf.ndim
    if leaf.ndim and leaf.shape[-1] % mesh.shape["fsdp"] == 0:
      axes[-1] = "fsdp"
    return NamedSharding(mesh, P(*axes))
  return lambda config, abstract: jax.tree.map(spec, abstract)


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("layout", ["largest_axis", "last_axis"])
def test_sharded_load_equals_plain_load_and_reads_only_its_blocks(make_checkpoint, monkeypatch,
                                                                   moe, layout):
  directory, _ = make_checkpoint(moe=moe, dtype=torch.bfloat16, max_shard_size="40KB",
                                 tie_word_embeddings=False)
  _, want = jetflow_jax.load_qwen3(directory)
  read = []
  original = hf_params.SafetensorsDir.get_slice
  def counting(self, key, index):
    block = original(self, key, index)
    read.append(block.size)
    return block
  monkeypatch.setattr(hf_params.SafetensorsDir, "get_slice", counting)
  mesh = make_mesh(data=2, fsdp=2, devices=jax.devices()[:4])
  shardings = (by_largest_axis if layout == "largest_axis" else by_last_axis)(mesh)
  _, got = jetflow_jax.load_qwen3(directory, shardings=shardings)

  placements = shardings(None, jax.eval_shape(lambda: want))
  jax.tree.map(lambda g, s: (g.sharding == s) or pytest.fail(f"{g.sharding} != {s}"), got,
               placements)
  jax.tree.map(lambda g, w: np.testing.assert_array_equal(np.asarray(g), np.asarray(w)), got, want)
  # Each leaf's blocks read once (data replicas share a read); a leaf split over fsdp is read
  # in halves, whole only when replicated. The HF reads of a block may span more than it
  # where a split is not along leading axes, never more than the leaf.
  total = sum(x.size for x in jax.tree.leaves(want))
  split = sum(x.size for x, s in zip(jax.tree.leaves(want), jax.tree.leaves(placements))
              if not s.is_fully_replicated)
  if layout == "largest_axis":
    assert sum(read) == total  # leading-axis splits: exactly the bytes held, once
  assert sum(read) <= total + split
