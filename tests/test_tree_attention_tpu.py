"""Mosaic (Pallas TPU) tree-verify attention: the TPU interpreter vs the XLA reference on random
trees, garbage past cache_len, and lowering for TPU at Qwen3-8B shapes on this CPU-only host."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jetflow_jax.kernels import tree_attention
from jetflow_jax.kernels.tree_attention import pallas_impl
from conftest import run_cli
from test_tree_attention import brute_force, make_case, run

MOSAIC_CALL = "tpu_custom_call"
TPU_INTERPRET = pltpu.InterpretParams(random_seed=0)

# MQA and GQA; H = 128 (one kv head per block) and 64 (two kv heads share a block's 128 lanes, or
# one head's 64 lanes are the whole array); tree sizes 1, 5, 16, 37; S a multiple of block_kv,
# ragged, and below one block; cache lengths 0, S and partial, on and next to block edges.
CASES = [
    dict(t=1, s=300, n=4, k=1, h=128),
    dict(t=5, s=256, n=8, k=2, h=64, cache_len=[0, 128, 129]),
    dict(t=37, s=200, n=4, k=4, h=64),
    dict(t=5, s=150, n=4, k=1, h=64, cache_len=[127, 150, 1]),
    dict(t=16, s=40, n=8, k=2, h=128),
]


def case_id(cfg):
  return "-".join(f"{k}{v}" for k, v in cfg.items() if k != "cache_len")


GARBAGE_CASE = dict(b=3, t=7, s=300, n=8, k=2, h=64, cache_len=[0, 130, 256])
# (seed, make_case arguments) of the runs through Pallas' HLO interpreter and in bfloat16.
HLO_INTERPRETER_CASE = (4, dict(b=2, t=9, s=700, n=8, k=2, h=128))
BFLOAT16_CASE = (2, dict(b=2, t=16, s=200, n=8, k=2, h=128, dtype=jnp.bfloat16))


def garbage_cases():
  """The garbage case clean, then with NaN / inf in every cache slot past each row's cache_len."""
  case = make_case(3, **GARBAGE_CASE)
  yield "clean", case
  slot_bs = jnp.arange(GARBAGE_CASE["s"])[None, :]
  stale_bs11 = (slot_bs >= case["cache_len"][:, None])[..., None, None]
  for garbage in (np.nan, np.inf):
    case = dict(case)
    for name in ("k_cache", "v_cache"):
      case[name] = jnp.where(stale_bs11, garbage, case[name])
    yield str(garbage), case


def interpret_all(path: str) -> None:
  """Every interpreted run of this file, saved to `path` (npz) for the suite to check.

  The TPU interpreter runs the kernel through host callbacks on threads of its own. In the
  suite's long-lived workers it twice aborted the worker (SIGABRT, at the same case, after
  hundreds of other tests; never alone, nor in 40 repeats of that case in two processes at
  once), so its runs happen here, in a fresh process whose crash report the test shows whole.
  """
  kwargs = dict(impl="pallas_tpu", interpret=TPU_INTERPRET, block_kv=128)
  outs = {case_id(cfg): run(make_case(1, b=3, **cfg), **kwargs) for cfg in CASES}
  outs["interpret_true"] = run(make_case(HLO_INTERPRETER_CASE[0], **HLO_INTERPRETER_CASE[1]),
                               impl="pallas_tpu", interpret=True)
  outs["bfloat16"] = run(make_case(BFLOAT16_CASE[0], **BFLOAT16_CASE[1]), **kwargs)
  outs.update((f"garbage_{name}", run(case, **kwargs)) for name, case in garbage_cases())
  np.savez(path, **outs)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, np.ndarray]:
  path = tmp_path_factory.mktemp("tpu_interpret") / "outputs.npz"
  script = ("import sys; sys.path.insert(0, 'tests'); import conftest, test_tree_attention_tpu; "
            "test_tree_attention_tpu.interpret_all(sys.argv[1])")
  proc = run_cli("-X", "faulthandler", "-c", script, str(path))
  output = f"{proc.stdout[-2000:]}\n{proc.stderr[-8000:]}"
  assert proc.returncode == 0, f"the interpreter's process exited {proc.returncode}:\n{output}"
  with np.load(path) as outputs:
    return dict(outputs)


