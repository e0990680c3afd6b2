"""The train step's activations split their rows over data x fsdp, checked on what XLA compiled.

A mesh of 8 fake CPU devices with one row each must hold about what one device holds for one
row: if any activation kept the global batch on every device (the sharding vocabulary once
left the head's embedding lookup split along its width, and XLA then carried all 8 rows
through the head on each device: 57 -> 110 GiB at Qwen3-8B shapes), per-device temporaries
grow with the batch. Compiled ahead of time on abstract shapes, dense and MoE targets, in one
subprocess (the suite's process has 4 devices).
"""

import json

import jax
import numpy as np
import pytest

from conftest import run_cli
from jetflow_jax.config import Qwen3Config
from jetflow_jax.model import forward, forward_by_layer, init_params
from jetflow_jax.train.sharding import activation_layout, make_mesh, param_sharding

PROBE = r"""
import json
import jax
from configs import tiny
from jetflow_jax.train import memory_report

jax.config.update("jax_num_cpu_devices", 8)
jax.devices()  # up with 8: the meshes of 1 and 8 devices take the first of them

def temporaries(devices, moe):
  c = tiny.get_config()
  c.target.random.update(vocab_size=512, num_hidden_layers=2)
  if moe:
    c.target.random.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                           norm_topk_prob=True)
  c.head.update(mask_token_id=511, target_layer_ids=(0,), num_layers=1)
  c.data.seq_len, c.train.num_anchors = 128, 16
  c.mesh.fsdp, c.train.batch_size = devices, devices  # one row per device
  report = memory_report.memory_report(c, limit=1)
  return report["per_device_bytes"]["temporaries"]

print(json.dumps({kind: [temporaries(n, kind == "moe") for n in (1, 8)]
                  for kind in ("dense", "moe")}))
"""


def test_rows_split_over_the_mesh_in_the_compiled_step():
  done = run_cli("-c", PROBE, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  temporaries = json.loads(done.stdout.strip().splitlines()[-1])
  for kind, (one, eight) in temporaries.items():
    # 8 rows held whole would be ~8x; one row a device leaves gathered weights and the
    # vocabulary-split logits' bookkeeping on top (measured 1.1x).
    assert eight <= 1.3 * one, (kind, one, eight)


@pytest.mark.parametrize("moe", [False, True])
def test_forward_by_layer_equals_forward_sharded_or_not(moe):
  """The train step's target pass, its runs of layers as loops (of 6 layers, runs 0-1, 2-4 and
  5, cut at taps 1 and 4; the MoE target's dense layer 2 runs alone), split over a 4-device
  fsdp mesh with the train step's layout, against the unrolled `forward` on one device."""
  config = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1e4,
                       **(dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                               mlp_only_layers=(2,)) if moe else {}))
  params = init_params(config, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (4, 24), 0, 128)
  taps = (1, 4)
  hidden, _, want_taps = jax.jit(lambda p, t: forward(p, config, t, tap_layers=taps,
                                                      experts="blocked"))(params, tokens)
  mesh = make_mesh(1, 4, devices=jax.devices()[:4])
  placed = jax.device_put(params, param_sharding(mesh, params))
  layout = activation_layout(mesh)
  got_hidden, got_taps = jax.jit(lambda p, t: forward_by_layer(
      p, config, t, tap_layers=taps, experts="blocked", layout=layout))(placed, tokens)
  np.testing.assert_allclose(got_hidden, hidden, atol=2e-5, rtol=0)
  np.testing.assert_allclose(got_taps, want_taps, atol=2e-5, rtol=0)
