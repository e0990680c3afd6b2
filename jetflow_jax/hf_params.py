"""HF safetensors <-> JAX params: one table of tensors, streamed one at a time.

HF stores linear weights as `[out, in]`; ours are `[in, ...out]` (attention
projections split into heads), so every matrix is transposed and reshaped on the
way in. Per-expert MoE tensors are stacked into `[E, ...]` arrays.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.flax
from safetensors import SafetensorError, safe_open

from jetflow_jax.config import Qwen3Config
from jetflow_jax.errors import CheckpointError

Path = tuple[str, ...]
MAX_LISTED = 20


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One HF tensor and where it lives in our params.

  `in_dims` is how many leading axes of our array are the HF input axis (0 for
  norms and embeddings, which are stored as they are). `expert` is the slot in a
  stacked `[E, ...]` array, if any.
  """

  hf_key: str
  path: Path
  in_dims: int = 0
  expert: int | None = None

  def hf_shape(self, our_shape: tuple[int, ...]) -> tuple[int, ...]:
    if self.expert is not None:
      our_shape = our_shape[1:]
    if not self.in_dims:
      return tuple(our_shape)
    return (math.prod(our_shape[self.in_dims:]), math.prod(our_shape[:self.in_dims]))

  def to_ours(self, hf_array, our_shape):
    if self.expert is not None:
      our_shape = our_shape[1:]
    return hf_array.T.reshape(our_shape) if self.in_dims else hf_array

  def read(self, files: "SafetensorsDir", index: tuple[slice, ...], our_shape) -> np.ndarray:
    """The block `index` of our array (without the expert axis), reading only what it covers.

    Our array is the HF `[out, in]` array transposed and reshaped: a block of ours is a
    block of HF rows and columns whose flattened ranges are contiguous when only leading
    axes are split (how every sharding here splits), so just those bytes are read.
    """
    if self.expert is not None:
      our_shape = our_shape[1:]
    index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, our_shape))
    if not self.in_dims:
      return files.get_slice(self.hf_key, index)
    in_flat = _flat_positions(our_shape[:self.in_dims], index[:self.in_dims])
    out_flat = _flat_positions(our_shape[self.in_dims:], index[self.in_dims:])
    block = files.get_slice(self.hf_key, (slice(out_flat[0], out_flat[-1] + 1),
                                          slice(in_flat[0], in_flat[-1] + 1)))
    block = block[np.ix_(out_flat - out_flat[0], in_flat - in_flat[0])]
    return block.T.reshape([s.stop - s.start for s in index])

  def to_hf(self, our_array):
    if self.expert is not None:
      our_array = our_array[self.expert]
    if not self.in_dims:
      return our_array
    shape = self.hf_shape(our_array.shape)
    return our_array.reshape(shape[1], shape[0]).T