def test_tpu_interpreter_matches_xla_and_brute_force(interpreted):
  """One test, so the interpreter's process runs once whichever worker takes it. The TPU
  interpreter simulates VMEM and DMAs (scratch starts as NaN, an out-of-bounds block read raises,
  parallel grid axes run shuffled); `interpret=True` is Pallas' HLO interpreter, what callers
  pass on CPU, with the default block_kv; bfloat16 within bfloat16's rounding."""
  for cfg in CASES:
    expected = run(make_case(1, b=3, **cfg), impl="xla")
    np.testing.assert_allclose(interpreted[case_id(cfg)], expected, atol=2e-5, rtol=0,
                               err_msg=case_id(cfg))
  case = make_case(HLO_INTERPRETER_CASE[0], **HLO_INTERPRETER_CASE[1])
  for expected in (run(case, impl="xla"), brute_force(case)):
    np.testing.assert_allclose(interpreted["interpret_true"], expected, atol=2e-5, rtol=0)
  case = make_case(BFLOAT16_CASE[0], **BFLOAT16_CASE[1])
  np.testing.assert_allclose(interpreted["bfloat16"], run(case, impl="xla"), atol=2e-2, rtol=0)
  np.testing.assert_allclose(interpreted["bfloat16"], brute_force(case), atol=3e-2, rtol=0)
  # NaN or inf in cache slots past a row's cache_len never reach the output.
  clean = interpreted["garbage_clean"]
  expected = run(make_case(3, **GARBAGE_CASE), impl="xla")
  np.testing.assert_allclose(clean, expected, atol=2e-5, rtol=0)
  for garbage in ("nan", "inf"):
    np.testing.assert_allclose(interpreted[f"garbage_{garbage}"], clean, atol=1e-6, rtol=0,
                               err_msg=garbage)


def test_pallas_impl_names_the_kernel_for_a_backend():
  assert [pallas_impl(name) for name in ("gpu", "cuda", "rocm", "tpu")] == [
      "pallas", "pallas", "pallas", "pallas_tpu"]
  with pytest.raises(ValueError, match="'cpu'"):
    pallas_impl("cpu")


def lower_for_tpu(fn, *args) -> str:
  """StableHLO text of `fn` lowered for TPU on this CPU-only host (no compile)."""
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


def qwen3_8b_args(t: int, s: int = 4096, b: int = 2) -> tuple:
  """Abstract bf16 arguments at Qwen3-8B attention shapes (32 query heads, 8 kv heads, H=128)."""
  n, k, h = 32, 8, 128
  bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  return (bf16(b, t, n, h), bf16(b, s, k, h), bf16(b, s, k, h),
          jax.ShapeDtypeStruct((b,), jnp.int32), bf16(b, t, k, h), bf16(b, t, k, h),
          jax.ShapeDtypeStruct((b, t, t), jnp.bool_))


@pytest.mark.parametrize("t", [16, 64, 256])
def test_lowers_for_tpu_at_qwen3_8b_shapes(t):
  fn = functools.partial(tree_attention, impl="pallas_tpu")
  assert MOSAIC_CALL in lower_for_tpu(fn, *qwen3_8b_args(t))


def test_lowering_odd_sizes_and_illegal_blocks():
  fn = functools.partial(tree_attention, impl="pallas_tpu", block_kv=384)
  assert MOSAIC_CALL in lower_for_tpu(fn, *qwen3_8b_args(37, s=4000))
  with pytest.raises(ValueError, match="multiple of 128"):
    fn = functools.partial(tree_attention, impl="pallas_tpu", block_kv=64)
    lower_for_tpu(fn, *qwen3_8b_args(16))
