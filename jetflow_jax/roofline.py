"""The physical floor of each piece of a decode round: what it must move and compute, and the
device peaks that bound how fast that can go.

A piece's floor is `max(bytes / HBM bandwidth, FLOPs / dense bf16 FLOP/s)`: no implementation
on that device runs it faster. What is counted (B rows, S committed tokens per row; a row's
cache holds S - 1 of them, the anchor's K/V comes with the round):

- bytes: every weight the piece multiplies, read once (the embedding table only for the rows
  it gathers, unless it doubles as the tied LM head); each row's cache up to its committed
  length, read once; the K/V the piece keeps for later rounds, written once. Activations
  (hidden states, taps, logits) are left out: a fused implementation keeps them on chip, and at
  Qwen3-8B shapes they are small next to the weights (the float32 logits of 256 nodes are
  0.16 GB against 15 GB of weights read).
- FLOPs: 2 per multiply-add of every matmul (weights x tokens) and of attention (QK^T and PV of
  every query against every key its tile spans: its row's committed cache plus the whole block
  or tree, masked entries included, since a kernel computes the tile). Norms, RoPE, softmax and
  SiLU are elementwise and left out (well under 1% at these widths).
- MoE layers: FLOPs for the top-k experts each token uses; bytes for the experts a batch is
  expected to touch under balanced routing (`expected_experts`: k at one token; for 8 of 128,
  nearly all 128 by 100 tokens). A skewed router touches fewer: there the memory floor is a
  little high.
- A round is its pieces in sequence (head, verify, commit), each reading its own weights (the
  LM head read by both is far larger than any on-chip cache), and its floor is the sum of
  theirs: the tree needs the draft before the verify can start, so the head's memory-bound
  time cannot hide under the verify's compute-bound time.

FLOP/s are dense bf16 (no sparsity) peaks from the vendors' data sheets; the dtype only sets
the bytes per weight and cache entry. The table holds peaks only: a floor is a lower bound, and
an "achievable" rate (the repo's issues use ~790 TFLOP/s for an H200, ~80% of peak, from no
measurement here) would raise it above what the chip can do.

The host CPU has no data sheet here: `host_device()` measures it (`measure_host`, a few
seconds, kept in a JSON file for the next call): its read bandwidth by a float32 matrix-vector
product over a matrix far larger than its caches, and its float32 matmul rate at 1, 8, 16, 64
and 256 rows against such a matrix. Small-row matmuls run far below a CPU's peak, so a CPU
floor takes the rate at the piece's own row count (`Cost.rows`). XLA's CPU backend computes
bfloat16 matmuls in float32 (it converts the operands), so there is no bfloat16 rate to measure.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from typing import Any

import numpy as np

from jetflow_jax.config import Qwen3Config
from jetflow_jax.head_config import HeadConfig


@dataclasses.dataclass(frozen=True)
class Device:
  """One accelerator's peaks, per chip; or the host CPU's measured rates."""

  name: str
  hbm_bytes_per_s: float
  flops_per_s: float  # dense bf16 peak (the host: its best measured float32 rate)
  # The host: measured matmul FLOP/s by rows (ascending); a piece of R rows gets the rate
  # interpolated at R (log-log), the first's below and the last's above. Empty: `flops_per_s`.
  flops_by_rows: tuple[tuple[int, float], ...] = ()

  def flops_at(self, rows: float) -> float:
    """FLOP/s of matmuls over `rows` rows (tokens)."""
    if not self.flops_by_rows or rows <= 0:
      return self.flops_per_s
    counts, rates = np.log([r for r, _ in self.flops_by_rows]), np.log(
        [f for _, f in self.flops_by_rows])
    return float(np.exp(np.interp(np.log(rows), counts, rates)))


DEVICES = {d.name: d for d in (
    Device("H100 SXM", 3.35e12, 989e12),
    Device("H200", 4.8e12, 989e12),  # the H100's compute with HBM3e
    Device("B200", 8.0e12, 2.25e15),
    Device("TPU v5e", 819e9, 197e12),
    Device("TPU v5p", 2.765e12, 459e12),
    Device("TPU v6e", 1.64e12, 918e12),
)}

# (words the lower-cased device_kind holds, words it must not hold, entry). JAX reports the CUDA
# name ("NVIDIA H100 80GB HBM3" is the SXM part; PCIe and NVL parts have other peaks and no
# entry; "GH200" is its own word) and TPU generations as "TPU v5 lite" (v5e), "TPU v5" (v5p),
# "TPU v6 lite" (v6e), with the Cloud names also accepted.
_KINDS = (
    ({"h100"}, {"pcie", "nvl"}, "H100 SXM"),
    ({"h200"}, {"nvl"}, "H200"),
    ({"b200"}, set(), "B200"),
    ({"tpu", "v5", "lite"}, set(), "TPU v5e"),
    ({"tpu", "v5e"}, set(), "TPU v5e"),
    ({"tpu", "v5"}, {"lite"}, "TPU v5p"),
    ({"tpu", "v5p"}, set(), "TPU v5p"),
    ({"tpu", "v6", "lite"}, set(), "TPU v6e"),
    ({"tpu", "v6e"}, set(), "TPU v6e"),
)


HOST_ROWS = (1, 8, 16, 64, 256)
HOST_ROOFLINE_ENV = "JETFLOW_HOST_ROOFLINE"


def measure_host(matrix_bytes: int = 1 << 30, width: int = 2048, repeats: int = 5) -> Device:
  """The host CPU's floor rates, measured through XLA (jitted, float32, best of `repeats`):
  read bandwidth from a matrix-vector product over a `matrix_bytes` matrix of `width` columns,
  and matmul FLOP/s at each of `HOST_ROWS` rows against a matrix a quarter that size (far past
  the caches, as a layer's weights are)."""
  import jax
  import jax.numpy as jnp

  def best(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times.append(time.perf_counter() - start)
    return min(times)

  rows_total = matrix_bytes // (4 * width)
  matrix = jax.jit(lambda key: jax.random.normal(key, (rows_total, width), jnp.float32))(
      jax.random.key(0))
  vector = jnp.ones((width,), jnp.float32)
  bandwidth = matrix_bytes / best(jax.jit(lambda m, v: m @ v), matrix, vector)
  weights = matrix[:rows_total // 4]  # [K, width]: a quarter, still far past the caches
  rates = []
  for rows in HOST_ROWS:
    x = jnp.ones((rows, weights.shape[0]), jnp.float32)
    seconds = best(jax.jit(lambda a, w: a @ w), x, weights)
    rates.append((rows, 2.0 * rows * weights.size / seconds))
  del matrix, weights
  return Device("host CPU", bandwidth, max(f for _, f in rates), tuple(rates))


def _host_key() -> dict:
  import jax
  model = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                   model)
  except OSError:
    pass
  return {"cpu": model, "cores": os.cpu_count(), "jax": jax.__version__}


def host_roofline_path() -> str:
  """Where `host_device` keeps its measurement: $JETFLOW_HOST_ROOFLINE, by default
  ~/.cache/jetflow_jax/host_roofline.json."""
  return os.environ.get(HOST_ROOFLINE_ENV) or os.path.join(
      os.path.expanduser("~"), ".cache", "jetflow_jax", "host_roofline.json")


def host_device(remeasure: bool = False) -> Device:
  """This machine's CPU as a `Device`: read from `host_roofline_path()` when it holds a
  measurement of this CPU, core count and jax version, else measured (`measure_host`) and kept."""
  path, key = host_roofline_path(), _host_key()
  if not remeasure:
    try:
      with open(path) as f:
        record = json.load(f)
      if record["key"] == key:
        return Device(record["name"], record["hbm_bytes_per_s"], record["flops_per_s"],
                      tuple((int(r), float(f)) for r, f in record["flops_by_rows"]))
    except (OSError, ValueError, KeyError, TypeError):
      pass
  device = measure_host()
  try:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
      json.dump({"key": key, **dataclasses.asdict(device)}, f, indent=1)
    os.replace(path + ".tmp", path)
  except OSError:  # a cache: the next call measures again
    pass
  return device


def device_for(device_kind: str) -> Device | None:
  """The table entry of a `jax.Device.device_kind`, or None for a device not in the table."""
  words = set(device_kind.lower().replace("-", " ").split())
  for need, refuse, name in _KINDS:
    if need <= words and not refuse & words:
      return DEVICES[name]
  return None


@dataclasses.dataclass(frozen=True)
class Cost:
  """Bytes a piece moves and FLOPs it does, by kind; a sequence of pieces keeps its stages."""

  weight_bytes: float = 0.0
  cache_bytes: float = 0.0  # KV read, plus K/V written for later rounds
  matmul_flops: float = 0.0
  attention_flops: float = 0.0
  stages: tuple["Cost", ...] = ()  # the pieces, in order, of a cost made by `then`
  rows: float = 0.0  # tokens each weight matmul multiplies (picks a host CPU's rate)

  @property
  def bytes(self) -> float:
    return self.weight_bytes + self.cache_bytes

  @property
  def flops(self) -> float:
    return self.matmul_flops + self.attention_flops

  def then(self, other: "Cost") -> "Cost":
    """`other` run after `self`, on whose output it waits: totals add, and so do floors."""
    return Cost(self.weight_bytes + other.weight_bytes, self.cache_bytes + other.cache_bytes,
                self.matmul_flops + other.matmul_flops,
                self.attention_flops + other.attention_flops,
                (self.stages or (self,)) + (other.stages or (other,)))


def floor_seconds(cost: Cost, device: Device) -> float:
  """The least time `cost` takes on `device`: its bytes at HBM speed or its FLOPs at peak,
  whichever is slower (summed over the stages of a sequence)."""
  if cost.stages:
    return sum(floor_seconds(stage, device) for stage in cost.stages)
  return max(cost.bytes / device.hbm_bytes_per_s, cost.flops / device.flops_at(cost.rows))


def bound(cost: Cost, device: Device) -> str:
  """Which limit sets the floor: "memory" or "compute"; for a sequence whose stages differ,
  theirs in order, "+"-joined (a round: head+verify+commit)."""
  if cost.stages:
    bounds = [bound(stage, device) for stage in cost.stages]
    return bounds[0] if len(set(bounds)) == 1 else "+".join(bounds)
  memory = cost.bytes / device.hbm_bytes_per_s
  return "memory" if memory >= cost.flops / device.flops_at(cost.rows) else "compute"


# --- parameter counts (checked against the init functions' shapes in tests/test_roofline.py) ---

def _attention_params(c) -> int:
  """q, k, v, o projections of one layer."""
  q = c.hidden_size * c.num_attention_heads * c.head_dim
  return 2 * q + 2 * c.hidden_size * c.num_key_value_heads * c.head_dim


def _layer_norm_params(c) -> int:
  """input and post-attention RMSNorms plus q and k norms of one layer."""
  return 2 * c.hidden_size + 2 * c.head_dim


def target_param_counts(config: Qwen3Config) -> dict[str, int]:
  """The target's parameters by group; their sum is the params pytree's size."""
  c, layers = config, config.num_hidden_layers
  moe = [i for i in range(layers) if c.is_moe_layer(i)]
  expert = 3 * c.hidden_size * c.moe_intermediate_size
  return dict(
      embedding=c.vocab_size * c.hidden_size,
      lm_head=0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size,
      attention=layers * _attention_params(c),
      dense_mlp=(layers - len(moe)) * 3 * c.hidden_size * c.intermediate_size,
      router=len(moe) * c.hidden_size * c.num_experts,
      experts=len(moe) * c.num_experts * expert,
      norms=layers * _layer_norm_params(c) + c.hidden_size)


def head_param_counts(head: HeadConfig) -> dict[str, int]:
  """The draft head's own parameters by group (it borrows the target's embedding, and its LM
  head unless it has a draft vocabulary: then its own K rows, and their K target ids)."""
  c = head.layer_config()
  return dict(
      fc=head.num_taps * head.hidden_size * head.hidden_size,
      layers=head.num_layers * (_attention_params(c) + 3 * c.hidden_size * c.intermediate_size),
      norms=head.num_layers * _layer_norm_params(c) + 2 * head.hidden_size,  # + hidden, final
      draft_vocab=head.draft_vocab_size * (head.hidden_size + 1))


def _kv_row_bytes(c, layers: int, itemsize: int) -> int:
  """K and V of one token in every layer."""
  return layers * 2 * c.num_key_value_heads * c.head_dim * itemsize


def _attention_flops(c, layers: int, queries: float, keys: float) -> float:
  """QK^T and PV: 2 multiply-adds per (query, key, head, head-dim) element."""
  return 4.0 * layers * queries * keys * c.num_attention_heads * c.head_dim


def expected_experts(num_experts: int, per_token: int, tokens: float) -> float:
  """Distinct experts `tokens` tokens touch when each picks `per_token` of `num_experts` at
  random (balanced routing): E (1 - (1 - k/E)^tokens)."""
  return num_experts * (1.0 - (1.0 - per_token / num_experts) ** tokens)


def _itemsize(dtype: Any) -> int:
  return np.dtype(dtype).itemsize


# --- pieces ---

def target_forward(config: Qwen3Config, dtype: Any, batch: int, tokens: int, cached: int) -> Cost:
  """`tokens` new rows per row through the target and its LM head (logits at every row), each
  row reading `cached` cache rows and storing its new rows' K/V; queries span cached + tokens
  keys (a causal or tree mask over the new rows is computed in full)."""
  c, size = config, _itemsize(dtype)
  counts = target_param_counts(c)
  rows = batch * tokens
  moe_layers = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
  expert = 3 * c.hidden_size * c.moe_intermediate_size
  touched = (moe_layers * expected_experts(c.num_experts, c.num_experts_per_tok, rows) * expert
             if moe_layers else 0.0)
  lm_head = c.vocab_size * c.hidden_size  # the untied head, or the tied table read whole
  gathered = 0 if c.tie_word_embeddings else rows * c.hidden_size  # embedding rows
  weights = (counts["attention"] + counts["dense_mlp"] + counts["router"] + counts["norms"]
             + lm_head + gathered) * size + touched * size
  active = counts["attention"] + counts["dense_mlp"] + counts["router"] + lm_head + (
      moe_layers * c.num_experts_per_tok * expert)
  kv_row = _kv_row_bytes(c, c.num_hidden_layers, size)
  return Cost(weight_bytes=weights, cache_bytes=batch * (cached + tokens) * kv_row,
              matmul_flops=2.0 * rows * active,
              attention_flops=_attention_flops(c, c.num_hidden_layers, rows, cached + tokens),
              rows=rows)


def ar_step(config: Qwen3Config, dtype: Any, batch: int, committed: int) -> Cost:
  """One AR step: the anchor of each row through the target over its committed cache."""
  return target_forward(config, dtype, batch, 1, committed - 1)


def verify(config: Qwen3Config, dtype: Any, batch: int, committed: int, nodes: int) -> Cost:
  """The target over an N-node tree per row, after its committed cache."""
  return target_forward(config, dtype, batch, nodes, committed - 1)


def head_forward(config: Qwen3Config, head: HeadConfig, dtype: Any, batch: int,
                 committed: int) -> Cost:
  """`HeadDrafter.draft`: the block `[anchor, MASK...]` (embedded by the target's table) through
  the head's layers, reading its own context K/V of S - 1 rows (nothing written), then the
  target's LM head over the `depth` drafted rows (with a draft vocabulary, the head's own
  `[D, K]` one: K columns read and multiplied instead of V)."""
  size, block, rows = _itemsize(dtype), head.block_size, batch * head.block_size
  counts, layer = head_param_counts(head), head.layer_config()
  lm_head = (head.draft_vocab_size or config.vocab_size) * config.hidden_size
  gathered = 0 if config.tie_word_embeddings else rows * head.hidden_size
  weights = counts["layers"] + head.num_layers * _layer_norm_params(layer) + head.hidden_size
  cached = committed - 1
  return Cost(weight_bytes=(weights + lm_head + gathered) * size,
              cache_bytes=batch * cached * _kv_row_bytes(layer, head.num_layers, size),
              matmul_flops=2.0 * (rows * counts["layers"] + batch * head.depth * lm_head),
              attention_flops=_attention_flops(layer, head.num_layers, rows, cached + block),
              rows=rows)


def commit(config: Qwen3Config, head: HeadConfig, dtype: Any, batch: int) -> Cost:
  """A drafting round's commit of its `depth + 1` path rows (the round's fixed shape, junk past
  what was accepted): the target's path K/V moved into the cache (read and written), and the
  head's context K/V of those rows made (`fc`, `hidden_norm`, each layer's k/v projection and
  k norm) and written."""
  size, rows = _itemsize(dtype), batch * (head.depth + 1)
  layer = head.layer_config()
  kv_proj = 2 * head.hidden_size * layer.num_key_value_heads * layer.head_dim
  fc = head_param_counts(head)["fc"]
  weights = fc + head.hidden_size + head.num_layers * (kv_proj + layer.head_dim)
  cache = rows * (2 * _kv_row_bytes(config, config.num_hidden_layers, size)
                  + _kv_row_bytes(layer, head.num_layers, size))
  return Cost(weight_bytes=weights * size, cache_bytes=cache,
              matmul_flops=2.0 * rows * (fc + head.num_layers * kv_proj), rows=rows)


def round_cost(config: Qwen3Config, head: HeadConfig, dtype: Any, batch: int, committed: int,
               nodes: int) -> Cost:
  """A drafting round at budget N: head forward, then verify, then commit (tree building and
  acceptance move only activations)."""
  return (head_forward(config, head, dtype, batch, committed)
          .then(verify(config, dtype, batch, committed, nodes))
          .then(commit(config, head, dtype, batch)))


def pieces(config: Qwen3Config, head: HeadConfig, dtype: Any, batch: int, committed: int,
           budgets) -> dict[str, Cost]:
  """Every piece of `bench/step_costs.py` (names without the attention impl)."""
  out = {"ar_step": ar_step(config, dtype, batch, committed),
         "head": head_forward(config, head, dtype, batch, committed)}
  out.update({f"verify/{n}": verify(config, dtype, batch, committed, n) for n in budgets})
  out.update({f"round/{n}": round_cost(config, head, dtype, batch, committed, n)
              for n in budgets})
  return out


def summary(cost: Cost, device: Device | None) -> dict:
  """A JSON record of `cost`, with its floor on `device` (None when the device is unknown)."""
  record = dict(bytes=cost.bytes, weight_bytes=cost.weight_bytes, cache_bytes=cost.cache_bytes,
                flops=cost.flops, attention_flops=cost.attention_flops, floor_ms=None,
                bound=None)
  if device is not None:
    record.update(floor_ms=1e3 * floor_seconds(cost, device), bound=bound(cost, device))
  return record