def _flat_positions(dims: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
  """Row-major flat positions of the block `index` of an array of shape `dims`, in order."""
  ranges = np.ix_(*[np.arange(s.start, s.stop) for s in index])
  return np.ravel_multi_index(ranges, dims).reshape(-1) if dims else np.zeros(1, np.int64)


def decoder_layer_tensors(config: Qwen3Config, layer: int, hf_prefix: str,
                          path: Path) -> Iterator[Tensor]:
  """The tensors of one Qwen3 decoder layer (shared by the target and the draft head)."""
  for norm in ("input_layernorm", "post_attention_layernorm"):
    yield Tensor(f"{hf_prefix}{norm}.weight", path + (norm, "scale"))
  attn = path + ("self_attn",)
  for proj in ("q_proj", "k_proj", "v_proj"):
    yield Tensor(f"{hf_prefix}self_attn.{proj}.weight", attn + (proj, "kernel"), in_dims=1)
  yield Tensor(f"{hf_prefix}self_attn.o_proj.weight", attn + ("o_proj", "kernel"), in_dims=2)
  for norm in ("q_norm", "k_norm"):
    yield Tensor(f"{hf_prefix}self_attn.{norm}.weight", attn + (norm, "scale"))
  mlp = path + ("mlp",)
  if config.is_moe_layer(layer):
    yield Tensor(f"{hf_prefix}mlp.gate.weight", mlp + ("gate", "kernel"), in_dims=1)
    for e in range(config.num_experts):
      for proj in ("gate_proj", "up_proj", "down_proj"):
        yield Tensor(f"{hf_prefix}mlp.experts.{e}.{proj}.weight", mlp + ("experts", proj),
                     in_dims=1, expert=e)
  else:
    for proj in ("gate_proj", "up_proj", "down_proj"):
      yield Tensor(f"{hf_prefix}mlp.{proj}.weight", mlp + (proj, "kernel"), in_dims=1)


def qwen3_tensors(config: Qwen3Config) -> Iterator[Tensor]:
  """Every tensor of a HF Qwen3 / Qwen3-MoE causal LM checkpoint."""
  yield Tensor("model.embed_tokens.weight", ("embed_tokens", "embedding"))
  for i in range(config.num_hidden_layers):
    yield from decoder_layer_tensors(config, i, f"model.layers.{i}.", (f"layers_{i}",))
  yield Tensor("model.norm.weight", ("norm", "scale"))
  if not config.tie_word_embeddings:
    yield Tensor("lm_head.weight", ("lm_head", "kernel"), in_dims=1)


class SafetensorsDir:
  """The safetensors files of a checkpoint directory, opened lazily, key -> file resolved."""

  def __init__(self, directory: str):
    self.directory = directory
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
      try:
        with open(index) as f:
          weight_map = json.load(f)["weight_map"]
      except (json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
    else:
      files = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
      if not files:
        raise CheckpointError(f"{directory} has no *.safetensors weights")
      weight_map = {key: name for name in files for key in self._open(name).keys()}
    missing_files = sorted({n for n in weight_map.values()
                            if not os.path.isfile(os.path.join(directory, n))})
    if missing_files:
      raise CheckpointError(f"{directory}: safetensors file(s) listed in the index are missing: "
                            f"{', '.join(missing_files)}")
    self.weight_map = weight_map
    self._handles: dict[tuple[str, str], Any] = {}

  def _open(self, name: str, framework: str = "flax"):
    path = os.path.join(self.directory, name)
    try:
      return safe_open(path, framework=framework)
    except (SafetensorError, OSError) as e:
      raise CheckpointError(f"{path} is truncated or not a safetensors file ({e})") from None

  def _handle(self, key: str, framework: str = "flax"):
    name = self.weight_map[key]
    if (name, framework) not in self._handles:
      self._handles[name, framework] = self._open(name, framework)
    return self._handles[name, framework]

  def __contains__(self, key: str) -> bool:
    return key in self.weight_map

  def shape(self, key: str) -> tuple[int, ...]:
    return tuple(self._handle(key).get_slice(key).get_shape())

  def get(self, key: str) -> jax.Array:
    try:
      return self._handle(key).get_tensor(key)
    except SafetensorError as e:
      raise CheckpointError(f"{self.weight_map[key]}: cannot read {key} ({e})") from None

  def get_slice(self, key: str, index: tuple[slice, ...]) -> np.ndarray:
    """A block of one tensor as NumPy, reading only its bytes."""
    try:
      return self._handle(key, "numpy").get_slice(key)[index]
    except SafetensorError as e:
      raise CheckpointError(f"{self.weight_map[key]}: cannot read {key} ({e})") from None


def _leaf(tree: dict, path: Path):
  for name in path:
    tree = tree[name]
  return tree


def _set_leaf(tree: dict, path: Path, value) -> None:
  for name in path[:-1]:
    tree = tree.setdefault(name, {})
  tree[path[-1]] = value


def check_shapes(files: SafetensorsDir, tensors: Iterable[Tensor], abstract_params,
                 what: str) -> None:
  """Raises one error listing every missing tensor and every shape that disagrees."""
  missing, wrong = [], []
  for t in tensors:
    expected = t.hf_shape(_leaf(abstract_params, t.path).shape)
    if t.hf_key not in files:
      missing.append(t.hf_key)
    elif (found := files.shape(t.hf_key)) != expected:
      wrong.append(f"{t.hf_key}: checkpoint has {list(found)}, config implies {list(expected)}")
  problems = []
  if missing:
    problems.append(f"{len(missing)} tensor(s) missing: " + ", ".join(missing[:MAX_LISTED]))
  if wrong:
    problems.append(f"{len(wrong)} tensor(s) with shapes that disagree with config.json:\n  "
                    + "\n  ".join(wrong[:MAX_LISTED]))
  if problems:
    raise CheckpointError(f"{what} does not match its config: " + "\n".join(problems))


def load_tensors(directory: str, tensors: list[Tensor], abstract_params, dtype,
                 shardings=None) -> dict:
  """Reads `tensors` from the safetensors files of `directory` into a params pytree.

  With `shardings` (a pytree of `jax.sharding.Sharding` like the params), each leaf is
  built on its devices from the blocks they hold, and only those blocks are read: a process
  of a multi-host job reads the slices of its own devices and nothing else.
  """
  files = SafetensorsDir(directory)
  check_shapes(files, tensors, abstract_params, directory)
  if shardings is not None:
    return _load_sharded(files, tensors, abstract_params, dtype, shardings)
  params: dict = {}
  experts: dict[Path, list] = {}
  for t in tensors:
    shape = _leaf(abstract_params, t.path).shape
    value = t.to_ours(files.get(t.hf_key), shape).astype(dtype)
    if t.expert is None:
      _set_leaf(params, t.path, value)
    else:
      experts.setdefault(t.path, []).append(value)
      if len(experts[t.path]) == shape[0]:  # last expert of this layer: stack and free the parts
        _set_leaf(params, t.path, jnp.stack(experts.pop(t.path)))
  return params


def _load_sharded(files: SafetensorsDir, tensors: list[Tensor], abstract_params, dtype,
                  shardings) -> dict:
  by_path: dict[Path, list[Tensor]] = {}
  for t in tensors:
    by_path.setdefault(t.path, []).append(t)
  params: dict = {}
  for path, group in by_path.items():
    shape = _leaf(abstract_params, path).shape
    blocks: dict[tuple, np.ndarray] = {}  # devices holding the same block (replicas) read it once

    def block(index, group=group, shape=shape, blocks=blocks):
      key = tuple(s.indices(n) for s, n in zip(index, shape))
      if key not in blocks:
        if group[0].expert is None:
          blocks[key] = group[0].read(files, index, shape).astype(dtype)
        else:  # stacked experts: read only this block's experts
          experts = range(shape[0])[index[0]]
          blocks[key] = np.stack([group[e].read(files, index[1:], shape)
                                  for e in experts]).astype(dtype)
      return blocks[key]

    _set_leaf(params, path, jax.make_array_from_callback(shape, _leaf(shardings, path), block))
  return params


def save_tensors(params, tensors: Iterable[Tensor], path: str,
                 metadata: dict[str, str] | None = None,
                 extra: dict[str, np.ndarray] | None = None) -> None:
  """Writes `params` as one HF-layout safetensors file, keeping their dtype; `extra` adds
  arrays stored as they are (integer and boolean buffers)."""
  arrays = {t.hf_key: jnp.asarray(t.to_hf(_leaf(params, t.path))) for t in tensors}
  arrays.update(extra or {})
  # transformers only reads safetensors files whose metadata says "pt".
  safetensors.flax.save_file(arrays, path, metadata={"format": "pt", **(metadata or {})})
