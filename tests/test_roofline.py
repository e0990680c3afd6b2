"""roofline: counts checked against the repo's own param shapes and XLA's FLOP count."""

import dataclasses
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT
from jetflow_jax import roofline
from jetflow_jax.config import Qwen3Config
from jetflow_jax.head import DraftHead, init_head_cache, init_head_params
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.model import KVCache, abstract_params, forward, lm_logits

DENSE = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64)
TIED = dataclasses.replace(DENSE, tie_word_embeddings=True)
MOE = dataclasses.replace(DENSE, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=128, mlp_only_layers=(0,))
HEAD = HeadConfig.for_target(DENSE, num_layers=2, target_layer_ids=(1, 2), block_size=8,
                             mask_token_id=511)
# XLA also counts elementwise work (norms, RoPE, softmax, SiLU: ~1 FLOP per element op) that the
# roofline leaves out; at width 256 it is 0.6% of the matmuls. 2% holds that with room, and still
# catches any missing or doubled matmul (the smallest, k_proj, is 4% of a layer's).
XLA_TOLERANCE = 0.02


def tree_bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def tree_size(tree) -> int:
  return sum(x.size for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("kind, name", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H200", "H200"), ("NVIDIA B200", "B200"),
    ("TPU v5 lite", "TPU v5e"), ("TPU v5e", "TPU v5e"), ("TPU v5", "TPU v5p"),
    ("TPU v5p", "TPU v5p"), ("TPU v6 lite", "TPU v6e"), ("TPU v6e", "TPU v6e")])
def test_device_kinds_match_their_entries(kind, name):
  assert roofline.device_for(kind) is roofline.DEVICES[name]


@pytest.mark.parametrize("kind", ["cpu", "TFRT_CPU_0", "NVIDIA H100 PCIe", "NVIDIA H100 NVL",
                                  "NVIDIA GH200 480GB", "NVIDIA A100-SXM4-80GB", "TPU v4", ""])
def test_unknown_devices_have_no_entry_and_no_floor(kind):
  assert roofline.device_for(kind) is None
  record = roofline.summary(roofline.ar_step(DENSE, jnp.float32, 1, 64), None)
  assert record["floor_ms"] is None and record["bound"] is None and record["bytes"] > 0


def test_floor_is_the_slower_of_memory_and_compute():
  h200 = roofline.DEVICES["H200"]
  memory = roofline.Cost(weight_bytes=4.8e9, matmul_flops=1e9)  # 1 ms of bytes, 1 us of FLOPs
  compute = roofline.Cost(weight_bytes=1.0, matmul_flops=2 * 989e9)  # 2 ms of FLOPs
  assert math.isclose(roofline.floor_seconds(memory, h200), 1e-3)
  assert math.isclose(roofline.floor_seconds(compute, h200), 2e-3)
  assert roofline.bound(memory, h200) == "memory" and roofline.bound(compute, h200) == "compute"
  # In sequence, neither hides under the other: the floors add.
  both = memory.then(compute)
  assert both.bytes == memory.bytes + compute.bytes and both.flops == memory.flops + compute.flops
  assert math.isclose(roofline.summary(both, h200)["floor_ms"], 3.0)
  assert roofline.bound(both, h200) == "memory+compute"


@pytest.mark.parametrize("config", [DENSE, TIED, MOE], ids=["dense", "tied", "moe"])
def test_param_counts_match_the_init_shapes(config):
  counts = roofline.target_param_counts(config)
  params = abstract_params(config, jnp.bfloat16)
  assert sum(counts.values()) == tree_size(params)
  assert counts["embedding"] == params["embed_tokens"]["embedding"].size
  if config.is_moe:
    assert counts["experts"] == tree_size(params["layers_1"]["mlp"]["experts"]) * 2
  for draft_vocab in (0, 100):  # a draft vocabulary: its LM head's rows and their target ids
    head = HeadConfig.for_target(config, num_layers=2, target_layer_ids=(1,), mask_token_id=511,
                                 draft_vocab_size=draft_vocab)
    head_params = jax.eval_shape(lambda: init_head_params(head, jax.random.key(0)))
    assert sum(roofline.head_param_counts(head).values()) == tree_size(head_params)


