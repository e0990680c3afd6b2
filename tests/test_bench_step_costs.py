"""bench/step_costs.py: a shrunk run writes a complete record; the GPU preset refuses a CPU."""

import json
import math
import subprocess
import sys

from conftest import CLI_ENV, ROOT

SCRIPT = "bench/step_costs.py"


def run_bench(*args, env=CLI_ENV):
  return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=600, env=env)


def positive(x) -> bool:
  return isinstance(x, float) and math.isfinite(x) and x > 0


def test_shrunk_run_writes_every_piece(tmp_path):
  out = tmp_path / "costs.json"
  # The record's form is under test, not its times: XLA's CPU optimizations only cost compile time.
  env = dict(CLI_ENV, XLA_FLAGS="--xla_backend_optimization_level=0")
  result = run_bench("--lengths", "32", "--budgets", "8,16", "--repeats", "2", "--layers", "2",
                     "--vocab", "512", "--loop-rounds", "3", "--out", str(out), env=env)
  assert result.returncode == 0, result.stderr
  assert "| AR step (ms) |" in result.stdout and "round / (head + verify) N=16" in result.stdout
  record = json.loads(out.read_text())
  assert record["preset"] == "cpu-small" and record["config"]["num_hidden_layers"] == 2
  assert record["loop"] == {"rounds": 3, "budget": 16, "attention": "xla"}
  assert list(record["lengths"]) == ["32"]
  length = record["lengths"]["32"]
  assert length["committed_length"] == 32 and length["cache_slots"] > 32
  assert set(length["pieces"]) == {"ar_step", "head/xla", "verify/xla/8", "verify/xla/16",
                                   "round/xla/8", "round/xla/16", "device_loop", "host_loop"}
  for name, piece in length["pieces"].items():
    assert positive(piece["ms"]) and positive(piece["compile_s"]), name
    assert len(piece["samples_ms"]) == 2 and all(map(positive, piece["samples_ms"])), name
  assert all(positive(s) for s in length["prefill_compile_s"].values())
  assert set(length["ratios"]) == {"head/ar_step/xla", "round/(head+verify)/xla/8",
                                   "round/(head+verify)/xla/16", "verify/ar_step/xla/8",
                                   "verify/ar_step/xla/16"}
  assert all(map(positive, length["ratios"].values()))
  assert [t["name"] for t in length["targets"]] == ["verify N=16 / AR step", "head / AR step"]
  assert all(positive(t["value"]) and isinstance(t["pass"], bool) for t in length["targets"])
  assert all(positive(record[k]) for k in ("compile_wall_s", "measure_wall_s", "wall_s"))


def test_gpu_preset_refuses_cpu_in_one_line():
  result = run_bench("--preset", "qwen3-8b")
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and "needs a GPU" in lines[0] and "--allow-cpu" in lines[0], lines
  assert result.stdout == ""
