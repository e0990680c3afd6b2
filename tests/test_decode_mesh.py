"""Decoding over a device mesh (data, tp, ep): greedy output equals one device's token for token
for every method, dense and MoE, batch > 1, on pytest's 4 fake CPU devices and on 8 in a
subprocess; the target loads from sharded safetensors straight onto the mesh, each block read
once; meshes, axes and attention kernels that cannot be had are refused in one `error:` line.

One device's greedy output of every method is its AR output (tests/test_speculative.py), so each
mesh run is compared with the single-device AR tokens: one reference compile per target.
"""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetflow_jax
from conftest import CLI_ENV, ROOT, make_hf_model
from jetflow_jax import hf_params
from jetflow_jax.decoding import METHODS, TreeShape, decode_prompts, generate, loop
from jetflow_jax.decoding.round import RoundSpec
from jetflow_jax.decoding.state import default_cache_size
from jetflow_jax.drafters import NoDrafter
from jetflow_jax.engine import Orchestrator, Request, make_engine
from jetflow_jax.errors import InputError
from jetflow_jax.head import init_head_params
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.kernels.tree_attention import attention_for_backend
from jetflow_jax.mesh import DecodeMesh, parse_mesh
from jetflow_jax.model import abstract_params
from jetflow_jax.partitioning import abstract
from jetflow_jax.sampling import Greedy
from test_speculative import CheatingDrafter

# Two layers keep each compile short; 8 experts split over ep=2 and ep=4, 4 heads over tp=4,
# and 2 kv heads are fewer than tp=4 (the KV cache then stays whole on every tp device).
LAYERS = 2
TARGETS = {"dense": dict(moe=False), "moe": dict(moe=True, num_experts=8)}
PROMPTS = [[5, 17, 3, 88, 40], [9, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11], [60, 61, 62],
           [33, 34, 35, 36, 37, 38, 39]]
NEW_TOKENS = 10
BLOCK_SIZE = 5


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
  """Per kind: (sharded HF directory, config, params loaded plainly on one device, AR tokens)."""
  out = {}
  for kind, fields in TARGETS.items():
    directory = str(tmp_path_factory.mktemp(kind))
    make_hf_model(num_hidden_layers=LAYERS, **fields).save_pretrained(directory,
                                                                      max_shard_size="40KB")
    config, params = jetflow_jax.load_qwen3(directory)
    reference = generate(params, config, PROMPTS, NEW_TOKENS, stop_tokens=()).tokens
    out[kind] = (directory, config, params, reference)
  return out


def head_for(config, causal: bool):
  """A random head: losslessness must hold for any drafter, however poor."""
  head = HeadConfig.for_target(config, num_layers=1, block_size=BLOCK_SIZE,
                               mask_token_id=config.vocab_size - 1, causal=causal,
                               target_layer_ids=(0,))
  return head, init_head_params(head, jax.random.key(1))


def load_on(directory, mesh):
  return jetflow_jax.load_qwen3(directory, shardings=mesh.param_shardings)[1]


@pytest.mark.parametrize("kind,axes", [("dense", dict(tp=4)), ("moe", dict(tp=2, ep=2))],
                         ids=["dense-tp4", "moe-tp2-ep2"])