@pytest.mark.parametrize("config", [DENSE, TIED], ids=["untied", "tied"])
def test_ar_step_reads_the_weights_and_its_cache_once(config):
  batch, committed, dtype = 3, 50, jnp.bfloat16
  cost = roofline.ar_step(config, dtype, batch, committed)
  params = abstract_params(config, dtype)
  table = params["embed_tokens"]["embedding"]
  # Every weight but the embedding table, which is read whole only as the tied LM head.
  expected = tree_bytes(params) if config.tie_word_embeddings else (
      tree_bytes(params) - table.size * 2 + batch * config.hidden_size * 2)
  assert cost.weight_bytes == expected
  # S - 1 cached rows read and the anchor's row written: a cache of S slots per row.
  cache = jax.eval_shape(lambda: KVCache.zeros(config, batch, committed, dtype))
  assert cost.cache_bytes == tree_bytes(cache)


def test_moe_bytes_count_the_experts_a_batch_touches():
  expert_bytes = 3 * MOE.hidden_size * MOE.moe_intermediate_size * 4 * 2  # float32, 2 MoE layers
  one = roofline.ar_step(MOE, jnp.float32, 1, 8)
  many = roofline.ar_step(MOE, jnp.float32, 4096, 8)
  dense_part = one.weight_bytes - MOE.num_experts_per_tok * expert_bytes
  gathered = (4096 - 1) * MOE.hidden_size * 4
  assert math.isclose(many.weight_bytes - dense_part - gathered, MOE.num_experts * expert_bytes)
  assert roofline.expected_experts(128, 8, 1) == pytest.approx(8)
  assert 8 < roofline.expected_experts(128, 8, 8) < 64 < roofline.expected_experts(128, 8, 64)
  # FLOPs follow the active experts only, whatever the batch.
  assert many.matmul_flops == 4096 * one.matmul_flops


def test_head_and_round_pieces():
  batch, committed, dtype = 2, 100, jnp.bfloat16
  head = roofline.head_forward(DENSE, HEAD, dtype, batch, committed)
  context = jax.eval_shape(lambda: init_head_cache(HEAD, batch, committed - 1, dtype))
  assert head.cache_bytes == tree_bytes(context)  # the head's context read, nothing written
  head_params = jax.eval_shape(lambda: init_head_params(HEAD, jax.random.key(0), dtype))
  lm_head = abstract_params(DENSE, dtype)["lm_head"]
  own = tree_bytes(head_params) - tree_bytes((head_params["fc"], head_params["hidden_norm"]))
  assert head.weight_bytes == own + tree_bytes(lm_head) + batch * HEAD.block_size * 256 * 2
  total = roofline.round_cost(DENSE, HEAD, dtype, batch, committed, 32)
  parts = (head, roofline.verify(DENSE, dtype, batch, committed, 32),
           roofline.commit(DENSE, HEAD, dtype, batch))
  assert total.stages == parts
  assert total.bytes == sum(p.bytes for p in parts) and total.flops == sum(p.flops for p in parts)
  names = roofline.pieces(DENSE, HEAD, dtype, batch, committed, (16, 32))
  assert list(names) == ["ar_step", "head", "verify/16", "verify/32", "round/16", "round/32"]
  assert names["verify/32"].flops > names["verify/16"].flops > names["ar_step"].flops


def xla_flops(fn, *args) -> float:
  return jax.jit(fn).lower(*args).cost_analysis()["flops"]


def test_target_flops_match_xla():
  """A cache-less forward of T rows (causal attention over all T keys, as the roofline counts
  a new block or tree) plus logits at every row."""
  batch, tokens = 2, 16

  def run(params, tokens_bt):
    hidden, _, _ = forward(params, DENSE, tokens_bt)
    return lm_logits(params, DENSE, hidden)

  xla = xla_flops(run, abstract_params(DENSE), jax.ShapeDtypeStruct((batch, tokens), jnp.int32))
  ours = roofline.target_forward(DENSE, jnp.float32, batch, tokens, cached=0).flops
  assert abs(xla / ours - 1) < XLA_TOLERANCE, (xla, ours)


def test_moe_flops_match_xla_once_its_ragged_dot_count_is_undone():
  """XLA counts a `ragged_dot` as every routed row against every expert (E times the work each
  row does), so its count is the roofline's plus (E - 1) times the experts' share: that checks
  the expert, router and dense-layer shapes; the roofline's own count is the true one."""
  batch, tokens = 2, 16

  def run(params, tokens_bt):
    hidden, _, _ = forward(params, MOE, tokens_bt)
    return lm_logits(params, MOE, hidden)

  xla = xla_flops(run, abstract_params(MOE), jax.ShapeDtypeStruct((batch, tokens), jnp.int32))
  ours = roofline.target_forward(MOE, jnp.float32, batch, tokens, cached=0).flops
  moe_layers = MOE.num_hidden_layers - len(MOE.mlp_only_layers)
  experts = (2.0 * batch * tokens * MOE.num_experts_per_tok * moe_layers
             * 3 * MOE.hidden_size * MOE.moe_intermediate_size)
  ours_as_xla = ours + (MOE.num_experts - 1) * experts
  assert abs(xla / ours_as_xla - 1) < XLA_TOLERANCE, (xla, ours_as_xla)


def test_head_flops_match_xla():
  """The head's layers over its block, reading S - 1 context rows, through a plain mask (one
  dense einsum over the keys, which XLA counts exactly; the tree kernels' length-bounded loops
  it cannot), then the LM head over the drafted rows."""
  batch, committed, block = 2, 40, HEAD.block_size

  def run(head_params, target_params, cache, x_btd):
    positions = jnp.broadcast_to(committed - 1 + jnp.arange(block), (batch, block))
    mask = jnp.ones((batch, block, committed - 1 + block), bool)
    hidden = DraftHead(HEAD).apply({"params": head_params}, x_btd, positions, cache,
                                   jnp.full((batch,), committed - 1), mask)
    return lm_logits(target_params, DENSE, hidden[:, 1:])

  xla = xla_flops(run, jax.eval_shape(lambda: init_head_params(HEAD, jax.random.key(0))),
                  abstract_params(DENSE),
                  jax.eval_shape(lambda: init_head_cache(HEAD, batch, committed - 1 + block,
                                                         jnp.float32)),
                  jax.ShapeDtypeStruct((batch, block, HEAD.hidden_size), jnp.float32))
  ours = roofline.head_forward(DENSE, HEAD, jnp.float32, batch, committed).flops
  assert abs(xla / ours - 1) < XLA_TOLERANCE, (xla, ours)


def test_qwen3_8b_floors_on_h200():
  """The scale facts: an AR step reads ~15.7 GB (memory-bound, ~3.3 ms); 256 verify nodes are
  compute-bound."""
  config = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                       num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128)
  head = HeadConfig.for_target(config, num_layers=5, target_layer_ids=(1, 9, 17, 25, 33))
  h200 = roofline.device_for("NVIDIA H200")
  ar = roofline.ar_step(config, jnp.bfloat16, 1, 4096)
  assert np.isclose(ar.bytes, 15.74e9, rtol=1e-3)
  assert np.isclose(roofline.floor_seconds(ar, h200), 3.28e-3, rtol=1e-2)
  wide = roofline.verify(config, jnp.bfloat16, 1, 4096, 256)
  assert roofline.bound(wide, h200) == "compute" and roofline.bound(ar, h200) == "memory"
  draft = roofline.head_forward(config, head, jnp.bfloat16, 1, 4096)
  assert np.isclose(draft.bytes, 3.26e9, rtol=1e-2) and roofline.bound(draft, h200) == "memory"
  # A 32,000-token draft vocabulary reads that many LM-head columns instead of 151,936.
  small = roofline.head_forward(config, dataclasses.replace(head, draft_vocab_size=32000),
                                jnp.bfloat16, 1, 4096)
  assert draft.weight_bytes - small.weight_bytes == (151936 - 32000) * 4096 * 2
  # The round's floor adds the memory-bound head to the compute-bound verify.
  whole = roofline.round_cost(config, head, jnp.bfloat16, 1, 4096, 256)
  assert roofline.floor_seconds(whole, h200) > roofline.floor_seconds(draft, h200) + (
      roofline.floor_seconds(wide, h200))
  assert roofline.bound(whole, h200) == "memory+compute+memory"