def test_load_onto_the_mesh_reads_each_held_block_once(targets, monkeypatch, kind, axes):
  directory, config, params, _ = targets[kind]
  assert os.path.isfile(os.path.join(directory, "model.safetensors.index.json"))
  reads = []
  original = hf_params.SafetensorsDir.get_slice
  def counting(self, key, index):
    block = original(self, key, index)
    reads.append((key, block.size))
    return block
  monkeypatch.setattr(hf_params.SafetensorsDir, "get_slice", counting)
  mesh = DecodeMesh.create(**axes)
  placed = load_on(directory, mesh)

  want = mesh.param_shardings(config, abstract_params(config))
  jax.tree.map(lambda g, s: (g.sharding == s) or pytest.fail(f"{g.sharding} != {s}"), placed, want)
  jax.tree.map(lambda g, w: np.testing.assert_array_equal(np.asarray(g), np.asarray(w)), placed,
               params)
  # Each HF read is one device's block of one tensor (for stacked experts, one expert's part of
  # it), and the blocks of a leaf are read once however many devices hold them: all together
  # exactly the checkpoint, the heads (and experts' columns) in tp pieces.
  tensors = {t.hf_key: t for t in hf_params.qwen3_tensors(config)}
  for key, size in reads:
    t = tensors[key]
    block = at(want, t.path).shard_shape(at(params, t.path).shape)
    assert size == np.prod(block[1:] if t.expert is not None else block), key
  assert sum(size for _, size in reads) == sum(x.size for x in jax.tree.leaves(params))
  keys = [key for key, _ in reads]
  assert keys.count("model.layers.0.self_attn.q_proj.weight") == mesh.size("tp")
  if config.is_moe:
    assert keys.count("model.layers.0.mlp.experts.0.gate_proj.weight") == mesh.size("tp")


def at(tree, path):
  for name in path:
    tree = tree[name]
  return tree


# Every method on a dense target over tp=4 (more than its 2 kv heads: each device keeps the
# whole KV cache) and on an MoE target over ep=4 (2 of its 8 experts on each device).
CASES = [("dense", dict(tp=4), m) for m in METHODS] + [
    ("moe", dict(ep=4), m) for m in METHODS]


@pytest.mark.parametrize("kind,axes,method", CASES,
                         ids=[f"{k}-{','.join(f'{a}={n}' for a, n in x.items())}-{m}"
                              for k, x, m in CASES])
def test_greedy_over_the_mesh_equals_one_device(targets, kind, axes, method):
  directory, config, _, reference = targets[kind]
  mesh = DecodeMesh.create(**axes)
  mesh.check(config)
  head, head_params = head_for(config, causal=method == "jetflow")
  result = jetflow_jax.speculative_generate(
      load_on(directory, mesh), config, head_params, head, PROMPTS, NEW_TOKENS, method=method,
      budget=8, top_k=3, stop_tokens=(), warn=lambda _: None, mesh=mesh)
  assert result.tokens == reference
  assert result.stop_reasons == ["max_tokens"] * len(PROMPTS)
  assert [sum(r) for r in result.committed_per_round] == [NEW_TOKENS - 1] * len(PROMPTS)
  if method == "ar":
    cache_size = default_cache_size(config, PROMPTS, NEW_TOKENS)
    assert ar_cache_blocks(config, mesh, len(PROMPTS), cache_size) == {
        (len(PROMPTS), cache_size, config.num_key_value_heads, config.head_dim)}


def test_engine_over_a_data_and_ep_mesh_equals_one_device(targets):
  """The engine with slots over 2 data-parallel copies of an MoE target, each copy's experts
  over ep=2: one-request prefills run whole on both copies, rounds split the slots."""
  directory, config, _, reference = targets["moe"]
  mesh = DecodeMesh.create(data=2, ep=2)
  head, head_params = head_for(config, causal=True)
  engine = make_engine(load_on(directory, mesh), config, head_params, head, method="jetflow",
                       budget=8, top_k=3, num_slots=2, max_context=32, rounds_per_step=2,
                       mesh=mesh, warn=lambda _: None)
  streams = Orchestrator(engine).generate(
      [Request(p, NEW_TOKENS, stop_tokens=()) for p in PROMPTS])
  assert [s.tokens for s in streams] == reference
  assert engine.init_state().rows.cache.k[0].sharding.is_equivalent_to(
      mesh.cache_sharding(config), 4)