def test_step_costs_floor_only_writes_every_device_batch_and_length(tmp_path, capsys):
  """`bench/step_costs.py --floor-only`, in process: runs nothing, so no GPU is needed."""
  sys.path.insert(0, os.path.join(ROOT, "bench"))
  try:
    import step_costs  # noqa: PLC0415  (bench/ is not a package)
  finally:
    sys.path.remove(os.path.join(ROOT, "bench"))
  out = tmp_path / "floor.json"
  step_costs.main(["--preset", "qwen3-8b", "--floor-only", "--device-kind",
                   "NVIDIA H200,NVIDIA B200", "--batch", "1,8", "--lengths", "4096",
                   "--budgets", "64,256", "--out", str(out)])
  printed = capsys.readouterr().out
  assert "| ar_step | 15.741 |" in printed and "NVIDIA B200 (B200: 8 TB/s" in printed
  record = json.loads(out.read_text())
  assert list(record["devices"]) == ["NVIDIA H200", "NVIDIA B200"]
  h200 = record["devices"]["NVIDIA H200"]["batches"]
  assert list(h200) == ["1", "8"] and list(h200["1"]) == ["4096"]
  pieces = h200["1"]["4096"]
  assert list(pieces) == ["ar_step", "head", "verify/64", "verify/256", "round/64", "round/256"]
  assert pieces["verify/256"]["bound"] == "compute" and pieces["ar_step"]["bound"] == "memory"
  b200 = record["devices"]["NVIDIA B200"]["batches"]["1"]["4096"]
  assert b200["ar_step"]["floor_ms"] < pieces["ar_step"]["floor_ms"]


def test_host_device_is_measured_once_and_rated_by_rows(tmp_path, monkeypatch):
  monkeypatch.setenv(roofline.HOST_ROOFLINE_ENV, str(tmp_path / "host.json"))
  measured, measure = [], roofline.measure_host
  small = lambda: measured.append(1) or measure(matrix_bytes=1 << 22, width=256, repeats=1)
  monkeypatch.setattr(roofline, "measure_host", small)
  host = roofline.host_device()
  assert roofline.host_device() == host and measured == [1]  # the second read from the file
  rows = [r for r, _ in host.flops_by_rows]
  assert rows == list(roofline.HOST_ROWS) and host.hbm_bytes_per_s > 0
  assert host.flops_per_s == max(f for _, f in host.flops_by_rows)
  # Between measured row counts the rate is interpolated; outside, the nearest one's.
  fake = roofline.Device("cpu", 1e10, 4e10, ((1, 1e9), (16, 1e10), (256, 4e10)))
  for rows, rate in ((1, 1e9), (1000, 4e10), (0.5, 1e9)):
    assert math.isclose(fake.flops_at(rows), rate)
  assert math.isclose(fake.flops_at(4), 10 ** 9.5)  # halfway in log-log
  # A CPU floor takes the rate at the piece's rows: 16 rows of 1.6e10 FLOPs and few bytes.
  piece = roofline.Cost(weight_bytes=1.0, matmul_flops=1.6e10, rows=16)
  assert math.isclose(roofline.floor_seconds(piece, fake), 1.6)
  assert roofline.bound(piece, fake) == "compute"