def ar_cache_blocks(config, mesh, batch, cache_size) -> set:
  """Each device's block of the KV cache buffers the AR loop that just ran over `mesh` returned
  (read off its compiled executable: prompts of up to 16 tokens, no stop tokens)."""
  params = abstract_params(config)
  params = abstract(params, mesh.param_shardings(config, params))
  rows = loop.batch_rows([[1]] * batch, 1, cache_size, Greedy(), 0, ())
  spec = RoundSpec(config, NoDrafter(), TreeShape("root"), sampled=False, filtered=False,
                   mesh=mesh)
  hits = loop.compiled.hits
  _, decode = loop.compile_decode(params, None, rows, spec, cache_size)
  assert loop.compiled.hits == hits + 2  # the executables that ran, not new ones
  shape = (batch, cache_size, config.num_key_value_heads, config.head_dim)
  cache = decode.output_shardings.cache
  return {sharding.shard_shape(shape) for sharding in cache.k + cache.v}


def test_whole_paths_committed_over_a_data_and_tp_mesh(targets):
  """A drafter proposing the known continuation: every round commits a whole path, so many K/V
  rows a round go into the cache split over data and tp."""
  directory, config, _, reference = targets["dense"]
  mesh = DecodeMesh.create(data=2, tp=2)
  known = np.zeros((len(PROMPTS), 32), np.int32)
  for b, (p, r) in enumerate(zip(PROMPTS, reference)):
    known[b, :len(p) + len(r)] = p + r
  result = decode_prompts(load_on(directory, mesh), config, CheatingDrafter(depth=4),
                                jnp.asarray(known), PROMPTS, NEW_TOKENS,
                                tree_shape=TreeShape("top_n", 8, 2), stop_tokens=(),
                                mesh=mesh)
  assert result.tokens == reference
  assert result.committed_per_round == [[5, 4]] * len(PROMPTS)  # 9 after the prefill's first


EIGHT_DEVICES = r"""
import json, sys
import jax
import jetflow_jax
from jetflow_jax.head import init_head_params
from jetflow_jax.head_config import HeadConfig
from jetflow_jax.mesh import DecodeMesh

cases, prompts, new_tokens = json.loads(sys.argv[1])
verdict = {"devices": jax.device_count()}
for name, directory, axes, method in cases:
  config, params = jetflow_jax.load_qwen3(directory)
  mesh = DecodeMesh.create(**axes)
  mesh.check(config)
  _, placed = jetflow_jax.load_qwen3(directory, shardings=mesh.param_shardings)
  head = HeadConfig.for_target(config, num_layers=1, block_size=5, target_layer_ids=(0,),
                               mask_token_id=config.vocab_size - 1, causal=method == "jetflow")
  head_params = init_head_params(head, jax.random.key(1))
  result = jetflow_jax.speculative_generate(
      placed, config, head_params, head, prompts, new_tokens, method=method, budget=8, top_k=3,
      stop_tokens=(), mesh=mesh)
  q = placed["layers_0"]["self_attn"]["q_proj"]["kernel"]
  verdict[name] = {"tokens": result.tokens, "mesh_devices": mesh.mesh.size,
                   "q_proj_block": list(q.sharding.shard_shape(q.shape))}
print(json.dumps(verdict))
"""


def test_eight_devices_in_a_subprocess(targets):
  """An MoE target over every axis at once and a dense one over data=2 x tp=4 (tp > kv heads):
  the tokens of this process's single-device AR run (same CPU, same programs)."""
  cases = [("moe", "moe", dict(data=2, tp=2, ep=2), "jetflow"),
           ("dense", "dense", dict(data=2, tp=4), "jetflow")]
  env = dict(CLI_ENV, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
  runs = [(name, targets[kind][0], axes, method) for name, kind, axes, method in cases]
  done = subprocess.run([sys.executable, "-c", EIGHT_DEVICES,
                         json.dumps([runs, PROMPTS, NEW_TOKENS])], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  verdict = json.loads(done.stdout.strip().splitlines()[-1])
  assert verdict["devices"] == 8
  for name, kind, axes, _ in cases:
    got = verdict[name]
    assert got["mesh_devices"] == 8
    assert got["tokens"] == targets[kind][3], name
    config = targets[kind][1]
    assert got["q_proj_block"] == [config.hidden_size, config.num_attention_heads // axes["tp"],
                                   config.head_dim]


def load_decode_cli():
  spec_ = importlib.util.spec_from_file_location("decode_cli", os.path.join(ROOT, "decode.py"))
  module = importlib.util.module_from_spec(spec_)
  spec_.loader.exec_module(module)
  return module


def test_decode_cli_over_a_mesh(targets, capsys):
  """decode.py --mesh: the target checked and loaded onto the mesh, the same tokens, the KV cache
  split over data (rows) and tp (kv heads)."""
  directory, config, _, reference = targets["dense"]
  load_decode_cli().main([
      "--checkpoint", directory, "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--batch-size",
      "2", "--max-new-tokens", str(NEW_TOKENS), "--method", "ar", "--mesh", "data=2,tp=2",
      "--json"])
  out = json.loads(capsys.readouterr().out)
  assert [row["token_ids"] for row in out["rows"]] == [reference[0]] * 2
  assert ar_cache_blocks(config, DecodeMesh.create(data=2, tp=2), 2, 16) == {
      (1, 16, 1, config.head_dim)}


# --- bad input ---------------------------------------------------------------------------------

def decode_error(capsys, checkpoint, *args) -> str:
  """decode.py's one stderr line for bad input, checking it exits 2 and prints nothing else."""
  with pytest.raises(SystemExit) as exit_:
    load_decode_cli().main(["--checkpoint", checkpoint, "--prompt-ids", "1,2,3",
                            "--max-new-tokens", "4", "--json", *args])
  assert exit_.value.code == 2
  out, err = capsys.readouterr()
  lines = err.strip().splitlines()
  assert out == "" and len(lines) == 1 and lines[0].startswith("error: "), err
  return lines[0]


@pytest.mark.parametrize("kind,args,named", [
    ("dense", ["--mesh", "foo=2"], "unknown axis 'foo'"),
    ("dense", ["--mesh", "tp=0"], "tp='0' must be a positive integer"),
    ("dense", ["--mesh", "tp=3"], "tp=3 does not divide the 4 attention heads"),
    ("dense", ["--mesh", "tp=16"], "tp=16 x ep=1 needs 16 devices; 4 are available"),
    ("dense", ["--mesh", "ep=2"], "ep=2 needs an MoE target"),
    ("moe", ["--mesh", "ep=3"], "ep=3 does not divide the 8 experts"),
    ("dense", ["--mesh", "data=2", "--batch-size", "3"], "3 prompts do not split over"),
])
def test_a_mesh_that_does_not_fit_is_one_error_line(targets, capsys, kind, args, named):
  assert named in decode_error(capsys, targets[kind][0], *args)


def test_pallas_without_a_kernel_for_the_backend_is_one_error_line(targets, capsys,
                                                                    monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "METAL")  # CPU's kernel is interpreted
  assert "no Pallas tree kernel for the 'METAL' backend" in decode_error(
      capsys, targets["dense"][0], "--attention", "pallas")


def test_mesh_parsing_and_kernels_by_backend():
  assert parse_mesh("tp=4, ep=2") == {"tp": 4, "ep": 2} and parse_mesh("") == {}
  with pytest.raises(InputError, match="axis tp is given twice"):
    parse_mesh("tp=2,tp=2")
  with pytest.raises(InputError, match="'METAL'"):
    attention_for_backend("pallas", "METAL")
  assert attention_for_backend("pallas", "cpu") == "pallas"  # interpreted
  assert attention_for_backend("pallas", "tpu") == "pallas_tpu"
  assert attention_for_backend("xla", "metal") == "xla"
